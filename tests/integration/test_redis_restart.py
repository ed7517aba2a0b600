"""Redis restarts (AOF on, as in compose) in the middle of streams."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.conftest import RedisServer
from tests.integration.conftest import TEST_ENV, start_parkq, stop_parkq
from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    reading_in_background,
    submit_stream,
    wait_until,
)

AOF = ("--appendonly", "yes", "--appendfsync", "everysec")
BODY = {"prompt": "survive a restart", "max_tokens": 3000, "temperature": 0,
        "ignore_eos": True, "priority": "batch"}  # fmt: skip


def _healthy(base: str) -> bool:
    try:
        return requests.get(base + "/healthz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


@pytest.mark.timeout(240)
def test_streams_queued_and_parked_jobs_survive_a_redis_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start(*AOF)
    proc, base = start_parkq(tiny_model, redis.url, env=TEST_ENV)
    try:
        first = submit_stream(base, BODY)
        expected = completion_text(read_events(first))
        resp = submit_stream(base, BODY)
        job_id = resp.headers["X-Job-Id"]
        queued = submit_stream(base, {**BODY, "max_tokens": 50})
        queued_id = queued.headers["X-Job-Id"]
        queued.close()
        reader, seen = reading_in_background(base, resp, 10_000)
        wait_until(lambda: job(base, job_id)["tokens"] > 200)
        # An interactive job parks the batch job; Redis restarts while it runs.
        urgent = submit_stream(base, {**BODY, "priority": "interactive"})
        urgent_id = urgent.headers["X-Job-Id"]
        urgent_reader, urgent_seen = reading_in_background(base, urgent, 500)
        wait_until(lambda: job(base, job_id)["state"] == "parked", timeout=60)
        wait_until(lambda: job(base, urgent_id)["tokens"] > 100, timeout=60)
        redis.stop()
        # The probes meanwhile: the web process is alive, not ready.
        assert requests.get(base + "/livez", timeout=5).json() == {"status": "ok"}
        ready = requests.get(base + "/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["redis"] is False
        redis.start(*AOF)
        t0 = time.monotonic()
        wait_until(lambda: _healthy(base), 30)
        assert requests.get(base + "/readyz", timeout=5).json()["status"] == "ok"
        print(f"\nredis restart: /healthz back after {time.monotonic() - t0:.2f} s")
        for thread in (reader, urgent_reader):
            thread.join(timeout=120)
        for events in (seen, urgent_seen):
            assert events and events[-1][1] == "[DONE]"
            assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert completion_text(seen) == expected  # the parked job resumed exactly
        assert job(base, job_id)["preemptions"] >= 1
        wait_until(lambda: job(base, queued_id)["state"] == "finished", timeout=60)
    finally:
        assert stop_parkq(proc) == 0
        redis.stop()
