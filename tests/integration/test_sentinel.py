"""Redis Sentinel: the primary dies (SIGKILL) with jobs running, parked and
queued and clients streaming; the sentinels promote the replica; every process
follows it through PARKQ_REDIS_URL's Sentinel form, and every accepted job
finishes with the text an uninterrupted run gives, each client's events once
and in order (reconnecting with Last-Event-ID where its connection broke).

All real processes on loopback, started here: a primary, a replica, three
sentinels (`redis-server --sentinel`), `parkq web` and one `parkq worker`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from tests.conftest import RedisServer, _redis_binary, fresh_port
from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    reading_in_background,
    submit_stream,
    wait_until,
    web_answers,
)
from tests.integration.test_workers import Cluster, running_cluster

SERVICE = "mymaster"
#: Each decode step at least 3 ms: the jobs run for seconds, across the failover.
SLOW = {"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.003"}
LONG = {"prompt": "A job that outlives its Redis", "max_tokens": 1500, "temperature": 0.8,
        "seed": 5, "ignore_eos": True, "priority": "batch"}  # fmt: skip
SHORT = {"prompt": "A quick question", "max_tokens": 800, "temperature": 0,
         "ignore_eos": True, "priority": "interactive"}  # fmt: skip
QUEUED = {**LONG, "prompt": "A job that waits", "seed": 6, "max_tokens": 400}


class Sentinels:
    """A primary, its replica and three sentinels watching them."""

    def __init__(self, root: Path, *server_args: str, down_after_ms: int = 1000) -> None:
        self.primary = RedisServer(root / "primary")
        #: How long a server may not answer before a sentinel calls it down.
        self.down_after_ms = down_after_ms
        self.replica = RedisServer(root / "replica")
        self.root = root
        #: Options of both servers (persistence, for one).
        self.server_args = server_args
        self.ports = [fresh_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        self.primary.start(*self.server_args)
        self.replica.start(*self.server_args, "--replicaof", "127.0.0.1", str(self.primary.port))
        for i, port in enumerate(self.ports):
            work = self.root / f"sentinel{i}"
            work.mkdir(parents=True)
            conf = work / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {work}\nlogfile {work / 'sentinel.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.procs.append(subprocess.Popen([_redis_binary(), str(conf), "--sentinel"]))
        replica = redis.Redis(port=self.replica.port)

        def ready() -> bool:
            try:
                info = replica.info("replication")
                seen = [redis.Redis(port=p).sentinel_slaves(SERVICE) for p in self.ports]
            except redis.RedisError:
                return False
            return info.get("master_link_status") == "up" and all(len(s) == 1 for s in seen)

        wait_until(ready, timeout=60)

    def primary_port(self) -> int:
        for port in self.ports:
            try:
                _, primary = redis.Redis(port=port).sentinel_get_master_addr_by_name(SERVICE)
                return int(primary)
            except (redis.RedisError, TypeError):
                continue
        return 0

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=20)
        for server in (self.replica, self.primary):
            if server.proc is not None and server.proc.poll() is None:
                server.stop()


@pytest.fixture
def stack(sentinels: Sentinels, tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    """`parkq web` and one slowed worker (one sequence: the short job parks the
    long one), both on the Sentinel URL."""
    with running_cluster(sentinels.url, tiny_model, tmp_path, "sentinel", ()) as c:
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        c.start_worker("w", env=SLOW)
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        yield c


def _reference(c: Cluster, body: dict[str, Any]) -> str:
    return completion_text(read_events(submit_stream(c.base_url, body)))


@pytest.mark.timeout(300)
def test_a_failover_loses_no_job_and_no_token(sentinels: Sentinels, stack: Cluster) -> None:
    c = stack
    expected = {name: _reference(c, body) for name, body in
                (("long", LONG), ("short", SHORT), ("queued", QUEUED))}  # fmt: skip
    long = submit_stream(c.base_url, LONG)
    long_id = long.headers["X-Job-Id"]
    readers = {"long": reading_in_background(c.base_url, long, per_connection=100_000)}
    wait_until(lambda: job(c.base_url, long_id)["tokens"] > 100, timeout=60)
    short = submit_stream(c.base_url, SHORT)
    short_id = short.headers["X-Job-Id"]
    readers["short"] = reading_in_background(c.base_url, short, per_connection=100_000)
    queued = submit_stream(c.base_url, QUEUED)
    readers["queued"] = reading_in_background(c.base_url, queued, per_connection=100_000)
    wait_until(lambda: job(c.base_url, long_id)["state"] == "parked", timeout=60)
    wait_until(lambda: job(c.base_url, short_id)["tokens"] > 20, timeout=60)
    # The primary dies with a job running, one parked and one queued.
    old = sentinels.primary.port
    at_kill = job(c.base_url, short_id)["tokens"]
    assert sentinels.primary.proc is not None
    sentinels.primary.proc.kill()
    killed = time.monotonic()

    def progressed() -> bool:
        try:
            return int(job(c.base_url, short_id)["tokens"]) > at_kill
        except (KeyError, ValueError, requests.RequestException):
            return False  # the web answers 503 until the new primary is found

    wait_until(progressed, timeout=120)
    next_token = time.monotonic() - killed
    assert sentinels.primary_port() not in (0, old)  # the replica was promoted
    for name, (thread, seen) in readers.items():
        thread.join(timeout=180)
        assert not thread.is_alive(), name
        assert seen and seen[-1][1] == "[DONE]", name
        assert [i for i, _ in seen] == list(range(1, len(seen) + 1)), name  # once, in order
        assert completion_text(seen) == expected[name], name
    print(f"\nfailover: kill to the next token {next_token:.2f} s")
    assert c.procs["w"].poll() is None and c.procs["web"].poll() is None


def test_an_accepted_job_waits_for_a_replica_and_is_answered_without_one(
    sentinels: Sentinels, caplog: pytest.LogCaptureFixture
) -> None:
    """With a Sentinel URL a new job is answered once a replica holds it (WAIT);
    with the replica gone it is answered all the same after PARKQ_DURABLE_WAIT_MS,
    and the log says the write could be lost."""
    from jobs.store.connect import connect
    from jobs.store.scheduling import Store
    from scheduler.settings import load_settings

    settings = load_settings(redis_url=sentinels.url, durable_wait_ms=200, key_prefix="dur")
    assert settings.wait_replicas == 1
    assert load_settings(redis_url="redis://127.0.0.1:6379/0").wait_replicas == 0
    store = Store(connect(sentinels.url), settings)
    assert store.enqueue("a", "completion", {"prompt": "x"}, 1, time.time())
    replica = redis.Redis(port=sentinels.replica.port)
    assert replica.hget(settings.keys.job("a"), "state") == b"queued"  # there before the answer
    assert not [r for r in caplog.records if "replicas took a write" in r.getMessage()]
    sentinels.replica.stop()
    t0 = time.monotonic()
    assert store.enqueue("b", "completion", {"prompt": "x"}, 1, time.time())
    assert 0.15 <= time.monotonic() - t0 < 5
    assert any("0 of 1 replicas took a write" in r.getMessage() for r in caplog.records)
