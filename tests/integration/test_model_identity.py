"""A web server and workers that load different models never answer with the wrong one.

Real processes: `parkq web` tokenizes for one model file, `parkq worker`s load
another (the compose mistake of two `PARKQ_MODEL`s). Workers announce what they
serve; the web reports the mismatch on /healthz, refuses requests with an error
naming both models and leaves no job behind, and a job is only ever claimed by
a worker serving the model it was tokenized for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from jobs.engine.testmodel import write_test_model
from tests.integration.helpers import job, wait_until
from tests.integration.test_workers import Cluster

CHAT = {"messages": [{"role": "user", "content": "Which model are you?"}], "max_tokens": 8}


@pytest.fixture
def cluster(redis_server, tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(redis_server.url, tiny_model, tmp_path, prefix=f"ident-{tmp_path.name}")
    c.start("web", ["web", "--port", str(c.port)])
    try:
        yield c
    finally:
        c.stop()


def _health(c: Cluster) -> tuple[int, dict[str, Any]]:
    try:
        resp = requests.get(c.base_url + "/healthz", timeout=5)
    except requests.RequestException:
        return 0, {}
    return resp.status_code, resp.json()


def _keys(c: Cluster, redis_url: str) -> tuple[list[bytes], int]:
    """The job records under the cluster's prefix and the length of its RQ queue."""
    client = redis.Redis.from_url(redis_url)
    prefix = c.env["PARKQ_KEY_PREFIX"]
    records = list(client.scan_iter(match="{" + prefix + "}:job:*", count=1000))
    return records, int(client.llen(f"rq:queue:{c.env['PARKQ_QUEUE_NAME']}"))


def _refused(c: Cluster, redis_url: str, other: str, why: str) -> None:
    wait_until(lambda: _health(c)[1].get("status") == "model_mismatch", timeout=90)
    status, body = _health(c)
    assert status == 503 and body["workers"] == 0
    assert any(other in m for m in body["other_models"])
    for path, payload in [
        ("/v1/chat/completions", CHAT),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
    ]:
        resp = requests.post(c.base_url + path, json=payload, timeout=30)
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["code"] == "model_mismatch" and err["type"] == "server_error"
        assert "tiny" in err["message"] and other in err["message"]
        assert why in err["message"]
    assert _keys(c, redis_url) == ([], 0)  # no job left behind


def test_workers_with_other_weights_are_reported_and_never_answer(
    cluster: Cluster, redis_server, tmp_path: Path
) -> None:
    other = write_test_model(tmp_path / "models" / "other-weights.gguf", seed=1)
    cluster.start_worker("wrong", env={"PARKQ_MODEL": str(other)})
    _refused(cluster, redis_server.url, "other-weights", "the same vocabulary but other weights")

    models = requests.get(cluster.base_url + "/v1/models", timeout=5).json()["data"]
    by_id = {m["id"]: m for m in models}
    assert by_id["tiny"]["accepts_requests"] and by_id["tiny"]["workers"] == 0
    assert by_id["other-weights"]["workers"] == 1
    assert not by_id["other-weights"]["accepts_requests"]
    assert by_id["tiny"]["sha256"] != by_id["other-weights"]["sha256"]

    # A worker with the right model makes the service healthy again, and the
    # wrong one, still running, never claims a job.
    cluster.start_worker("right")
    wait_until(lambda: _health(cluster)[0] == 200, timeout=90)
    for _ in range(4):
        resp = requests.post(cluster.base_url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert resp.status_code == 200, resp.text
        assert job(cluster.base_url, resp.json()["id"])["worker"] == "right"
    assert cluster.procs["wrong"].poll() is None


def test_workers_with_another_vocabulary_are_reported_and_never_answer(
    cluster: Cluster, redis_server, tmp_path: Path
) -> None:
    other = write_test_model(
        tmp_path / "models" / "other-vocab.gguf", seed=0, extra_words=["zebra", "quartz"]
    )
    cluster.start_worker("wrong", env={"PARKQ_MODEL": str(other)})
    _refused(cluster, redis_server.url, "other-vocab", "another vocabulary")
    created = requests.post(
        cluster.base_url + "/v1/files",
        files={"file": ("in.jsonl", b'{"custom_id": "a", "url": "/v1/completions", '
                        b'"body": {"prompt": "x", "max_tokens": 2}}\n')},
        data={"purpose": "batch"},
        timeout=30,
    )  # fmt: skip
    assert created.status_code == 200, created.text
    resp = requests.post(
        cluster.base_url + "/v1/batches",
        json={
            "input_file_id": created.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
        timeout=30,
    )
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_mismatch"
    assert requests.get(cluster.base_url + "/v1/batches", timeout=5).json()["data"] == []
