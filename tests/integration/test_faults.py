"""Faults against real processes: many SIGKILLs at random tokens, a SIGKILL in
the middle of a checkpoint, a frozen worker that wakes up stale, a slow reader.

Every run is bounded in jobs and time; all traffic stays on loopback.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    read_with_reconnects,
    reading_in_background,
    sse_lines,
    submit_stream,
    wait_until,
)
from tests.integration.test_workers import Cluster, running_cluster

PROMPTS = [f"Fault tolerance, part {i}:" for i in range(5)]


def _body(prompt: str, tokens: int = 1500) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "priority": "batch"}  # fmt: skip


@pytest.fixture(scope="module")
def faults(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("faults")
    with running_cluster(redis_server.url, tiny_model, root, "faults", ("w0", "w1")) as c:
        yield c


def _reference(c: Cluster) -> dict[str, str]:
    """Each prompt's greedy text on a run without faults."""
    out = {}
    for prompt in PROMPTS:
        resp = submit_stream(c.base_url, _body(prompt))
        out[prompt] = completion_text(read_events(resp))
        resp.close()
    return out


@pytest.mark.timeout(900)
def test_twenty_sigkills_over_fifty_jobs_lose_and_duplicate_nothing(faults: Cluster) -> None:
    reference = _reference(faults)
    rng = random.Random(7)
    results: dict[int, tuple[str, list[tuple[int, str]]]] = {}
    ids: dict[int, str] = {}
    lock = threading.Lock()
    kills: list[dict[str, float | str]] = []
    submitted = itertools.count()

    def next_job() -> int | None:
        # At least 50 jobs, and more while kills are still to come (at most 200):
        # a fast machine must not run out of work before the 20th kill.
        with lock:
            n = next(submitted)
        return None if n >= 200 or (n >= 50 and len(kills) >= 20) else n

    def client() -> None:
        # Eight clients, each submitting and reading jobs one after another,
        # reconnecting with Last-Event-ID every few hundred events.
        while (n := next_job()) is not None:
            prompt = PROMPTS[n % len(PROMPTS)]
            resp = submit_stream(faults.base_url, _body(prompt))
            ids[n] = resp.headers["X-Job-Id"]
            seen = read_with_reconnects(
                faults.base_url, ids[n], resp, per_connection=rng.randint(100, 700)
            )
            results[n] = (prompt, seen)

    clients = [threading.Thread(target=client) for _ in range(8)]
    for t in clients:
        t.start()
    killed_jobs: dict[str, int] = {}
    names = (f"w{i}" for i in itertools.count(2))
    deadline = time.monotonic() + 600
    while len(kills) < 20 and time.monotonic() < deadline:
        wait_until(lambda: faults.workers_alive() >= 2, timeout=60)
        running = [j for n, j in list(ids.items()) if n not in results]
        states = [job(faults.base_url, j) for j in running]
        # A job not killed twice already (a job whose worker dies 3 times fails, by design).
        live = [s for s in states if s["state"] == "running" and killed_jobs.get(s["id"], 0) < 2]
        if not live:
            time.sleep(0.02)
            continue
        target = rng.choice(live)
        at = target["tokens"] + rng.randint(1, 400)
        while job(faults.base_url, target["id"])["tokens"] < at and target["id"] not in [
            ids[n] for n in results
        ]:
            time.sleep(0.005)
        now = job(faults.base_url, target["id"])
        name = now.get("worker")
        if now["state"] != "running" or name not in faults.procs:
            continue
        faults.procs[name].send_signal(signal.SIGKILL)
        faults.procs[name].wait()
        t_kill = time.monotonic()
        killed_jobs[target["id"]] = killed_jobs.get(target["id"], 0) + 1
        del faults.procs[name]
        faults.start_worker(next(names))  # the replacement
        tokens_at_kill = job(faults.base_url, target["id"])["tokens"]  # the dead worker's last

        def moved_on(jid: str = target["id"], n: int = tokens_at_kill) -> bool:
            status = job(faults.base_url, jid)
            return bool(status["tokens"] > n or status["state"] == "finished")

        wait_until(
            moved_on,
            timeout=60,
        )
        kills.append(
            {"job": target["id"], "tokens": tokens_at_kill, "recovery_s": time.monotonic() - t_kill}
        )
    for t in clients:
        t.join(timeout=300)
    assert len(kills) == 20
    assert len(results) >= 50 and len(results) == len(ids)
    gaps = dups = 0
    for n, (prompt, seen) in results.items():
        seqs = [i for i, _ in seen]
        dups += len(seqs) - len(set(seqs))
        gaps += (max(seqs) - len(set(seqs))) if seqs else 1
        assert seen[-1][1] == "[DONE]", n
        assert completion_text(seen) == reference[prompt], f"job {ids[n]} differs"
        assert job(faults.base_url, ids[n])["state"] == "finished"
    assert (gaps, dups) == (0, 0)
    # The RQ view holds no id of an ended job in its queue.
    rq_redis = redis.Redis.from_url(faults.env["PARKQ_REDIS_URL"])
    assert rq_redis.llen("rq:queue:faults") == 0
    rq_redis.close()
    recovery = sorted(float(k["recovery_s"]) for k in kills)
    print(
        f"\nfaults: 20 SIGKILLs over {len(results)} jobs, {len(killed_jobs)} jobs hit; "
        f"recovery p50 {recovery[10]:.2f} s, max {recovery[-1]:.2f} s; 0 lost, 0 gaps, 0 dups"
    )


@pytest.mark.timeout(300)
def test_sigkill_in_the_middle_of_a_checkpoint(faults: Cluster) -> None:
    """A worker dies between saving a parked job's KV and recording the park: the
    job resumes from its previous checkpoint (by replay elsewhere), never a torn one."""
    wait_until(lambda: faults.workers_alive() >= 2, timeout=60)
    body = _body(PROMPTS[0], 2500)
    reference = submit_stream(faults.base_url, body)
    expected = completion_text(read_events(reference))
    # Leave one worker, which pauses 3 s inside every checkpoint write.
    for name in [n for n in faults.procs if n != "web"]:
        proc = faults.procs.pop(name)
        proc.terminate()
        proc.wait(timeout=30)
    wait_until(lambda: faults.workers_alive() == 0, timeout=60)
    faults.start_worker("slow", env={"PARKQ_TEST_PARK_DELAY_SECONDS": "3"})
    wait_until(lambda: faults.workers_alive() == 1, timeout=60)

    resp = submit_stream(faults.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    reader, seen = reading_in_background(faults.base_url, resp, 400)
    short = {"prompt": "hi", "max_tokens": 4, "priority": "interactive"}
    # A first park completes (slowly): the job now has a checkpoint.
    wait_until(lambda: job(faults.base_url, job_id)["tokens"] > 200)
    first = submit_stream(faults.base_url, short)
    wait_until(lambda: job(faults.base_url, job_id)["preemptions"] == 1, timeout=60)
    read_events(first)
    wait_until(lambda: job(faults.base_url, job_id)["state"] == "running", timeout=60)
    tokens = job(faults.base_url, job_id)["tokens"]
    wait_until(lambda: job(faults.base_url, job_id)["tokens"] > tokens + 200)
    # The second park: killed while its checkpoint is being written.
    second = submit_stream(faults.base_url, short)
    wait_until(lambda: job(faults.base_url, job_id)["state"] == "parking", timeout=60)
    time.sleep(0.5)
    faults.procs["slow"].send_signal(signal.SIGKILL)
    faults.procs.pop("slow").wait()
    assert job(faults.base_url, job_id)["preemptions"] == 1  # the second park never landed
    faults.start_worker("w-after-checkpoint")
    faults.start_worker("w-after-checkpoint-2")
    assert read_events(second)[-1][1] == "[DONE]"
    reader.join(timeout=120)
    final = job(faults.base_url, job_id)
    assert final["state"] == "finished"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == expected
    wait_until(lambda: faults.workers_alive() == 2, timeout=60)


@pytest.mark.timeout(300)
def test_a_frozen_worker_that_wakes_up_cannot_append(faults: Cluster) -> None:
    """SIGSTOP a worker past its heartbeat TTL: its job moves to another worker.
    SIGCONT: the stale execution's writes are refused (fenced); the stream is intact."""
    wait_until(lambda: faults.workers_alive() >= 2, timeout=60)
    body = _body(PROMPTS[1], 2500)
    expected = completion_text(read_events(submit_stream(faults.base_url, body)))
    resp = submit_stream(faults.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    wait_until(lambda: job(faults.base_url, job_id)["tokens"] > 300)
    name = job(faults.base_url, job_id)["worker"]
    proc = faults.procs[name]
    proc.send_signal(signal.SIGSTOP)
    try:
        # The TTL is 3 s here: the job is requeued and taken over.
        wait_until(lambda: job(faults.base_url, job_id)["worker"] not in (name, None), timeout=60)
    finally:
        proc.send_signal(signal.SIGCONT)
    events = read_events(resp)
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == expected
    assert job(faults.base_url, job_id)["state"] == "finished"
    # The woken worker dropped the job and serves again, and RQ shows it again.
    wait_until(lambda: faults.workers_alive() >= 2, timeout=60)
    again = submit_stream(faults.base_url, _body(PROMPTS[2], 50))
    assert read_events(again)[-1][1] == "[DONE]"
    client = redis.Redis.from_url(faults.env["PARKQ_REDIS_URL"])
    try:
        wait_until(lambda: client.sismember("rq:workers", f"rq:worker:{name}"), timeout=30)
    finally:
        client.close()


@pytest.mark.timeout(300)
def test_a_slow_reader_loses_nothing_and_slows_no_one(faults: Cluster) -> None:
    """One event per second: the job still runs at full speed (the stream waits in
    Redis), every event arrives once and in order, and another job is not held up."""
    wait_until(lambda: faults.workers_alive() >= 2, timeout=60)
    body = _body(PROMPTS[3], 400)
    expected = completion_text(read_events(submit_stream(faults.base_url, body)))
    other_body = _body(PROMPTS[4], 400)
    t0 = time.monotonic()
    read_events(submit_stream(faults.base_url, other_body))
    alone = time.monotonic() - t0

    slow = requests.post(
        f"{faults.base_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60
    )
    job_id = slow.headers["X-Job-Id"]
    lines = sse_lines(slow)
    events: list[tuple[int, str]] = []
    event_id = None
    timing: dict[str, float] = {}

    def other() -> None:
        t = time.monotonic()
        read_events(submit_stream(faults.base_url, other_body))
        timing["other"] = time.monotonic() - t

    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            events.append((event_id or 0, line[6:]))
            if len(events) == 2:
                # The job is generated while its reader dawdles.
                wait_until(lambda: job(faults.base_url, job_id)["state"] == "finished", 30)
                thread = threading.Thread(target=other)
                thread.start()
            if len(events) <= 8:
                time.sleep(1.0)  # a reader on a bad line: one event per second
            if line == "data: [DONE]":
                break
    thread.join(timeout=60)
    slow.close()
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == expected
    assert timing["other"] < max(5.0, 3 * alone)
