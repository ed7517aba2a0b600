"""Clients that go away: interactive work is freed after a grace period, a
reconnect within it continues losslessly, batch work runs on without a client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import redis
import requests

from tests.integration.conftest import Server
from tests.integration.helpers import job, read_events, submit_stream, wait_until
from tests.integration.test_workers import Cluster, running_cluster
from web.api import choice_id

LONG = {"prompt": "A reply nobody reads", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    """A worker whose decode steps take at least 2 ms: a 3,000-token job runs
    for 6 s or more on any machine, longer than the grace (1 s here)."""
    root = tmp_path_factory.mktemp("disconnect")
    with running_cluster(redis_server.url, tiny_model, root, "disconnect", ()) as c:
        c.start_worker("slow", env={"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.002"})
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        yield c


def test_an_abandoned_interactive_stream_frees_the_engine_after_the_grace(slow: Cluster) -> None:
    server = slow
    resp = submit_stream(server.base_url, {**LONG, "priority": "interactive"})
    job_id = resp.headers["X-Job-Id"]
    read_events(resp, limit=20)
    resp.close()
    left = time.monotonic()
    wait_until(lambda: job(server.base_url, job_id)["state"] == "cancelled", timeout=30)
    status = job(server.base_url, job_id)
    assert status["finish_reason"] == "client_gone"
    assert status["tokens"] < 3000
    freed = time.monotonic() - left
    assert freed >= 1.0  # not before the grace period (1 s here)
    print(f"\ndisconnect: engine freed {freed:.2f} s after the client left (grace 1 s)")


def test_a_non_streamed_request_whose_client_left_is_abandoned_after_the_grace(
    slow: Cluster,
) -> None:
    """The client gives up after 1 s (its timeout closes the connection): the web
    notices, and the worker frees the engine after the grace period, as for a
    stream; a job nobody waits for no longer runs to its end."""
    server = slow
    body = {**LONG, "priority": "interactive"}
    with pytest.raises(requests.Timeout):
        requests.post(f"{server.base_url}/v1/completions", json=body, timeout=(5, 1))
    job_id = _newest_job(server)
    wait_until(lambda: job(server.base_url, job_id)["state"] == "cancelled", timeout=30)
    status = job(server.base_url, job_id)
    assert status["finish_reason"] == "client_gone" and status["tokens"] < 3000


def _newest_job(c: Cluster) -> str:
    """The id of the job most recently created in ``c``'s deployment."""
    r = redis.Redis.from_url(c.env["PARKQ_REDIS_URL"])
    prefix = f"{{{c.env['PARKQ_KEY_PREFIX']}}}:job:".encode()
    newest = max(
        (float(r.hget(key, "created_at") or 0), key[len(prefix) :].decode())
        for key in r.scan_iter(match=prefix + b"*")
    )
    return newest[1]


def test_a_reconnect_within_the_grace_continues_losslessly(server: Server) -> None:
    resp = submit_stream(server.base_url, {**LONG, "priority": "interactive", "max_tokens": 800})
    job_id = resp.headers["X-Job-Id"]
    seen = read_events(resp, limit=20)
    resp.close()
    time.sleep(0.3)
    again = requests.get(
        f"{server.base_url}/v1/jobs/{job_id}/events",
        headers={"Last-Event-ID": str(seen[-1][0])},
        stream=True,
        timeout=60,
    )
    seen += read_events(again)
    assert seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    status = job(server.base_url, job_id)
    assert status["state"] == "finished" and status["tokens"] == 800


def test_a_batch_job_runs_on_without_a_client(server: Server) -> None:
    resp = submit_stream(server.base_url, {**LONG, "priority": "batch", "max_tokens": 1500})
    job_id = resp.headers["X-Job-Id"]
    read_events(resp, limit=5)
    resp.close()
    wait_until(lambda: job(server.base_url, job_id)["state"] == "finished", timeout=60)
    assert job(server.base_url, job_id)["tokens"] == 1500


def test_a_client_that_leaves_a_queued_job_is_noticed_and_the_job_never_runs(
    slow: Cluster,
) -> None:
    server = slow
    # A job above every interactive one holds the only worker, so the next waits.
    blocker = submit_stream(server.base_url, {**LONG, "priority": 1000, "max_tokens": 3000})
    blocker_id = blocker.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, blocker_id)["state"] == "running")
    resp = submit_stream(server.base_url, {**LONG, "priority": "interactive", "max_tokens": 50})
    job_id = resp.headers["X-Job-Id"]
    assert job(server.base_url, job_id)["state"] == "queued"
    resp.close()  # only the headers and the first comment were read
    left = time.monotonic()
    key = f"{{disconnect}}:job:{job_id}"
    client = redis.Redis.from_url(server.env["PARKQ_REDIS_URL"])
    # Noticed without a keep-alive write (15 s apart by default): within seconds.
    wait_until(lambda: client.hget(key, "readers") == b"0", timeout=10)
    client.close()
    noticed = time.monotonic() - left
    time.sleep(max(0.0, 1.5 - noticed))  # past the grace (1 s here) before it can run
    requests.delete(f"{server.base_url}/v1/jobs/{blocker_id}", timeout=10)
    blocker.close()
    wait_until(lambda: job(server.base_url, job_id)["state"] == "cancelled", timeout=60)
    status = job(server.base_url, job_id)
    assert status["finish_reason"] == "client_gone" and status["tokens"] == 0
    print(f"\ndisconnect while queued: noticed after {noticed:.2f} s")


def test_a_stream_whose_second_registration_fails_leaves_no_reader_behind(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """An `n` = 2 stream whose second job's reader registration gets a Redis error
    (injected in the web process: tests/faultreaders.py): the stream ends, no
    reader is left counted on either job, and both interactive jobs are cancelled
    as abandoned after the grace (1 s here). Before: the first job's count stayed
    at 1 and it ran to its end with nobody reading."""
    c = Cluster(redis_server.url, tiny_model, tmp_path, prefix="regfail")
    c._start_faulty("web", "tests.faultreaders", ["--port", str(c.port)],
                    {"PARKQ_TEST_READER_FAIL": "2"})  # fmt: skip
    try:
        c.start_worker("slow", env={"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.002"})
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        body = {**LONG, "priority": "interactive", "n": 2, "temperature": 0.8, "seed": 3}
        resp = submit_stream(c.base_url, body)
        job_ids = [choice_id(resp.headers["X-Job-Id"], i) for i in range(2)]
        with pytest.raises(requests.RequestException):
            read_events(resp)  # the stream is cut by the failed registration
        resp.close()
        r = redis.Redis.from_url(c.env["PARKQ_REDIS_URL"])
        for job_id in job_ids:
            wait_until(partial(_in_state, c, job_id, "cancelled"), timeout=30)
            status = job(c.base_url, job_id)
            assert status["finish_reason"] == "client_gone" and status["tokens"] < 3000
            assert int(r.hget(f"{{regfail}}:job:{job_id}", "readers") or 0) == 0
        r.close()
    finally:
        c.stop()


def _in_state(c: Cluster, job_id: str, state: str) -> bool:
    return bool(job(c.base_url, job_id)["state"] == state)
