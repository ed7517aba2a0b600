"""A tenant's caps (scheduler/tenancy.py: max_queued, max_running), on
fakeredis with parkq's own enqueue, feed, claim, park, finish and cancel
scripts. Against real processes: tests/integration/test_limits.py."""

from __future__ import annotations

import json

import fakeredis
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from jobs.store.scheduling import Store, TenantQueueFull
from scheduler.settings import Settings
from scheduler.state import JobState

T0 = 1_800_000_000.0
REQUEST = {"prompt_ids": [1, 2, 3], "max_tokens": 10}


def _put(store: Store, job_id: str, owner: str, at: float, *, max_queued: int = 0,
         max_running: int = 0, level: int = 0) -> None:  # fmt: skip
    extra = {"max_running": str(max_running)} if max_running else None
    assert store.enqueue(job_id, "completion", REQUEST, level, at, owner=owner, extra=extra,
                         weight=1.0, max_queued=max_queued,
                         caps=bool(max_queued or max_running))  # fmt: skip


def _finish(store: Store, job_id: str, worker: str, token: str, at: float) -> None:
    usage = json.dumps({"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    store.finish(job_id, token, worker, JobState.FINISHED, {"usage": usage}, 0, [], at)


def test_a_tenant_past_max_queued_is_refused_until_one_of_its_jobs_starts(store: Store) -> None:
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0, max_queued=3)
    with pytest.raises(TenantQueueFull):
        _put(store, "a3", "alpha", T0, max_queued=3)
    assert store.r.exists(store.keys.job("a3")) == 0  # nothing of it is kept
    _put(store, "b0", "beta", T0, max_queued=3)  # another tenant is not refused
    claim = store.claim("w0", T0 + 1)
    assert claim is not None and claim.job_id == "a0"
    _put(store, "a3", "alpha", T0 + 2, max_queued=3)  # one of its three started
    store.cancel("a1", T0 + 3)
    _put(store, "a4", "alpha", T0 + 3, max_queued=3)  # and one was cancelled
    with pytest.raises(TenantQueueFull):
        _put(store, "a5", "alpha", T0 + 3, max_queued=3)


def test_a_parked_job_counts_as_waiting(store: Store) -> None:
    _put(store, "a0", "alpha", T0, max_queued=2)
    claim = store.claim("w0", T0)
    assert claim is not None
    assert store.park("a0", claim.exec_token, "w0", '{"generated": []}', T0 + 1) == "parked"
    _put(store, "a1", "alpha", T0 + 2, max_queued=2)
    with pytest.raises(TenantQueueFull):
        _put(store, "a2", "alpha", T0 + 2, max_queued=2)


def test_a_tenant_at_max_running_waits_and_the_others_run(store: Store) -> None:
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0, max_running=2)
    _put(store, "b0", "beta", T0 + 0.1)
    claims = [store.claim(f"w{i}", T0 + 2) for i in range(4)]
    # alpha's second is due 0.26 s after its first (13 tokens at 50 a second):
    # beta's job takes its turn between them; alpha's third is passed
    # over (two of alpha's run); then nothing fits.
    assert [c.job_id if c else None for c in claims] == ["a0", "b0", "a1", None]
    a0 = claims[0]
    assert a0 is not None
    _finish(store, "a0", "w0", a0.exec_token, T0 + 3)
    again = store.claim("w4", T0 + 4)
    assert again is not None and again.job_id == "a2"


def test_a_parked_job_frees_its_place_under_max_running(store: Store) -> None:
    _put(store, "a0", "alpha", T0, max_running=1)
    _put(store, "a1", "alpha", T0 + 1, max_running=1)
    first = store.claim("w0", T0 + 2)
    assert first is not None and first.job_id == "a0"
    assert store.claim("w1", T0 + 2) is None
    assert store.park("a0", first.exec_token, "w0", '{"generated": []}', T0 + 3) == "parked"
    # a0 went back first (it is older): it is claimed again, not a1.
    back = store.claim("w1", T0 + 10)
    assert back is not None and back.job_id == "a0"


def _runs(store: Store, job_id: str, owner: str, level: int, worker: str, at: float,
          max_running: int = 0) -> None:  # fmt: skip
    store.workers.heartbeat(worker, now=at, ttl=1000)
    _put(store, job_id, owner, at, level=level, max_running=max_running)
    claim = store.claim(worker, at)
    assert claim is not None and claim.job_id == job_id


def test_a_job_at_its_tenants_running_cap_parks_only_its_own_tenants_job(store: Store) -> None:
    _runs(store, "beta-batch", "beta", 0, "w-b", T0)
    _runs(store, "alpha-batch", "alpha", 0, "w-a", T0 + 1, max_running=1)
    # alpha, at its cap of 1, asks at priority 20: parking beta's job would free
    # a sequence alpha may not take; its own batch job makes room.
    _put(store, "alpha-urgent", "alpha", T0 + 10, level=20, max_running=1)
    assert store.maybe_preempt(T0 + 10) == "w-a"


def test_a_capped_job_with_nothing_of_its_own_to_park_lets_the_next_one_decide(
    store: Store,
) -> None:
    _runs(store, "beta-batch", "beta", 0, "w-b", T0)
    _runs(store, "alpha-int", "alpha", 30, "w-a", T0 + 1, max_running=1)
    # alpha's waiting job cannot park its own (higher) job nor take beta's
    # sequence; gamma's, behind it, parks beta's batch job.
    _put(store, "alpha-urgent", "alpha", T0 + 10, level=20, max_running=1)
    assert store.maybe_preempt(T0 + 10) is None
    _put(store, "gamma-int", "gamma", T0 + 11, level=10)
    assert store.maybe_preempt(T0 + 11) == "w-b"


@hsettings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "claim", "finish", "cancel", "park"]),
            st.sampled_from(["alpha", "beta"]),
        ),
        min_size=1,
        max_size=40,
    ),
    cap=st.integers(1, 3),
)
def test_no_sequence_of_steps_runs_more_than_the_cap_or_strands_a_job(
    ops: list[tuple[str, str]], cap: int
) -> None:
    store = Store(fakeredis.FakeRedis(), Settings(redis_url="redis://fake", n_ctx=0))
    at, n = T0, 0
    running: dict[str, tuple[str, str, str]] = {}  # job: owner, worker, token
    for op, owner in ops:
        at += 1
        mine = [j for j, (o, _, _) in running.items() if o == owner]
        if op == "put":
            n += 1
            _put(store, f"{owner}-{n}", owner, at, max_running=cap)
        elif op == "claim":
            claim = store.claim(f"w{n}-{at}", at)
            if claim is not None:
                job_owner = claim.job_id.split("-")[0]
                running[claim.job_id] = (job_owner, f"w{n}-{at}", claim.exec_token)
        elif mine and op == "finish":
            _, worker, token = running.pop(mine[0])
            _finish(store, mine[0], worker, token, at)
        elif mine and op == "cancel":
            # A running job asked to cancel ends when its worker sees the flag.
            _, worker, token = running.pop(mine[0])
            store.cancel(mine[0], at)
            store.finish(mine[0], token, worker, JobState.CANCELLED, {}, 0, [], at)
        elif mine and op == "park":
            _, worker, token = running.pop(mine[0])
            store.park(mine[0], token, worker, '{"generated": []}', at)
        for tenant in ("alpha", "beta"):
            assert sum(o == tenant for o, _, _ in running.values()) <= cap
    # Whatever waits is claimed once the runners are done: nothing is stranded.
    for job_id, (_, worker, token) in list(running.items()):
        _finish(store, job_id, worker, token, at)
    while (claim := store.claim(f"drain-{at}", at)) is not None:
        _finish(store, claim.job_id, f"drain-{at}", claim.exec_token, at)
        at += 1
    assert store.r.zcard(store.keys.queue) == 0


def test_a_tenants_batch_lines_do_not_count_toward_its_waiting_requests(store: Store) -> None:
    k = store.keys
    ids = [f"line-{i}" for i in range(8)]
    for job_id in ids:
        fields = store.job_fields(job_id, "completion", REQUEST, 0, T0, "alpha")
        store.r.hset(k.pending(job_id), mapping={**fields, "batch": "b1", "max_running": "1"})
    store.r.rpush(k.batch_pending("b1"), *ids)
    store.r.hset(k.batch("b1"), mapping={"id": "b1", "status": "in_progress"})
    fed = store.feed_batch("b1", 8, store.policy.score(0, T0), T0, "alpha", 0, 1.0, caps=True)
    assert fed == 8 and store.r.scard(k.live_of("alpha")) == 8
    # Eight lines wait; its requests may still have two waiting.
    _put(store, "r0", "alpha", T0, max_queued=2, max_running=1)
    _put(store, "r1", "alpha", T0, max_queued=2, max_running=1)
    with pytest.raises(TenantQueueFull):
        _put(store, "r2", "alpha", T0, max_queued=2, max_running=1)
