"""A tenant's caps on running and waiting jobs (PARKQ_KEYS_FILE: max_running,
max_queued) against a real `parkq up` (embedded Redis, web, a worker of three
sequences, tiny model) and the openai client: a tenant capped at one running
job never runs two at once while another tenant's run beside it, everything
ends; a tenant past its waiting jobs gets 429 queued_jobs_exceeded with a
Retry-After, and is taken again once one of them has started."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.integration.conftest import TEST_ENV, start_parkq, stop_parkq
from tests.integration.helpers import children, wait_until

ONE, FREE, ADMIN = "sk-one", "sk-free", "sk-admin"
KEYS_FILE = f"""
[tenants.one]
keys = ["{ONE}"]
max_running = 1
max_queued = 2

[tenants.free]
keys = ["{FREE}"]

[tenants.admin]
keys = ["{ADMIN}"]
admin = true
"""
#: `parkq up` and its URL.
Launched = tuple[subprocess.Popen[str], str]
BODY = {"model": "tiny", "prompt": "Caps", "max_tokens": 600, "ignore_eos": True,
        "temperature": 0, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def running(tiny_model: Path, tmp_path_factory: Any) -> Iterator[Launched]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS_FILE)
    env = {**TEST_ENV, "PARKQ_KEYS_FILE": str(path), "PARKQ_MAX_SEQS": "3"}
    proc, url = start_parkq(tiny_model, None, env=env)
    yield proc, url
    stop_parkq(proc)


@pytest.fixture
def base(running: Launched) -> str:
    return running[1]


@pytest.fixture
def stack(running: Launched) -> subprocess.Popen[str]:
    return running[0]


def _send(base: str, key: str, ids: list[str], body: dict[str, Any] = BODY) -> threading.Thread:
    """One streamed request of ``key`` in a thread; its job id goes to ``ids``
    once it is queued, and the thread ends with its stream."""
    ready = threading.Event()

    def run() -> None:
        got = requests.post(base + "/v1/completions", json=body, stream=True, timeout=300,
                            headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert got.status_code == 200, got.text
        ids.append(got.headers["X-Job-Id"])
        ready.set()
        assert b"data: [DONE]" in b"".join(got.iter_content(None))

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(60)
    return thread


def _job(base: str, job_id: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    got = requests.get(base + f"/v1/jobs/{job_id}", headers=headers, timeout=30)
    record: dict[str, Any] = got.json()
    return record


def test_a_tenant_capped_at_one_running_job_runs_one_at_a_time_beside_others(base: str) -> None:
    mine: list[str] = []
    theirs: list[str] = []
    threads = [_send(base, ONE, mine) for _ in range(2)]
    threads += [_send(base, FREE, theirs) for _ in range(2)]
    wait_until(lambda: all(_job(base, j)["state"] == "finished" for j in mine), timeout=240)
    for t in threads:
        t.join(timeout=120)
    jobs = [_job(base, j) for j in mine]
    first, second = sorted(jobs, key=lambda j: j["started_at"])
    # Never two at once (each state read alone could see one end and the next
    # start between two reads: the records say when each ran).
    assert second["started_at"] >= first["finished_at"]
    others = [_job(base, j) for j in theirs]
    assert all(j["state"] == "finished" for j in others)
    # The other tenant's ran beside the capped tenant's first job.
    assert min(j["started_at"] for j in others) < first["finished_at"]


def _worker(up: subprocess.Popen[str]) -> int:
    """The stack's worker process (a child of `parkq up`)."""
    (worker,) = [pid for pid, cmd in children(up.pid) if " worker" in cmd]
    return worker


def test_a_tenant_past_its_waiting_jobs_gets_429_until_one_starts(
    base: str, stack: subprocess.Popen[str]
) -> None:
    mine: list[str] = []
    # One runs (its cap) and two wait (max_queued); the fourth is refused. The
    # worker is held (SIGSTOP, about a second; past its heartbeat's TTL it would
    # still find its job, as no other worker here reaps it) from when the
    # first runs until the tenant has asked, so that the running one cannot
    # end in between, however fast the machine (3,000 tokens: it cannot end
    # between the read that sees it run and the hold either).
    worker = _worker(stack)
    threads = [_send(base, ONE, mine, {**BODY, "max_tokens": 3000})]
    wait_until(lambda: _job(base, mine[0])["state"] == "running", timeout=60)
    client = openai.OpenAI(base_url=base + "/v1", api_key=ONE, max_retries=0)
    os.kill(worker, signal.SIGSTOP)
    try:
        threads += [_send(base, ONE, mine) for _ in range(2)]
        assert [_job(base, j)["state"] for j in mine] == ["running", "queued", "queued"]
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="One more", max_tokens=2)
        # A request of more choices than it may have waiting could never be taken: 400.
        with pytest.raises(openai.BadRequestError) as too_many:
            client.completions.create(model="tiny", prompt="Three", max_tokens=2, n=3)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert refused.value.code == "queued_jobs_exceeded"
    assert "max_queued" in refused.value.message
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    assert too_many.value.param == "n" and "max_queued" in too_many.value.message
    # Another tenant is not refused meanwhile.
    other = openai.OpenAI(base_url=base + "/v1", api_key=FREE, max_retries=0)
    assert other.completions.create(model="tiny", prompt="Free", max_tokens=2).choices
    # Once one of the waiting has started, the tenant is taken again.
    wait_until(lambda: [_job(base, j)["state"] for j in mine].count("queued") < 2, timeout=120)
    assert client.completions.create(model="tiny", prompt="One more", max_tokens=2).choices
    for t in threads:
        t.join(timeout=240)
