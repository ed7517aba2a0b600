"""A full web server says so: past PARKQ_MAX_STREAMS open streams and waiting
requests a new one gets 503 with Retry-After, before any job is queued; /healthz
and short requests still answer; a stream that closes frees its slot.

A real `parkq web` (no worker: every stream stays open on keep-alives) against
a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from scheduler.keys import Keys
from tests.integration.helpers import wait_until, web_answers
from tests.integration.test_workers import Cluster, running_cluster

CAP = 12
BODY = {"prompt": "Waiting for a worker", "max_tokens": 5}


@pytest.fixture
def web(redis_server, tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    prefix = f"cap{time.monotonic_ns()}"
    env = {"PARKQ_MAX_STREAMS": str(CAP)}
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, (), web_env=env) as c:
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        yield c


def _queued(c: Cluster, redis_url: str) -> int:
    return int(redis.Redis.from_url(redis_url).zcard(Keys(c.env["PARKQ_KEY_PREFIX"]).queue))


def test_past_the_cap_a_request_gets_503_and_nothing_is_queued(web: Cluster, redis_server) -> None:
    c = web
    streams: list[requests.Response] = []

    def accepted() -> bool:
        """Open one more stream; whether the server took it."""
        resp = requests.post(f"{c.base_url}/v1/completions", json={**BODY, "stream": True},
                             stream=True, timeout=10)  # fmt: skip
        if resp.status_code == 200:
            streams.append(resp)
            return True
        assert resp.status_code == 503, resp.text
        resp.close()
        return False

    try:
        assert all(accepted() for _ in range(CAP))
        assert _queued(c, redis_server.url) == CAP
        refused = [
            requests.post(f"{c.base_url}/v1/completions", json={**BODY, "stream": True},
                          timeout=10),
            requests.post(f"{c.base_url}/v1/completions", json=BODY, timeout=10),
            requests.post(f"{c.base_url}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            requests.get(f"{c.base_url}/v1/jobs/{streams[0].headers['X-Job-Id']}/events",
                         timeout=10),
        ]  # fmt: skip
        for resp in refused:
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "server_busy"
            assert 1 <= int(resp.headers["Retry-After"]) <= 10
        assert _queued(c, redis_server.url) == CAP  # the refused ones queued nothing
        # Everything that does not hold a slot still answers (no worker: 503 "unavailable").
        health = requests.get(f"{c.base_url}/healthz", timeout=5)
        assert health.json()["redis"] is True and health.json()["status"] == "unavailable"
        job_id = streams[1].headers["X-Job-Id"]
        assert requests.get(f"{c.base_url}/v1/jobs/{job_id}", timeout=5).json()["state"] == "queued"
        # A stream whose client leaves frees its slot.
        streams.pop().close()
        wait_until(accepted, timeout=30)
        assert len(streams) == CAP
    finally:
        for s in streams:
            s.close()
    streams.clear()
    # Every slot comes back once the clients have left.
    for _ in range(CAP):
        wait_until(accepted, timeout=30)
    assert not accepted()
    for s in streams:
        s.close()
