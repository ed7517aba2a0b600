"""Redis memory has a ceiling: a finished job keeps its result, not its
per-token events (those stay replayable PARKQ_REPLAY_SECONDS), and a batch
nobody reads still ends and lets its lines' events go. Real processes:
`parkq web` (its janitor), a worker, a redis-server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from scheduler.keys import Keys
from tests.integration.helpers import (
    completion_text,
    read_events,
    submit_stream,
    wait_until,
    web_answers,
)
from tests.integration.test_stuck import _line, _upload
from tests.integration.test_workers import Cluster, running_cluster

#: Events replayable 2 s after the end; the janitor sweeps every 0.2 s.
WEB_ENV = {"PARKQ_REPLAY_SECONDS": "2", "PARKQ_JANITOR_SECONDS": "0.2"}
BODY = {"prompt": "Kept as a result", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "logprobs": 2}  # fmt: skip


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("retention")
    with running_cluster(redis_server.url, tiny_model, root, "retention", ("w",),
                         web_env=WEB_ENV) as c:  # fmt: skip
        yield c


def _redis(c: Cluster) -> redis.Redis:
    return redis.Redis.from_url(c.env["PARKQ_REDIS_URL"])


def _gone(c: Cluster, key: str) -> bool:
    return not _redis(c).exists(key)


def test_a_finished_job_keeps_its_result_and_lets_its_events_go(stack: Cluster) -> None:
    c = stack
    resp = submit_stream(c.base_url, BODY)
    job_id = resp.headers["X-Job-Id"]
    seen = read_events(resp)
    keys = Keys("retention")
    # Within the replay window a reconnect replays the events.
    again = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events",
                         headers={"Last-Event-ID": str(seen[-5][0])}, timeout=10)  # fmt: skip
    assert again.status_code == 200 and again.text.rstrip().endswith("data: [DONE]")
    wait_until(lambda: _gone(c, keys.events(job_id)), timeout=30)
    assert _redis(c).ttl(keys.job(job_id)) > 3600  # the record (and result) stay
    result = requests.get(f"{c.base_url}/v1/jobs/{job_id}/result", timeout=10)
    assert result.status_code == 200
    body = result.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 40
    choice = body["choices"][0]
    assert choice["text"] == completion_text(seen) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == 40
    # After the window a reconnect that lacks events is told where the result is;
    # one that has everything is told there is nothing more.
    late = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events",
                        headers={"Last-Event-ID": str(seen[-5][0])}, timeout=10)  # fmt: skip
    assert late.status_code == 410
    assert f"/v1/jobs/{job_id}/result" in late.json()["error"]["message"]
    done = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events",
                        headers={"Last-Event-ID": str(seen[-1][0])}, timeout=10)  # fmt: skip
    assert done.status_code == 204


def test_the_result_of_an_n2_request_has_both_choices(stack: Cluster) -> None:
    c = stack
    body = {"messages": [{"role": "user", "content": "Two of them"}], "max_tokens": 10, "n": 2,
            "temperature": 0.9, "seed": 5}  # fmt: skip
    whole = requests.post(f"{c.base_url}/v1/chat/completions", json=body, timeout=60).json()
    keys = Keys("retention")
    wait_until(lambda: _gone(c, keys.events(whole["id"] + "_1")), timeout=30)
    kept = requests.get(f"{c.base_url}/v1/jobs/{whole['id']}/result", timeout=10).json()
    assert [ch["message"] for ch in kept["choices"]] == [ch["message"] for ch in whole["choices"]]
    assert [ch["index"] for ch in kept["choices"]] == [0, 1]
    assert kept["usage"] == whole["usage"]


def test_the_result_of_a_running_job_is_a_clear_409(stack: Cluster) -> None:
    c = stack
    resp = submit_stream(c.base_url, {**BODY, "max_tokens": 3000, "logprobs": None})
    job_id = resp.headers["X-Job-Id"]
    read_events(resp, limit=1)
    early = requests.get(f"{c.base_url}/v1/jobs/{job_id}/result", timeout=10)
    assert early.status_code == 409 and early.json()["error"]["code"] == "job_running"
    requests.delete(f"{c.base_url}/v1/jobs/{job_id}", timeout=10)
    resp.close()


@pytest.mark.timeout(300)
def test_a_batch_nobody_reads_ends_and_lets_its_lines_events_go(stack: Cluster) -> None:
    """No GET of the batch: the janitor queues its lines and writes its files."""
    c = stack
    lines = [_line(f"doc-{i}", f"Document {i} says") for i in range(6)]
    uploaded = _upload(c, lines)
    batch = requests.post(f"{c.base_url}/v1/batches",
                          json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                                "completion_window": "24h"}, timeout=30).json()  # fmt: skip
    r, keys = _redis(c), Keys("retention")

    def status() -> dict[str, Any]:
        raw = r.hgetall(keys.batch(batch["id"]))
        return {k.decode(): v.decode() for k, v in raw.items()}

    wait_until(lambda: status().get("status") == "completed", timeout=240)
    record = status()
    assert record["output_file_id"] and int(record["completed"]) == 6
    jobs = [json.loads(x)["job"] for x in r.lrange(keys.batch_items(batch["id"]), 0, -1)]
    wait_until(lambda: all(_gone(c, keys.events(j)) for j in jobs), timeout=30)
    out = requests.get(f"{c.base_url}/v1/files/{record['output_file_id']}/content", timeout=30)
    results = [json.loads(line) for line in out.text.splitlines()]
    assert sorted(x["custom_id"] for x in results) == [f"doc-{i}" for i in range(6)]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 150 for x in results)


def test_uploads_past_the_quota_are_refused_and_each_expires(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """`parkq web` with a 2,000-byte quota for uploads, kept an hour each."""
    env = {"PARKQ_FILES_MAX_BYTES": "2000", "PARKQ_FILE_TTL_SECONDS": "3600"}
    with running_cluster(redis_server.url, tiny_model, tmp_path, "quota", (), web_env=env) as c:
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        first = _upload(c, [_line(f"a{i}", "x" * 300) for i in range(3)])
        assert 0 < first["expires_at"] - time.time() <= 3600
        assert 0 < _redis(c).ttl(Keys("quota").file_content(first["id"])) <= 3600
        over = requests.post(f"{c.base_url}/v1/files", data={"purpose": "batch"},
                             files={"file": ("b.jsonl", b"\n".join(
                                 _line(f"b{i}", "y" * 300).encode() for i in range(3)))},
                             timeout=30)  # fmt: skip
        assert over.status_code == 413
        assert over.json()["error"]["code"] == "files_quota_exceeded"
        ids = [f["id"] for f in requests.get(f"{c.base_url}/v1/files", timeout=10).json()["data"]]
        assert ids == [first["id"]]
