"""Two worker processes against one Redis: takeover after SIGKILL, victim choice."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.conftest import fresh_port
from tests.integration.conftest import TEST_ENV
from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    reading_in_background,
    submit_stream,
    wait_until,
)

CLI = [sys.executable, "-m", "tools.cli"]


class Cluster:
    """`parkq web` and named `parkq worker` processes, each in its own directory."""

    def __init__(self, redis_url: str, model: Path, root: Path, prefix: str = "cluster") -> None:
        self.env = {
            **os.environ,
            **TEST_ENV,
            "PARKQ_REDIS_URL": redis_url,
            "PARKQ_MODEL": str(model),
            "PARKQ_KEY_PREFIX": prefix,
            "PARKQ_QUEUE_NAME": prefix,
            "PARKQ_LOG_LEVEL": "WARNING",
            "PARKQ_N_THREADS": "1",  # two CPU workers share two cores
        }
        self.root = root
        self.port = fresh_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        cwd = self.root / name
        cwd.mkdir(exist_ok=True)
        self.procs[name] = subprocess.Popen([*CLI, *argv], env={**self.env, **(env or {})}, cwd=cwd)

    def start_web(self, env: dict[str, str] | None = None) -> None:
        """`parkq web`; one with faults (``PARKQ_TEST_*`` in ``env``, see
        tests/faultweb.py) runs through the fault-injecting wrapper."""
        if env and any(k.startswith("PARKQ_TEST_") for k in env):
            self._start_faulty("web", "tests.faultweb", ["--port", str(self.port)], env)
            return
        self.start("web", ["web", "--port", str(self.port)], env)

    def _start_faulty(self, name: str, module: str, argv: list[str], env: dict[str, str]) -> None:
        cwd = self.root / name
        cwd.mkdir(exist_ok=True)
        # The tests' modules (tests.faultworker) from the checkout, beside whatever
        # path this run already needs (parkq's dependencies may come from it).
        path = [str(Path(__file__).parents[2]), *filter(None, [self.env.get("PYTHONPATH")])]
        full = {**self.env, **env, "PYTHONPATH": os.pathsep.join(path)}
        argv = [sys.executable, "-m", module, *argv]
        self.procs[name] = subprocess.Popen(argv, env=full, cwd=cwd)

    def start_worker(self, name: str, env: dict[str, str] | None = None) -> None:
        """A `parkq worker`; one with faults (``PARKQ_TEST_*`` in ``env``, see
        tests/faultworker.py) runs through the fault-injecting wrapper."""
        if env and any(k.startswith("PARKQ_TEST_") for k in env):
            self._start_faulty(name, "tests.faultworker", ["--name", name], env)
            return
        self.start(name, ["worker", "--name", name], env)

    def workers_alive(self) -> int:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"processes exited unexpectedly: {dead}"
        try:
            return int(requests.get(self.base_url + "/healthz", timeout=5).json()["workers"])
        except requests.RequestException:
            return 0

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running_cluster(
    redis_url: str,
    model: Path,
    root: Path,
    prefix: str,
    workers: tuple[str, ...],
    web_env: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """`parkq web` and the named workers, stopped on exit."""
    c = Cluster(redis_url, model, root, prefix=prefix)
    c.start_web(web_env)
    for name in workers:
        c.start_worker(name)
    try:
        wait_until(lambda: c.workers_alive() == len(workers), timeout=60)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with running_cluster(redis_server.url, tiny_model, root, "cluster", ("wa", "wb")) as c:
        yield c


LONG = {"prompt": "A job that outlives its worker", "max_tokens": 2500, "temperature": 0.8,
        "seed": 9, "ignore_eos": True, "priority": "batch"}  # fmt: skip


def test_sigkill_mid_generation_another_worker_takes_over(cluster: Cluster) -> None:
    first = submit_stream(cluster.base_url, LONG)
    reference = read_events(first)
    first.close()
    resp = submit_stream(cluster.base_url, LONG)
    job_id = resp.headers["X-Job-Id"]
    thread, seen = reading_in_background(cluster.base_url, resp, per_connection=300)
    wait_until(lambda: job(cluster.base_url, job_id)["tokens"] > 300)
    victim = job(cluster.base_url, job_id)["worker"]
    cluster.procs[victim].send_signal(signal.SIGKILL)
    cluster.procs[victim].wait()
    thread.join(timeout=90)
    assert seen and seen[-1][1] == "[DONE]"
    final = job(cluster.base_url, job_id)
    assert final["state"] == "finished" and final["worker"] != victim
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == completion_text(reference)
    cluster.start_worker(victim)  # a replacement, for the next tests
    wait_until(lambda: cluster.workers_alive() == 2, timeout=60)


def test_preemption_goes_to_the_worker_running_the_lowest_key(cluster: Cluster) -> None:
    wait_until(lambda: cluster.workers_alive() == 2, timeout=60)
    low = submit_stream(cluster.base_url, {**LONG, "priority": 0})
    high = submit_stream(cluster.base_url, {**LONG, "priority": 6})
    low_id, high_id = low.headers["X-Job-Id"], high.headers["X-Job-Id"]
    wait_until(
        lambda: (
            job(cluster.base_url, low_id)["state"] == "running"
            and job(cluster.base_url, high_id)["state"] == "running"
        )
    )
    # Both past their minimum run time (0.05 s here): only the keys decide.
    time.sleep(0.5)
    chat = submit_stream(cluster.base_url, {"prompt": "hi", "max_tokens": 8, "priority": 20})
    assert read_events(chat)[-1][1] == "[DONE]"
    chat.close()
    for resp in (low, high):
        read_events(resp)
        resp.close()
    jobs = {i: job(cluster.base_url, i) for i in (low_id, high_id)}
    # Ordering keys as the policy computes them (test settings: 0.5 s per level).
    key = {i: j["priority"] * 0.5 - j["created_at"] for i, j in jobs.items()}
    lowest = min(key, key=key.__getitem__)
    assert lowest == low_id  # submitted first at a lower level
    assert jobs[low_id]["preemptions"] == 1
    assert jobs[high_id]["preemptions"] == 0


def test_sigterm_parks_the_running_job_and_another_worker_finishes_it(cluster: Cluster) -> None:
    wait_until(lambda: cluster.workers_alive() == 2, timeout=60)
    body = {**LONG, "temperature": 0.0}
    reference = submit_stream(cluster.base_url, body)
    expected = completion_text(read_events(reference))
    resp = submit_stream(cluster.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    wait_until(lambda: job(cluster.base_url, job_id)["tokens"] > 200)
    victim = job(cluster.base_url, job_id)["worker"]
    t0 = time.monotonic()
    cluster.procs[victim].send_signal(signal.SIGTERM)
    assert cluster.procs[victim].wait(timeout=30) == 0
    stopped_in = time.monotonic() - t0
    events = read_events(resp)
    final = job(cluster.base_url, job_id)
    assert final["state"] == "finished" and final["worker"] != victim
    assert final["preemptions"] == 1
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == expected
    assert stopped_in < 10
    cluster.start_worker(victim)
    wait_until(lambda: cluster.workers_alive() == 2, timeout=60)


def test_a_killed_worker_is_noticed_by_its_closed_connections_not_its_ttl(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    c = Cluster(redis_server.url, tiny_model, tmp_path, prefix="connlive")
    c.env["PARKQ_WORKER_TTL"] = "60"  # the TTL alone would take a minute
    c.start("web", ["web", "--port", str(c.port)])
    c.start_worker("busy")
    try:
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        reference = read_events(submit_stream(c.base_url, LONG))
        resp = submit_stream(c.base_url, LONG)
        job_id = resp.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, job_id)["tokens"] > 200)
        c.start_worker("spare")  # idle, ready to take over
        wait_until(lambda: c.workers_alive() == 2, timeout=60)
        c.procs["busy"].send_signal(signal.SIGKILL)
        c.procs.pop("busy").wait()
        killed = time.monotonic()
        at_kill = job(c.base_url, job_id)["tokens"]
        wait_until(lambda: job(c.base_url, job_id)["tokens"] > at_kill, timeout=50)
        recovered = time.monotonic() - killed
        events = read_events(resp)
        assert completion_text(events) == completion_text(reference)
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert job(c.base_url, job_id)["worker"] == "spare"
        assert recovered < 30  # far inside the 60 s TTL: the connections told
        print(f"\nconnection liveness: kill to the next token {recovered:.2f} s (TTL 60 s)")
        # No live worker was taken for dead: one crash on the job, and the spare's
        # connections still carry its name after it reaped (RQ renames the
        # connection it is given; parkq puts the name back).
        client = redis.Redis.from_url(redis_server.url)
        assert client.hget("{connlive}:job:" + job_id, "crashes") == b"1"
        names = {entry.get("name") for entry in client.client_list()}
        client.close()
        assert "parkq-worker:connlive:spare" in names
        assert c.workers_alive() == 1
    finally:
        c.stop()
