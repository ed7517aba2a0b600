"""A job's stream readers are counted without a leak: a registration that fails
halfway, one that is applied twice (a retry after a lost answer) and a release
that fails each leave the job detached once its reader has left, so the worker
abandons an interactive job after the grace period."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from jobs.store.scheduling import Store
from scheduler.policy import PRIORITY_LEVELS
from web import sse

INTERACTIVE = PRIORITY_LEVELS["interactive"]


def _jobs(store: Store, *job_ids: str) -> list[str]:
    for job_id in job_ids:
        assert store.enqueue(job_id, "completion", {"x": 1}, INTERACTIVE, time.time())
    return list(job_ids)


def _fault(
    store: Store, fail: Callable[[int], bool], again: Callable[[int], bool] = lambda n: False
) -> list[int]:
    """The reader script raises a connection error on the calls ``fail`` picks
    (1-based), and is applied twice on those ``again`` picks (an answer lost
    and the command resent, as redis-py's default Retry does)."""
    script = store._scripts["reader"]
    calls: list[int] = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(calls) + 1)
        if fail(len(calls)):
            raise redis.ConnectionError("injected: the registration failed")
        if again(len(calls)):
            script(*args, **kwargs)
        return script(*args, **kwargs)

    store._scripts["reader"] = faulty
    return calls


def _state(store: Store, job_id: str) -> tuple[int, float | None]:
    readers, detached = store.r.hmget(store.keys.job(job_id), ["readers", "detached_at"])
    return int(readers or 0), None if detached is None else float(detached)


def _abandoned(store: Store, job_id: str, at: float, grace: float) -> bool:
    """The worker's rule (jobs/worker/execution.py): past ``detached_at`` by the grace."""
    _, detached = _state(store, job_id)
    return detached is not None and at - detached > grace


def test_a_second_registration_that_fails_leaves_no_reader_behind(store: Store) -> None:
    jobs = _jobs(store, "a", "b")
    _fault(store, lambda n: n == 2)
    before = time.time()
    with pytest.raises(redis.ConnectionError):
        list(sse.merged(store, jobs, [0, 0], 0.2, gone=lambda: True))
    for job_id in jobs:
        readers, detached = _state(store, job_id)
        assert readers == 0, job_id
        assert detached is not None and before <= detached <= time.time(), job_id
        assert _abandoned(store, job_id, time.time() + 1.1, grace=1.0)


def test_a_registration_applied_twice_is_released_once(store: Store) -> None:
    """redis-py resends a command whose answer was lost (its default Retry):
    a count would go up twice and down once."""
    jobs = _jobs(store, "a")
    _fault(store, lambda n: False, again=lambda n: n == 1)
    assert list(sse.merged(store, jobs, [0], 0.2, gone=lambda: True)) == []
    readers, detached = _state(store, "a")
    assert readers == 0 and detached is not None and detached <= time.time()


def test_a_release_that_fails_ends_with_its_lease(store: Store) -> None:
    """Redis unreachable when the reader leaves: its lease ends by itself, and
    the job counts as left from then."""
    jobs = _jobs(store, "a")
    script = store._scripts["reader"]
    calls = _fault(store, lambda n: n >= 2)  # the hold succeeds, the release fails
    start = time.time()
    assert list(sse.merged(store, jobs, [0], 0.2, gone=lambda: True)) == []
    assert len(calls) == 2
    readers, detached = _state(store, "a")
    assert readers == 1 and detached is not None
    lease = sse.Reading(store, jobs, 0.2).lease
    assert start + lease <= detached <= time.time() + lease
    assert not _abandoned(store, "a", time.time(), grace=1.0)
    assert _abandoned(store, "a", detached + 1.1, grace=1.0)
    # Redis back: the next reader's call drops the lapsed lease from the count.
    store._scripts["reader"] = script
    store.reader("a", +1, detached + 1)
    store.reader("a", -1, detached + 2)
    assert _state(store, "a") == (0, detached + 2)


def test_two_readers_one_leaves_the_job_is_still_read(store: Store) -> None:
    jobs = _jobs(store, "a")
    first, second = sse.Reading(store, jobs, 0.2), sse.Reading(store, jobs, 0.2)
    now = time.time()
    first.hold(now)
    second.hold(now)
    first.release(now + 1)
    first.release(now + 1)  # given back twice: no effect
    readers, detached = _state(store, "a")
    assert readers == 1 and detached == pytest.approx(now + second.lease)
    second.release(now + 2)
    assert _state(store, "a") == (0, now + 2)
    assert not store.r.exists(store.keys.readers("a"))


def test_a_counted_reader_keeps_the_job_read_beside_a_lapsed_lease(store: Store) -> None:
    """A counted reader (what a non-streamed request of an older web process
    holds, during a rolling upgrade) and a stream's lease add up; while the
    count holds, the job is not detached."""
    jobs = _jobs(store, "a")
    now = time.time()
    store.reader("a", +1, now)
    reading = sse.Reading(store, jobs, 0.2)
    reading.hold(now)
    assert _state(store, "a") == (2, None)
    store.reader("a", -1, now + reading.lease + 5)  # the lease lapsed meanwhile
    assert _state(store, "a") == (0, now + reading.lease + 5)
