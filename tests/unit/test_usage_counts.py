"""The Lua that counts each tenant's usage and takes its tokens, on fakeredis
with parkq's own scripts: what a finish, a park and a bucket write. Against
real processes: tests/integration/test_limits.py."""

from __future__ import annotations

import json

import pytest

from jobs.store.scheduling import Store, TransitionRefused
from scheduler.state import JobState
from web import limits
from web.usage import tenant_totals

HOUR = 3600 * 500_000


def _claimed(store: Store, job_id: str, owner: str, at: float) -> str:
    assert store.enqueue(job_id, "completion", {"x": 1}, 0, at, owner=owner)
    claim = store.claim(f"w-{job_id}", at + 1)
    assert claim is not None and claim.job_id == job_id
    return claim.exec_token


def _hour(store: Store, at: float) -> dict[str, int]:
    raw = store.r.hgetall(store.keys.usage(int(at // 3600) * 3600))
    return {k.decode(): int(v) for k, v in raw.items()}


def test_a_finish_counts_its_usage_once_for_its_tenant_and_an_extra_choice_no_prompt(
    store: Store,
) -> None:
    at = HOUR + 10.0
    usage = json.dumps({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12})
    token = _claimed(store, "a", "t1", at)
    store.finish("a", token, "w-a", JobState.FINISHED, {"usage": usage, "tokens": "5"}, 0, [], at)
    # The same finish again (its reply lost, retried) is refused and counts nothing.
    with pytest.raises(TransitionRefused):
        store.finish("a", token, "w-a", JobState.FINISHED, {"usage": usage}, 0, [], at)
    # Choice 1 of the same response: its prompt is choice 0's.
    token = _claimed(store, "b", "t1", at)
    store.finish("b", token, "w-b", JobState.FINISHED,
                 {"usage": usage, "tokens": "5", "usage_prompt": "0"}, 0, [], at)  # fmt: skip
    assert _hour(store, at) == {"t1|prompt": 7, "t1|completion": 10, "t1|requests": 2}
    totals = tenant_totals(store.telemetry.counters())
    assert totals["t1"] == {"prompt": 7, "completion": 10, "requests": 2}


def test_a_cancelled_job_counts_what_it_generated_as_unfinished(store: Store) -> None:
    at = HOUR + 20.0
    token = _claimed(store, "c", "t2", at)
    store.r.hset(store.keys.job("c"), "tokens", "4")
    store.finish("c", token, "w-c", JobState.CANCELLED, {"tokens": "9"}, 0, [], at)
    assert _hour(store, at) == {"t2|unfinished": 9}


def test_parks_count_the_tokens_generated_since_the_last_park(store: Store) -> None:
    at = HOUR + 30.0
    token = _claimed(store, "p", "t3", at)
    store.r.hset(store.keys.job("p"), "tokens", "100")
    assert store.park("p", token, "w-p", '{"generated": []}', at) == "parked"
    again = store.claim("w-p2", at + 2)
    assert again is not None
    store.r.hset(store.keys.job("p"), "tokens", "250")
    assert store.park("p", again.exec_token, "w-p2", '{"generated": []}', at + 3) == "parked"
    assert _hour(store, at) == {"t3|parks": 2, "t3|parked": 250}


def test_the_bucket_refills_gives_back_and_never_runs_its_clock_back(store: Store) -> None:
    assert limits.take(store, "t", 600, 500, 1000.0) == 0.0  # 100 left of 600
    assert limits.take(store, "t", 600, 200, 1000.0) == 10.0  # 10 a second: 10 s short
    assert limits.take(store, "t", 600, 200, 1010.0) == 0.0
    assert limits.take(store, "t", 600, 5000, 1010.0) == 60.0  # more than a minute's: a full one
    assert limits.take(store, "t", 600, 5000, 1070.0) == 0.0  # taken: 4,400 below zero
    assert limits.take(store, "t", 600, -100, 1070.0) == 0.0  # a refund, even below zero
    tokens = float(store.r.hget(store.keys.bucket("t"), "tokens") or 0)
    assert tokens == -4300.0
    limits.take(store, "t", 600, 0, 1000.0)  # a caller whose clock is 70 s behind
    assert float(store.r.hget(store.keys.bucket("t"), "at") or 0) == 1070.0
