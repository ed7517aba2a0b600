"""Every error reply Redis can send, and dropped connections, through a fault
proxy (tests/faultproxy.py) between a real redis-server and real `parkq web`
(its janitor included) and `parkq worker` processes.

For each error class Redis and Valkey send while they cannot serve
(tests.faultproxy.ERROR_REPLIES) the proxy answers, for a while, every write
(the commands the server itself flags as writes, and scripts) while a job is
being generated, then every blocking read while the worker waits for work,
then every command at all; and it drops every connection once. After each:
the job finished with the text of an undisturbed run, its client got each
event once (reconnecting with Last-Event-ID where the stream broke), no
process exited, a request sent during the fault got a 503 (never a 500) or
was served, and the janitor still compacts ended jobs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests

from tests.conftest import RedisServer, fresh_port
from tests.faultproxy import ERROR_REPLIES, FaultProxy, Target
from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    read_with_reconnects,
    submit_stream,
    wait_until,
)
from tests.integration.test_workers import Cluster

#: The openai client's defaults (temperature 1, top_p 1) with a seed, so a
#: resumed or replayed job must draw the same tokens.
BODY = {"prompt": "Through every error Redis can send", "max_tokens": 150, "seed": 11,
        "ignore_eos": True}  # fmt: skip
#: Each step of the worker takes this long: a job outlasts a fault.
SLOW = {"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.02"}
FAULT_SECONDS = 1.5
PREFIX = "replies"


@dataclass
class Proxied:
    c: Cluster
    proxy: FaultProxy
    reference: str
    #: The redis-server itself, past the proxy.
    direct_url: str


@pytest.fixture(scope="module")
def p(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    root = tmp_path_factory.mktemp("replies")
    server = RedisServer(root / "redis")
    server.start()
    with FaultProxy(server.port, fresh_port()) as proxy:
        c = Cluster(proxy.url, tiny_model, root, prefix=PREFIX)
        c.env["PARKQ_JANITOR_SECONDS"] = "0.5"
        c.env["PARKQ_REPLAY_SECONDS"] = "600"
        c.start_web()
        c.start_worker("w", env=SLOW)
        try:
            wait_until(lambda: c.workers_alive() == 1, timeout=60)
            reference = completion_text(read_events(submit_stream(c.base_url, BODY)))
            yield Proxied(c, proxy, reference, server.url)
        finally:
            c.stop()
            server.stop()


def _during_fault(c: Cluster, statuses: list[int], until: float) -> None:
    """Requests sent while the fault holds: each answered, none with a 5xx but 503."""
    while time.monotonic() < until:
        try:
            resp = requests.post(
                f"{c.base_url}/v1/completions",
                json={"prompt": "sent during the fault", "max_tokens": 2},
                timeout=30,
            )
            statuses.append(resp.status_code)
            if resp.status_code == 503:
                assert resp.json()["error"]["code"] == "store_unavailable"
        except requests.RequestException:
            statuses.append(-1)
        time.sleep(0.3)


def _ended_listed(direct_url: str) -> int:
    """Ended jobs the janitor has not compacted yet (read past the proxy)."""
    r = redis.Redis.from_url(direct_url)
    try:
        return int(r.zcard("{" + PREFIX + "}:ended"))
    finally:
        r.close()


def job_running(p: Proxied) -> bool:
    """Whether any job is running or waiting (read past the proxy)."""
    r = redis.Redis.from_url(p.direct_url)
    try:
        return bool(r.zcard("{" + PREFIX + "}:running") or r.zcard("{" + PREFIX + "}:queue"))
    finally:
        r.close()


def _check_after(p: Proxied, job_id: str, events: list[tuple[int, str]],
                 statuses: list[int]) -> None:  # fmt: skip
    c = p.c
    assert events and events[-1][1] == "[DONE]", events[-3:]
    assert [i for i, _ in events] == list(range(1, len(events) + 1))  # each event once
    assert completion_text(events) == p.reference
    assert job(c.base_url, job_id)["state"] == "finished"
    assert c.workers_alive() == 1  # (and no process exited)
    assert all(s in (200, 503) for s in statuses), statuses
    # The janitor survived: the ended jobs are compacted again.
    wait_until(lambda: _ended_listed(p.direct_url) == 0, timeout=30)


def _reading_a_running_job(c: Cluster) -> tuple[str, threading.Thread, list[tuple[int, str]]]:
    """A job streamed by a client that reconnects with Last-Event-ID, once it runs:
    its id, the reading thread and the events read so far."""
    resp = submit_stream(c.base_url, BODY)
    job_id = resp.headers["X-Job-Id"]
    seen: list[tuple[int, str]] = []
    reader = threading.Thread(
        target=lambda: seen.extend(read_with_reconnects(c.base_url, job_id, resp, 10_000)),
        daemon=True,  # (a case that fails does not hold the session at its exit)
    )
    reader.start()
    wait_until(lambda: job(c.base_url, job_id)["tokens"] >= 20, timeout=60)
    return job_id, reader, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", sorted(ERROR_REPLIES))
@pytest.mark.parametrize("target", ["writes", "all"])
def test_a_job_in_flight_finishes_through_an_error_reply(
    p: Proxied, error: str, target: Target
) -> None:
    c, proxy = p.c, p.proxy
    job_id, reader, seen = _reading_a_running_job(c)
    proxy.fail(target, ERROR_REPLIES[error], FAULT_SECONDS)
    statuses: list[int] = []
    _during_fault(c, statuses, time.monotonic() + FAULT_SECONDS)
    # The worker itself was refused (not only the requests above).
    refused = proxy.refused_clients()
    assert any(name.startswith("parkq-worker:") for name in refused), refused
    reader.join(timeout=90)
    _check_after(p, job_id, seen, statuses)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", sorted(ERROR_REPLIES))
def test_an_idle_worker_survives_an_error_reply_to_its_blocking_read(
    p: Proxied, error: str
) -> None:
    c, proxy = p.c, p.proxy
    wait_until(lambda: c.workers_alive() == 1 and not job_running(p), timeout=60)
    proxy.fail("blocking", ERROR_REPLIES[error], 2 * FAULT_SECONDS)
    # The idle worker's next blocking read (one at least every 0.5 s) is refused.
    wait_until(lambda: "BLPOP" in proxy.hits(), timeout=FAULT_SECONDS)
    resp = submit_stream(c.base_url, BODY)  # accepted during the fault
    job_id = resp.headers["X-Job-Id"]
    events = read_with_reconnects(c.base_url, job_id, resp, 10_000)
    _check_after(p, job_id, events, [])


@pytest.mark.timeout(120)
def test_a_job_in_flight_finishes_through_dropped_connections(
    p: Proxied,
) -> None:
    c, proxy = p.c, p.proxy
    job_id, reader, seen = _reading_a_running_job(c)
    proxy.drop(FAULT_SECONDS)
    statuses: list[int] = []
    _during_fault(c, statuses, time.monotonic() + FAULT_SECONDS)
    reader.join(timeout=90)
    _check_after(p, job_id, seen, statuses)
