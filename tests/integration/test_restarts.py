"""A worker restarted under its old name takes over its previous life's jobs.

Real restarts keep the name (`parkq up` restarts worker N as worker N; compose's
`restart:` keeps the hostname and PID 1): the new instance must requeue and
resume what the SIGKILLed one held at once, not refuse to start as a "live twin"
and not refresh the dead one's liveness with its own heartbeat.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
import requests

from tests.integration.conftest import TEST_ENV, start_parkq, stop_parkq
from tests.integration.helpers import (
    children,
    completion_text,
    job,
    logprob_tokens,
    read_events,
    submit_stream,
    wait_until,
)
from tests.integration.test_parking import _long
from tests.integration.test_workers import running_cluster

CLI = [sys.executable, "-m", "tools.cli"]


def test_a_worker_restarted_under_its_old_name_resumes_its_job(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    body = _long(0.8, max_tokens=2500)
    with running_cluster(redis_server.url, tiny_model, tmp_path, "samename", ("gpu0",)) as c:
        reference = read_events(submit_stream(c.base_url, body))
        resp = submit_stream(c.base_url, body)
        job_id = resp.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, job_id)["tokens"] > 100)
        c.procs["gpu0"].send_signal(signal.SIGKILL)
        c.procs["gpu0"].wait()
        c.start_worker("gpu0")  # once, at once: it must not refuse the name
        events = read_events(resp)
        resp.close()
        assert c.procs["gpu0"].poll() is None, "the restarted worker exited"
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert completion_text(events) == completion_text(reference)
        assert logprob_tokens(events) == logprob_tokens(reference)
        status = job(c.base_url, job_id)
        assert status["state"] == "finished" and status["worker"] == "gpu0"


def test_parkq_up_restarts_a_sigkilled_worker_and_keeps_serving(
    redis_server, tiny_model: Path
) -> None:
    env = {**TEST_ENV, "PARKQ_KEY_PREFIX": "uprestart", "PARKQ_QUEUE_NAME": "uprestart"}
    proc, base = start_parkq(tiny_model, redis_server.url, env=env)
    try:
        body = _long(0.0, max_tokens=2500)
        reference = read_events(submit_stream(base, body))
        for _ in range(2):  # twice: a restarted worker can be killed again
            resp = submit_stream(base, body)
            job_id = resp.headers["X-Job-Id"]

            def started(job_id: str = job_id) -> bool:
                return bool(job(base, job_id)["tokens"] > 100)

            wait_until(started)
            workers = [pid for pid, cmd in children(proc.pid) if " worker" in cmd]
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            events = read_events(resp)
            resp.close()
            assert completion_text(events) == completion_text(reference)
            assert [i for i, _ in events] == list(range(1, len(events) + 1))
            assert job(base, job_id)["state"] == "finished"
        assert proc.poll() is None, "parkq up stopped"
    finally:
        stop_parkq(proc)


def _events_from(base: str, job_id: str, after: int) -> list[tuple[int, str]]:
    """The job's events after ``after``, read to the end (a reconnect with Last-Event-ID)."""
    resp = requests.get(
        f"{base}/v1/jobs/{job_id}/events",
        headers={"Last-Event-ID": str(after)},
        stream=True,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    with resp:
        return read_events(resp)


def _restart_keeps_every_job(tiny_model: Path, tmp_path: Path, crash: bool) -> None:
    data = tmp_path / "data"
    body = _long(0.8, max_tokens=2500)
    proc, base = start_parkq(tiny_model, None, "--data-dir", str(data), env=TEST_ENV)
    try:
        reference = read_events(submit_stream(base, body))
        running = submit_stream(base, body)
        queued = submit_stream(base, {**body, "priority": -5})  # waits behind the first
        running_id, queued_id = running.headers["X-Job-Id"], queued.headers["X-Job-Id"]
        seen = read_events(running, limit=100)
        running.close()
        queued.close()
        assert job(base, queued_id)["state"] == "queued"
        # One `parkq up` per data directory.
        other = subprocess.run(
            [*CLI, "up", "--model", str(tiny_model), "--port", "0", "--data-dir", str(data)],
            capture_output=True, text=True, timeout=120, env={**os.environ, **TEST_ENV},
        )  # fmt: skip
        assert other.returncode == 1 and "is using the data directory" in other.stderr
        if crash:  # every process at once, as a power cut or an OOM kill of the group would
            for pid, _ in children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        else:
            assert stop_parkq(proc) == 0
    finally:
        if proc.poll() is None:
            stop_parkq(proc)
    proc, base = start_parkq(tiny_model, None, "--data-dir", str(data), env=TEST_ENV)
    try:
        rest = _events_from(base, running_id, seen[-1][0])
        events = seen + rest
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert completion_text(events) == completion_text(reference)
        assert logprob_tokens(events) == logprob_tokens(reference)
        later = _events_from(base, queued_id, 0)
        assert completion_text(later) == completion_text(reference)
        assert job(base, running_id)["state"] == job(base, queued_id)["state"] == "finished"
    finally:
        stop_parkq(proc)


def test_parkq_up_stopped_and_started_again_resumes_every_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    _restart_keeps_every_job(tiny_model, tmp_path, crash=False)


def test_parkq_up_killed_outright_and_started_again_resumes_every_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    _restart_keeps_every_job(tiny_model, tmp_path, crash=True)


def test_an_ephemeral_parkq_up_keeps_nothing(tiny_model: Path) -> None:
    proc, base = start_parkq(tiny_model, None, "--ephemeral", env=TEST_ENV)
    try:
        job_id = submit_stream(base, _long(0.0, max_tokens=50)).headers["X-Job-Id"]
    finally:
        stop_parkq(proc)
    proc, base = start_parkq(tiny_model, None, "--ephemeral", env=TEST_ENV)
    try:
        assert requests.get(f"{base}/v1/jobs/{job_id}", timeout=10).status_code == 404
    finally:
        stop_parkq(proc)


def test_a_lone_worker_stalled_past_its_ttl_keeps_its_job(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """A worker frozen past its TTL with no other worker to reap it (a starved CPU,
    a long pause) resumes its own job where it was: its own beat must not take it
    for dead, requeue its job and replay it."""
    body = _long(0.8, max_tokens=2500)
    with running_cluster(redis_server.url, tiny_model, tmp_path, "stall", ("solo",)) as c:
        reference = read_events(submit_stream(c.base_url, body))
        resp = submit_stream(c.base_url, body)
        job_id = resp.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, job_id)["tokens"] > 100)
        c.procs["solo"].send_signal(signal.SIGSTOP)
        time.sleep(float(TEST_ENV["PARKQ_WORKER_TTL"]) + 2)  # past its TTL, frozen
        c.procs["solo"].send_signal(signal.SIGCONT)
        events = read_events(resp)
        resp.close()
        assert completion_text(events) == completion_text(reference)
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert client.hget("{stall}:job:" + job_id, "crashes") is None  # never requeued
        finally:
            client.close()
