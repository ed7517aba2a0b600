"""No job is ever stuck: each path that once left a job hanging, forced in real
processes (redis-server, `parkq web`, workers with faults injected by
tests/faultworker.py) rather than hoped for.

- A park asked for while a job is being replayed (resumed without its KV) is
  honoured, also when the replay's first new token ends the generation.
- A replay slower than the worker TTL keeps its worker alive (it beats between
  prompt chunks and tokens): no one reaps it.
- Redis restarting between a claim and the job's first write loses nothing.
- A waiting job that only its (busy) checkpoint holder may take does not make
  another worker park and re-claim its own job over and over.
- A batch's results outlive PARKQ_RESULT_TTL until its output file is written,
  and every key a batch leaves behind has a bound.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from tests.conftest import RedisServer
from tests.integration.helpers import (
    completion_text,
    job,
    logprob_tokens,
    read_events,
    read_with_reconnects,
    submit_stream,
    wait_until,
)
from tests.integration.test_parking import _long
from tests.integration.test_workers import Cluster, running_cluster

#: A prompt of many prefill chunks (n_batch is 16 in the tests): with a delay
#: per chunk its re-prefill outlasts the worker TTL (3 s in the tests).
LONG_PROMPT = "A long prompt to replay, chunk by chunk. " * 12
#: Each prompt chunk of a "slow" worker takes this long: the prompt's re-prefill
#: takes several seconds whatever this machine's speed.
SLOW_PREFILL = {"PARKQ_TEST_PREFILL_DELAY_SECONDS": "0.25"}


def _record(c: Cluster, job_id: str) -> dict[str, str]:
    client = redis.Redis.from_url(c.env["PARKQ_REDIS_URL"], decode_responses=True)
    try:
        return client.hgetall("{" + c.env["PARKQ_KEY_PREFIX"] + "}:job:" + job_id)
    finally:
        client.close()


def _stop(c: Cluster, name: str) -> None:
    proc = c.procs.pop(name)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture
def one_worker(redis_server, tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    prefix = f"stuck{time.monotonic_ns()}"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, ("ref",)) as c:
        yield c


def _park_by_stopping(c: Cluster, body: dict[str, Any], after_tokens: int) -> str:
    """Start a job on a worker that stops gracefully (parking the job, its KV gone
    with the process) once ``after_tokens`` tokens are recorded."""
    # Every token is written, so the stop lands at exactly that token.
    c.start_worker("a", env={"PARKQ_TEST_STOP_AFTER_TOKENS": str(after_tokens),
                             "PARKQ_WRITE_INTERVAL_SECONDS": "0"})  # fmt: skip
    resp = submit_stream(c.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    resp.close()
    wait_until(lambda: c.procs["a"].poll() is not None, timeout=120)
    c.procs.pop("a")
    state = job(c.base_url, job_id)
    assert state["state"] == "parked" and state["tokens"] == after_tokens + 1, state
    return job_id


@pytest.mark.timeout(300)
def test_a_park_asked_for_during_a_replay_is_honoured_even_at_the_last_token(
    one_worker: Cluster,
) -> None:
    c = one_worker
    max_tokens = 120
    body = _long(0.8, max_tokens=max_tokens, prompt=LONG_PROMPT)
    reference = read_events(submit_stream(c.base_url, body))
    _stop(c, "ref")
    wait_until(lambda: c.workers_alive() == 0, timeout=60)
    # Parked with every token but the last: the replay's first new token ends it.
    job_id = _park_by_stopping(c, body, max_tokens - 2)
    c.start_worker("b", env=SLOW_PREFILL)
    wait_until(lambda: job(c.base_url, job_id)["state"] == "running", timeout=60)
    short = submit_stream(c.base_url, {"prompt": "hi", "max_tokens": 4, "priority": "interactive"})
    short_id = short.headers["X-Job-Id"]
    assert read_events(short)[-1][1] == "[DONE]"
    rest = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events", stream=True, timeout=120)
    events = read_events(rest)
    rest.close()
    final, interrupter = job(c.base_url, job_id), job(c.base_url, short_id)
    assert final["state"] == "finished", final  # never left in `parking`
    # The short request did not wait for the replay: the replay parked for it.
    assert interrupter["finished_at"] < final["finished_at"]
    assert final["preemptions"] == 2
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)


@pytest.mark.timeout(300)
def test_a_replay_slower_than_the_worker_ttl_keeps_its_worker_alive(one_worker: Cluster) -> None:
    c = one_worker
    body = _long(0.8, max_tokens=400, prompt=LONG_PROMPT)
    reference = read_events(submit_stream(c.base_url, body))
    _stop(c, "ref")
    wait_until(lambda: c.workers_alive() == 0, timeout=60)
    job_id = _park_by_stopping(c, body, 100)
    c.start_worker("slow", env=SLOW_PREFILL)
    wait_until(lambda: job(c.base_url, job_id)["state"] == "running", timeout=60)
    c.start_worker("reaper")  # would requeue the replaying job if its worker looked dead
    rest = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events", stream=True, timeout=120)
    events = read_events(rest)
    rest.close()
    record = _record(c, job_id)
    assert record["state"] == "finished" and record["worker"] == "slow"
    assert "crashes" not in record  # never taken for dead
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)


AOF = ("--appendonly", "yes", "--appendfsync", "always")


@pytest.mark.timeout(300)
def test_redis_restarting_between_a_claim_and_the_first_write_loses_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start(*AOF)
    claim_delay = 4.0
    try:
        with running_cluster(server.url, tiny_model, tmp_path, "blip", ()) as c:
            c.start_worker("w", env={"PARKQ_TEST_CLAIM_DELAY_SECONDS": str(claim_delay)})
            wait_until(lambda: c.workers_alive() == 1, timeout=60)
            body = _long(0.0, max_tokens=300)
            reference = read_events(submit_stream(c.base_url, body))
            resp = submit_stream(c.base_url, body)
            job_id = resp.headers["X-Job-Id"]
            wait_until(lambda: job(c.base_url, job_id)["state"] == "running", timeout=60)
            # Claimed, and the worker has not read the job yet: Redis goes away
            # and comes back only after the worker's first read has failed.
            server.stop()
            time.sleep(claim_delay + 1)
            server.start(*AOF)
            events = read_with_reconnects(c.base_url, job_id, resp, per_connection=1000)
            assert [i for i, _ in events] == list(range(1, len(events) + 1))
            assert completion_text(events) == completion_text(reference)
            assert job(c.base_url, job_id)["state"] == "finished"
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_job_bound_to_a_busy_checkpoint_holder_causes_no_ping_pong(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    # Every decode step takes at least 5 ms: each job below runs for many seconds.
    slow = {"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.005", "PARKQ_AFFINITY_SECONDS": "120"}
    with running_cluster(redis_server.url, tiny_model, tmp_path, "pingpong", ()) as c:
        c.start_worker("holder", env=slow)
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        bound = submit_stream(c.base_url, _long(0.0, max_tokens=3000))
        bound_id = bound.headers["X-Job-Id"]
        read_events(bound, limit=20)
        # An interactive request parks it; its KV stays on `holder`, which now
        # runs the interactive one: the parked job may only go back there.
        hold = {"prompt": "hold", "max_tokens": 4000, "ignore_eos": True, "priority": "interactive"}
        busy = submit_stream(c.base_url, hold)
        busy_id = busy.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, bound_id)["state"] == "parked", timeout=60)
        c.start_worker("other", env=slow)
        wait_until(lambda: c.workers_alive() == 2, timeout=60)
        low = submit_stream(c.base_url, _long(0.0, max_tokens=3000, priority=-5))
        low_id = low.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, low_id)["state"] == "running", timeout=60)
        # While `holder` serves the interactive job, `other` keeps its own job:
        # the better waiting job (bound to `holder`) is no reason to park it.
        watch_until = time.monotonic() + 3
        while time.monotonic() < watch_until:
            assert job(c.base_url, low_id)["preemptions"] == 0
            time.sleep(0.05)
        assert job(c.base_url, busy_id)["state"] == "running"  # the window was real
        assert job(c.base_url, bound_id)["state"] == "parked"
        requests.delete(f"{c.base_url}/v1/jobs/{busy_id}", timeout=10)
        wait_until(lambda: job(c.base_url, bound_id)["state"] == "running", timeout=60)
        assert job(c.base_url, bound_id)["worker"] == "holder"  # resumed from its checkpoint
        assert job(c.base_url, low_id)["preemptions"] == 0
        for resp in (bound, busy, low):
            resp.close()
        for job_id in (bound_id, low_id):
            requests.delete(f"{c.base_url}/v1/jobs/{job_id}", timeout=10)


def _upload(c: Cluster, lines: list[str]) -> dict[str, Any]:
    return requests.post(
        f"{c.base_url}/v1/files",
        files={"file": ("in.jsonl", "\n".join(lines).encode())},
        data={"purpose": "batch"},
        timeout=30,
    ).json()


def _line(custom_id: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


@pytest.mark.timeout(300)
def test_a_batchs_results_outlive_the_result_ttl_and_its_keys_are_bounded(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    prefix = "ttl"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, ()) as c:
        # Results live 1 s; each line takes well over that (10 ms per token).
        env = {"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.01", "PARKQ_RESULT_TTL": "1"}
        c.start_worker("w", env=env)
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        lines = [_line(f"doc-{i}", f"Document {i} says") for i in range(3)]
        uploaded = _upload(c, lines)
        batch = requests.post(
            f"{c.base_url}/v1/batches",
            json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                  "completion_window": "24h"},
            timeout=30,
        ).json()  # fmt: skip
        deadline = time.monotonic() + 240
        while (got := requests.get(f"{c.base_url}/v1/batches/{batch['id']}", timeout=10).json())[
            "status"
        ] not in ("completed", "failed"):
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got["status"] == "completed" and got["request_counts"]["completed"] == 3, got
        output = requests.get(
            f"{c.base_url}/v1/files/{got['output_file_id']}/content", timeout=30
        ).text
        results = [json.loads(line) for line in output.splitlines()]
        assert [r["custom_id"] for r in results] == ["doc-0", "doc-1", "doc-2"]
        for r in results:
            assert r["error"] is None and r["response"]["status_code"] == 200
            assert r["response"]["body"]["usage"]["completion_tokens"] == 150

        # Every key left has an owner's bound: a TTL, or one of the keys that
        # scheduler/keys.py names as bounded by count.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            base = "{" + prefix + "}:"
            by_count = {"queue", "wake", "workers", "running", "counters", "preemptions",
                        "files", "batches", "ended", "janitor", "batches:waiting",
                        "webhooks", "turns"}  # fmt: skip
            kept = {
                f"file:{uploaded['id']}",  # an uploaded file lives until deleted
                f"file:{uploaded['id']}:content",
                "worker:w",  # a live worker's own hash
            }
            retention = 30 * 86400
            for key in client.scan_iter(base + "*"):
                name = key[len(base) :]
                ttl = client.ttl(key)
                if name in by_count or name in kept or name.split(":")[0] in ("hist", "samples"):
                    continue
                if name.startswith("usage:"):  # an hour's usage: kept its own retention
                    assert 0 < ttl <= 90 * 86400 + 3600, f"{key} has no bound (ttl {ttl})"
                    continue
                assert 0 < ttl <= retention, f"{key} has no bound (ttl {ttl})"
            output_file = requests.get(
                f"{c.base_url}/v1/files/{got['output_file_id']}", timeout=10
            ).json()
            assert 0 < output_file["expires_at"] - time.time() <= retention
        finally:
            client.close()


def _batch_status(c: Cluster, batch_id: str) -> dict[str, Any]:
    return requests.get(f"{c.base_url}/v1/batches/{batch_id}", timeout=10).json()


@pytest.mark.timeout(300)
def test_a_batch_is_answered_while_validating_and_cancelled_then_runs_no_line(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """`POST /v1/batches` answers before its lines are read (the web's
    validation is held by the test, tests/faultweb.py); other requests are
    served meanwhile; a batch cancelled during validation never runs a line,
    and the next batch runs normally once validation may go on."""
    gate = tmp_path / "validation-may-go-on"
    web_env = {"PARKQ_TEST_VALIDATION_GATE": str(gate)}
    prefix = f"validating{time.monotonic_ns()}"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, ("w",), web_env) as c:
        lines = [_line(f"doc-{i}", f"Document {i} says") for i in range(3)]
        uploaded = _upload(c, lines)
        body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                "completion_window": "24h"}  # fmt: skip
        held = requests.post(f"{c.base_url}/v1/batches", json=body, timeout=30)
        assert held.status_code == 200 and held.json()["status"] == "validating"
        held_id = held.json()["id"]

        # Served while the batch is being validated.
        resp = submit_stream(c.base_url, {"prompt": "Meanwhile", "max_tokens": 8})
        events = read_events(resp)
        assert events[-1][1] == "[DONE]" and completion_text(events)
        assert _batch_status(c, held_id)["status"] == "validating"

        cancelled = requests.post(f"{c.base_url}/v1/batches/{held_id}/cancel", timeout=30)
        assert cancelled.status_code == 200
        assert cancelled.json()["status"] in ("cancelling", "cancelled")
        second = requests.post(f"{c.base_url}/v1/batches", json=body, timeout=30).json()
        assert second["status"] == "validating"

        gate.touch()
        deadline = time.monotonic() + 240
        while (done := _batch_status(c, second["id"]))["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, done
            time.sleep(0.2)
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 3

        ended = _batch_status(c, held_id)
        assert ended["status"] == "cancelled", ended
        assert ended["request_counts"]["completed"] == 0
        assert ended["output_file_id"] is None
        # No line of the cancelled batch ever reached a queue or a worker: the
        # worker ran the interactive request and the second batch's 3 lines only.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            jobs = [k for k in client.scan_iter("{" + prefix + "}:job:*") if k.count(":") == 2]
            assert len(jobs) == 4, jobs
            assert not list(client.scan_iter("{" + prefix + "}:pending:*"))
        finally:
            client.close()
