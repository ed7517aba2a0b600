"""Fair turns between tenants at one level (scheduler/fairness.py), on fakeredis
with parkq's own enqueue, feed, claim and finish scripts: what order the claims
come in. Against real processes and real llama.cpp: tests/integration/test_limits.py."""

from __future__ import annotations

import json
import time
from collections import Counter

import fakeredis
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from jobs.store.scheduling import Store
from scheduler import fairness
from scheduler.settings import Settings
from scheduler.state import JobState
from tests.fakes import FakeVocab
from web.app import create_app
from web.janitor import Janitor

T0 = 1_800_000_000.0


def _request(prompt: int = 10, max_tokens: int = 100) -> dict[str, object]:
    return {"prompt_ids": list(range(prompt)), "max_tokens": max_tokens}


def _put(store: Store, job_id: str, owner: str, at: float, weight: float = 1.0,
         level: int = 0, **request: int) -> None:  # fmt: skip
    assert store.enqueue(job_id, "completion", _request(**request), level, at, owner=owner,
                         weight=weight)  # fmt: skip


def _claims(store: Store, n: int, at: float, by: str = "w") -> list[str]:
    """Up to ``n`` claims, each by a sequence of its own (named ``by`` and a number)."""
    out = []
    for i in range(n):
        claim = store.claim(f"{by}{i}", at)
        if claim is None:
            break
        out.append(claim.job_id)
    return out


def test_a_tenants_flood_does_not_hold_back_another_tenants_one_request(store: Store) -> None:
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0 + i * 0.001)
    _put(store, "b0", "beta", T0 + 1.0)
    order = _claims(store, 51, T0 + 2)
    # Each of alpha's jobs is expected to take 110 tokens at the default 50
    # tokens per second: alpha's second job is due 2.2 s after its first, so
    # beta's request, a second after alpha's flood, runs second of 51.
    assert order.index("b0") == 1
    # alpha's own jobs keep their order.
    assert [j for j in order if j.startswith("a")] == [f"a{i}" for i in range(50)]


def test_without_fair_turns_the_one_request_waits_behind_the_flood(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    store = Store(fake_redis, settings.model_copy(update={"fair_share": False}))
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0 + i * 0.001)
    _put(store, "b0", "beta", T0 + 1.0)
    assert _claims(store, 51, T0 + 2)[-1] == "b0"


def test_a_tenant_whose_flood_has_run_starts_afresh(store: Store) -> None:
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0)
    assert len(_claims(store, 50, T0 + 1)) == 50  # all of it runs (or ran)
    # The level's virtual time moved with its claims: alpha owes one turn (the
    # last job it started), not the 50. Beta's first request goes first, then
    # alpha's, then beta's second.
    _put(store, "a-next", "alpha", T0 + 2)
    _put(store, "b0", "beta", T0 + 3)
    _put(store, "b1", "beta", T0 + 3)
    assert _claims(store, 3, T0 + 4, by="v") == ["b0", "a-next", "b1"]


def test_a_cancelled_flood_puts_the_next_job_back_by_half_a_level_at_most(store: Store) -> None:
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0)
    for i in range(50):
        store.cancel(f"a{i}", T0 + 1)
    _put(store, "a-next", "alpha", T0 + 2)
    # It comes after its cancelled jobs' turns (its earlier jobs might still have
    # waited), and those reach half a level's worth at most.
    start = float(store.r.hget(store.keys.job("a-next"), "fair_start") or 0)
    assert T0 + 2 < start <= T0 + 2 + fairness.most_seconds(store.policy.level_seconds) + 0.001


def test_weights_two_to_one_take_turns_two_to_one(store: Store) -> None:
    for i in range(40):
        _put(store, f"a{i}", "alpha", T0, weight=2.0)
        _put(store, f"b{i}", "beta", T0, weight=1.0)
    first = Counter(j[0] for j in _claims(store, 30, T0 + 1))
    assert abs(first["a"] - 20) <= 1 and abs(first["b"] - 10) <= 1


def test_a_tenants_turns_count_tokens_not_requests(store: Store) -> None:
    # alpha's jobs are expected to take 10x beta's (110 tokens against 11):
    # beta takes 10 turns to alpha's one.
    for i in range(30):
        _put(store, f"a{i}", "alpha", T0, prompt=100, max_tokens=10)
        _put(store, f"b{i}", "beta", T0, prompt=1, max_tokens=10)
    first = Counter(j[0] for j in _claims(store, 22, T0 + 1))
    assert first["a"] == 2 and first["b"] == 20


def test_levels_still_come_first(store: Store) -> None:
    for i in range(20):
        _put(store, f"a{i}", "alpha", T0, level=10)
    _put(store, "b0", "beta", T0 + 1, level=0)
    order = _claims(store, 21, T0 + 2)
    # alpha's 20 interactive jobs are due within 44 s of their arrival, less
    # than the 600 s that 10 levels are worth: all of them run before beta's batch job.
    assert order[-1] == "b0"


def test_a_tenants_clock_is_per_level(store: Store) -> None:
    for i in range(20):
        _put(store, f"a{i}", "alpha", T0, level=0)
    _put(store, "a-int", "alpha", T0 + 1, level=10)
    _put(store, "b0", "beta", T0 + 1, level=0)
    order = _claims(store, 22, T0 + 2)
    assert order[:3] == ["a-int", "a0", "b0"]


@pytest.mark.parametrize("owner,weight", [("", 1.0), ("alpha", 0.0)])
def test_no_tenant_or_no_weight_scores_as_before(store: Store, owner: str, weight: float) -> None:
    at = T0 + 0.123456789
    for i in range(3):
        _put(store, f"j{i}", owner, at, weight=weight)
        raw = store.r.hget(store.keys.job(f"j{i}"), "score")
        assert raw is not None and raw.decode() == repr(store.policy.score(0, at))
    assert store.r.hlen(store.keys.fair) == 0


def test_a_tenant_with_nothing_waiting_waits_from_its_arrival(store: Store) -> None:
    _put(store, "a0", "alpha", T0)
    _put(store, "b0", "beta", T0 + 5.0)
    # Nothing was claimed in between: the level's virtual time is still a0's
    # start, where b0 takes its turn; it waits from its arrival, not put
    # forward to a0's (virtual time need not keep up with real time).
    raw = store.r.hget(store.keys.job("b0"), "score")
    assert raw is not None and float(raw) == store.policy.score(0, T0 + 5.0)
    # The same long after.
    cap = fairness.most_seconds(store.policy.level_seconds)
    _put(store, "c0", "gamma", T0 + 5.0 + cap + 1)
    raw = store.r.hget(store.keys.job("c0"), "score")
    assert raw is not None and float(raw) == store.policy.score(0, T0 + 5.0 + cap + 1)


def test_a_level_whose_virtual_time_lags_puts_no_job_before_a_higher_levels(
    store: Store,
) -> None:
    """alpha alone runs one job at a time at level 1 for 29 s (nothing else
    waits: the level's virtual time stays where it was); then a job of beta at
    level 1 and, 5 s later, one of gamma at level 2 whose tenant is behind by
    more than half a level: the higher level runs first (less than half a level
    after the lower: neither is put forward, the later one back by at most
    half a level)."""
    for i in range(29):
        _put(store, f"a{i}", "alpha", T0 + i, level=1)
        assert _claims(store, 1, T0 + i, by=f"w{i}-") == [f"a{i}"]
    for i in range(40):  # gamma's own turns at level 2, more than half a level ahead
        _put(store, f"g{i}", "gamma", T0 + 29, level=2)
    _put(store, "b0", "beta", T0 + 29, level=1)
    _put(store, "g-late", "gamma", T0 + 34, level=2)
    order = _claims(store, 42, T0 + 35, by="x")
    assert order.index("g-late") < order.index("b0")


def test_a_finished_jobs_output_becomes_the_tenants_usual_output(store: Store) -> None:
    _put(store, "a0", "alpha", T0, max_tokens=1000)
    claim = store.claim("w0", T0)
    assert claim is not None
    usage = json.dumps({"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30})
    store.finish("a0", claim.exec_token, "w0", JobState.FINISHED, {"usage": usage}, 0, [], T0)
    assert float(store.r.hget(store.keys.fair, "s|alpha") or 0) == 20.0
    # The next two jobs are expected to take 10 + 20 tokens each (not 10 + 256).
    _put(store, "a1", "alpha", T0 + 1, max_tokens=1000)
    _put(store, "a2", "alpha", T0 + 1, max_tokens=1000)
    starts = [float(store.r.hget(store.keys.job(j), "fair_start") or 0) for j in ("a1", "a2")]
    assert starts[1] - starts[0] == pytest.approx(30 / fairness.DEFAULT_SPEED)


def test_batch_lines_take_their_tenants_turns(store: Store) -> None:
    k = store.keys
    for owner, n in (("alpha", 40), ("beta", 4)):
        ids = [f"{owner}-{i}" for i in range(n)]
        for job_id in ids:
            fields = store.job_fields(job_id, "completion", _request(), 0, T0, owner)
            store.r.hset(k.pending(job_id), mapping={**fields, "batch": owner})
        store.r.rpush(k.batch_pending(owner), *ids)
        store.r.hset(k.batch(owner), mapping={"id": owner, "status": "in_progress"})
    assert store.feed_batch("alpha", 40, store.policy.score(0, T0), T0, "alpha", 0, 1.0) == 40
    assert store.feed_batch("beta", 4, store.policy.score(0, T0 + 1), T0 + 1, "beta", 0, 1.0) == 4
    order = _claims(store, 44, T0 + 2)
    # beta's 4 lines, fed a second after alpha's 40, alternate with alpha's.
    assert [order.index(f"beta-{i}") for i in range(4)] == [1, 3, 5, 7]


def _batch(store: Store, owner: str, n: int) -> None:
    """A batch of ``owner`` of ``n`` pending lines (5 prompt tokens, 2 output)."""
    k = store.keys
    ids = [f"{owner}-{i}" for i in range(n)]
    for job_id in ids:
        fields = store.job_fields(job_id, "completion", _request(5, 2), 0, T0, owner)
        store.r.hset(k.pending(job_id), mapping={**fields, "batch": owner})
    store.r.rpush(k.batch_pending(owner), *ids)
    store.r.hset(k.batch(owner), mapping={"id": owner, "status": "in_progress"})


@pytest.mark.parametrize(("seconds", "after"), [(0.004, 0), (0.004, 50), (0.5, 50), (3.0, 10)])
def test_batches_take_turns_however_fast_their_lines_run(
    store: Store, seconds: float, after: int
) -> None:
    """A batch of 200 lines and, once ``after`` of them ran, one of 20 (4 lines
    of each waiting): one engine sequence runs a line in ``seconds``, far
    faster or slower than the speed turns are first taken at. The small batch
    ends after about 40 lines, not after the large one's 200."""
    now, order = T0, list[str]()
    _batch(store, "big", 200)
    store.feed_batch("big", 4, store.policy.score(0, now), now, "big", 0, 1.0)
    while True:
        if len(order) == after:
            _batch(store, "small", 20)
            store.feed_batch("small", 4, store.policy.score(0, now), now, "small", 0, 1.0)
        claim = store.claim("w", now)
        if claim is None:
            break
        order.append(claim.job_id)
        now += seconds
        usage = json.dumps({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
        store.finish(claim.job_id, claim.exec_token, "w", JobState.FINISHED, {"usage": usage},
                     0, [], now)  # fmt: skip
        owner = claim.job_id.split("-")[0]
        store.feed_batch(owner, 4, store.policy.score(0, now), now, owner, 0, 1.0)
    small = [i for i, job_id in enumerate(order) if job_id.startswith("small")]
    assert len(order) == 220 and len(small) == 20
    assert small[-1] - small[0] + 1 - 20 <= 20 + 2, small


def test_claims_measure_the_speed_and_the_janitor_drops_clocks_that_no_longer_count(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    app = create_app(settings, vocab=FakeVocab(), client=fake_redis)
    store: Store = app.extensions["parkq"].store
    k = store.keys
    now = time.time()
    # alpha floods (110 expected tokens each: its clock moves 110 a job), and
    # its jobs are claimed 0.5 s apart while others wait: the level's virtual
    # time moves 220 tokens a second.
    for i in range(62):
        _put(store, f"a{i}", "alpha", now - 41)
    for i in range(60):
        claim = store.claim(f"w{i}", now - 40 + 0.5 * i)
        assert claim is not None
    assert float(fake_redis.hget(k.fair, "g|0") or 0) == pytest.approx(220.0, rel=0.05)
    # The next claim, half a second later, empties the queue; the one after
    # it, long after, follows a claim that left nothing waiting (the engine
    # may have been idle): it does not count.
    store.cancel("a61", now)
    assert store.claim("w-last", now - 10) is not None
    speed = float(fake_redis.hget(k.fair, "g|0") or 0)
    assert speed == pytest.approx(220.0, rel=0.05)
    _put(store, "a-later", "alpha", now + 100)
    _put(store, "a-later2", "alpha", now + 100)
    assert store.claim("w-later", now + 100) is not None
    assert float(fake_redis.hget(k.fair, "g|0") or 0) == speed
    _put(store, "b0", "beta", now)
    # gamma's clock names a job that runs (a0), its key long past.
    fake_redis.hset(k.fair, "c|0|gamma", f"{now - 5} {now - 10} a0")
    fake_redis.hset(k.fair_earlier, mapping={"rate": "50", "v|0": str(now)})  # a dev build's
    Janitor(app)._fair()
    fields = {f.decode() for f in fake_redis.hkeys(k.fair)}
    # gamma's no longer counts; beta's job and alpha's last one wait.
    assert "c|0|gamma" not in fields and not fake_redis.exists(k.fair_earlier)
    assert {"v|0", "g|0", "g_at|0"} <= fields
    assert "c|0|beta" in fields and "c|0|alpha" in fields


@hsettings(max_examples=80, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.floats(0, 20),
            st.integers(1, 400),
            st.sampled_from([0, 1, 10]),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=40,
    ),
    weights=st.tuples(*[st.sampled_from([0.5, 1.0, 3.0])] * 3),
)
def test_any_arrivals_and_claims_keep_each_tenants_order_and_the_levels(
    arrivals: list[tuple[str, float, int, int, int]], weights: tuple[float, float, float]
) -> None:
    """Jobs of three tenants arrive at levels 0, 1 and 10, and claims come
    between them: no job is put forward of its arrival, nor back by more than
    half a level; a job of a higher level that arrived less than its levels'
    difference less half a level after another runs first; each tenant's jobs
    at a level keep their order; none is lost."""
    store = Store(fakeredis.FakeRedis(), Settings(redis_url="redis://fake", n_ctx=0))
    weight = dict(zip("abc", weights, strict=True))
    level_seconds = store.policy.level_seconds
    cap = fairness.most_seconds(level_seconds)
    at = T0
    sent: dict[tuple[str, int], list[str]] = {}
    waiting: dict[str, tuple[float, int]] = {}
    order: list[str] = []

    def claim(n: int) -> None:
        for claimed in _claims(store, n, at, by=f"w{len(order)}-"):
            arrived, level = waiting.pop(claimed)
            ahead = {j: (lv - level) * level_seconds - cap - 0.1 for j, (a, lv) in waiting.items()}
            passed = [j for j, (a, lv) in waiting.items() if lv > level and a - arrived < ahead[j]]
            assert not passed, (claimed, passed)
            order.append(claimed)

    for i, (owner, gap, tokens, level, claims) in enumerate(arrivals):
        at += gap
        job_id = f"{owner}{i}"
        _put(store, job_id, owner, at, weight=weight[owner], level=level, max_tokens=tokens)
        sent.setdefault((owner, level), []).append(job_id)
        waiting[job_id] = (at, level)
        start = float(store.r.hget(store.keys.job(job_id), "fair_start") or 0)
        assert at <= start <= at + cap + 0.001 * i
        claim(claims)
    at += 1
    claim(len(arrivals) + 1)
    assert sorted(order) == sorted(j for ids in sent.values() for j in ids)
    for ids in sent.values():
        assert [j for j in order if j in set(ids)] == ids


def _runs(store: Store, job_id: str, owner: str, level: int, worker: str, at: float) -> None:
    """``worker`` (a live sequence) runs ``job_id`` of ``owner`` at ``level``."""
    store.workers.heartbeat(worker, now=at, ttl=1000)
    _put(store, job_id, owner, at, level=level)
    claim = store.claim(worker, at)
    assert claim is not None and claim.job_id == job_id


@pytest.mark.parametrize(
    ("runner_owner", "runner_level", "parks"),
    [("alpha", 10, False), ("alpha", 0, True), ("beta", 10, True), ("beta", 5, True)],
)
def test_a_tenant_that_parks_only_others_batch_work_leaves_their_interactive_work_be(
    store: Store, runner_owner: str, runner_level: int, parks: bool
) -> None:
    _runs(store, "running", runner_owner, runner_level, "w-busy", T0)
    extra = {"parks_others": "batch"}
    assert store.enqueue("urgent", "completion", _request(), 20, T0 + 10, owner="beta",
                         extra=extra, weight=1.0)  # fmt: skip
    assert store.maybe_preempt(T0 + 10) == ("w-busy" if parks else None)


def test_a_tenant_that_parks_all_parks_others_interactive_work(store: Store) -> None:
    _runs(store, "running", "alpha", 10, "w-busy", T0)
    _put(store, "urgent", "beta", T0 + 10, level=20)
    assert store.maybe_preempt(T0 + 10) == "w-busy"


def test_a_tenant_that_used_an_idle_engine_owes_nothing_for_it(store: Store) -> None:
    """alpha alone keeps 4 requests waiting for 500 s (a new one as each is
    claimed): its jobs are put back by what it has waiting, not by all it ran;
    then beside beta's burst of 300 it still takes turns, and a batch job of
    another tenant does not pass alpha's interactive ones."""
    at, n = T0, 0

    def put_alpha() -> None:
        nonlocal n
        _put(store, f"a{n}", "alpha", at, level=10)
        n += 1

    def claim_one(name: str) -> str:
        claim = store.claim(name, at)
        assert claim is not None
        store.finish(claim.job_id, claim.exec_token, name, JobState.FINISHED, {}, 0, [], at)
        if claim.job_id.startswith("a"):
            put_alpha()
        return claim.job_id

    for _ in range(4):
        put_alpha()
    for step in range(500):
        at += 1
        claim_one(f"w{step}")
    last = float(store.r.hget(store.keys.job(f"a{n - 1}"), "fair_start") or 0)
    assert last - at <= fairness.most_seconds(store.policy.level_seconds)
    _put(store, "gamma-batch", "gamma", at, level=0)
    for i in range(300):
        _put(store, f"b{i}", "beta", at, level=10)
    order = [claim_one(f"x{i}") for i in range(100)]
    assert "gamma-batch" not in order
    alpha = sum(j.startswith("a") for j in order)
    # Not starved: about one for one while beta's first turns come, then more
    # (beta's jobs past half a level's worth of work wait behind other turns).
    assert alpha >= 30, alpha


def test_a_tenant_that_cancels_its_last_waiting_job_keeps_its_order(store: Store) -> None:
    for i in range(10):
        _put(store, f"a{i}", "alpha", T0)
    store.cancel("a9", T0 + 1)
    _put(store, "a10", "alpha", T0 + 2)
    order = _claims(store, 10, T0 + 3)
    assert order == [f"a{i}" for i in range(9)] + ["a10"]


_USAGE = json.dumps({"prompt_tokens": 10, "completion_tokens": 100, "total_tokens": 110})


def _serve(store: Store, now: float, seconds: float) -> str:
    """One engine sequence claims the best job and runs it for ``seconds``."""
    claim = store.claim("w", now)
    assert claim is not None
    store.finish(claim.job_id, claim.exec_token, "w", JobState.FINISHED, {"usage": _USAGE}, 0,
                 [], now + seconds)  # fmt: skip
    return claim.job_id


def test_tenants_that_send_one_request_at_a_time_do_not_starve_a_backlog(store: Store) -> None:
    """beta and gamma each send their next request as the last one ends; alpha
    has 5 waiting. Each takes its turn: alpha's 5 run within the first 15."""
    for i in range(5):
        _put(store, f"a{i}", "alpha", T0)
    sent = {"b": 0, "c": 0}
    _put(store, "b0", "b", T0 + 0.1)
    _put(store, "c0", "c", T0 + 0.1)
    now, order = T0 + 1, []
    for _ in range(15):
        job_id = _serve(store, now, 1.0)
        order.append(job_id)
        now += 1.0
        if job_id[0] in sent:
            sent[job_id[0]] += 1
            _put(store, f"{job_id[0]}{sent[job_id[0]]}", job_id[0], now)
    assert [j for j in order if j.startswith("a")] == [f"a{i}" for i in range(5)]


def test_a_tenant_that_cancelled_a_flood_waits_a_level_at_most(store: Store) -> None:
    """alpha queues 200 and cancels them: its next job is charged for them, so
    beta's backlog goes first, but no longer than its key (half a level at
    most) and the claim's reach (a quarter) allow."""
    for i in range(200):
        _put(store, f"a{i}", "alpha", T0)
    for i in range(200):
        store.cancel(f"a{i}", T0 + 1)
    _put(store, "a-next", "alpha", T0 + 2)
    for i in range(400):
        _put(store, f"b{i}", "beta", T0 + 3)
    level = store.policy.level_seconds
    bound = T0 + 2 + fairness.most_seconds(level) + fairness.reach_seconds(level) + 1
    now = T0 + 3
    while _serve(store, now, 1.0) != "a-next":
        now += 1.0
        assert now <= bound


def test_a_job_taken_in_anothers_place_is_not_parked_for_it(store: Store) -> None:
    """a1's key is before b0's, but b0's turn is earlier: the claim takes b0
    in a1's place, and a1 waiting does not park it (no claim-park-claim loop)."""
    store.workers.heartbeat("w", now=T0, ttl=10_000)
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0)
    first = store.claim("w", T0)
    assert first is not None and first.job_id == "a0"
    _put(store, "b0", "beta", T0 + 4)
    store.finish("a0", first.exec_token, "w", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0 + 5)
    claim = store.claim("w", T0 + 5)
    assert claim is not None and claim.job_id == "b0"
    assert store.r.zrange(store.keys.queue, 0, 0) == [b"a1"]  # a1 heads the queue
    assert store.maybe_preempt(T0 + 6) is None


def test_a_burst_of_claims_an_instant_apart_does_not_set_the_speed(store: Store) -> None:
    """Two sequences claim 1 ms apart while a third job waits: the speed moves
    from its first guess a little, not to 100,000 tokens a second, so a
    later flood's jobs are still spread over the turns' reach."""
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0)
    store.claim("w1", T0 + 1)
    store.claim("w2", T0 + 1.001)
    speed = float(store.r.hget(store.keys.fair, "g|0") or fairness.DEFAULT_SPEED)
    assert speed < 3 * fairness.DEFAULT_SPEED
    for i in range(100):
        _put(store, f"f{i}", "flood", T0 + 60)
    last = float(store.r.hget(store.keys.job("f99"), "fair_start") or 0)
    assert last - (T0 + 60) >= fairness.most_seconds(store.policy.level_seconds) - 1


def test_a_job_taken_out_of_turn_does_not_move_virtual_time(store: Store) -> None:
    """A weight-0.001 tenant's second job is far ahead in turns and is taken
    once its key time is a quarter level past: the level's virtual time (and
    so every other tenant's lead, and the measured speed) stays where turns
    put it. An hour later a flood is still spread over its turns: a tenant's
    one request a second after it runs second."""
    for i in range(48):
        _put(store, f"b{i}", "beta", T0)
    for j in ("t0", "t1"):
        _put(store, j, "tiny", T0, weight=0.001)
    now = T0
    while (claim := store.claim("w", now)) is not None:
        now += 1.0
        store.finish(claim.job_id, claim.exec_token, "w", JobState.FINISHED, {"usage": _USAGE},
                     0, [], now)  # fmt: skip
    assert float(store.r.hget(store.keys.fair, "g|0") or 0) < 3 * fairness.DEFAULT_SPEED
    later = now + 3600
    for i in range(100):
        _put(store, f"a{i}", "alpha", later)
    _put(store, "g0", "gamma", later + 1)
    assert [_serve(store, later + 1 + i, 1.0) for i in range(2)][1] == "g0"


def test_a_job_cancelled_after_it_ran_is_charged(store: Store) -> None:
    """beta's request ran, then was cancelled (its client left): beta's next
    one is charged for it and takes its turn after alpha's, sent later."""
    _put(store, "b0", "beta", T0)
    running = store.claim("w0", T0)
    assert running is not None and running.job_id == "b0"
    store.finish("b0", running.exec_token, "w0", JobState.CANCELLED, {}, 0, [], T0 + 1)
    assert store.r.hget(store.keys.job("b0"), "state") == b"cancelled"
    _put(store, "b1", "beta", T0 + 1)
    _put(store, "a0", "alpha", T0 + 1.5)
    assert _claims(store, 2, T0 + 2, by="x") == ["a0", "b1"]


def test_a_waiting_job_parks_no_runner_the_claim_would_hand_back(store: Store) -> None:
    """R (beta) runs at an earlier turn than F (alpha, waiting) but a later key:
    parking R for F would only see the claim take R again in F's place."""
    for worker in ("w1", "w2"):
        store.workers.heartbeat(worker, now=T0, ttl=10_000)
    _put(store, "g0", "gamma", T0)
    assert (busy := store.claim("w2", T0)) is not None and busy.job_id == "g0"
    _put(store, "a0", "alpha", T0, prompt=500)
    first = store.claim("w1", T0)
    assert first is not None
    store.finish("a0", first.exec_token, "w1", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0)
    _put(store, "b0", "beta", T0 + 0.06, prompt=400)
    done = store.claim("w1", T0 + 0.06)
    assert done is not None
    store.finish("b0", done.exec_token, "w1", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0)
    _put(store, "R", "beta", T0 + 0.1, prompt=400)
    assert (run := store.claim("w1", T0 + 0.1)) is not None and run.job_id == "R"
    _put(store, "F", "alpha", T0 + 0.2)
    key = {j: float(store.r.hget(store.keys.job(j), "fair_start") or 0) for j in ("R", "F")}
    turn = {j: float(store.r.hget(store.keys.job(j), "fair_v") or 0) for j in ("R", "F")}
    assert key["F"] + 1 < key["R"] and turn["R"] < turn["F"]  # the case at hand
    assert store.maybe_preempt(T0 + 0.5) is None


def test_a_tenant_served_beside_an_old_backlog_is_not_held_back_after_it(store: Store) -> None:
    """alpha's 300 one-second jobs run past half a level (in arrival order);
    beta's requests, one every 10 s meanwhile, run among them. Once the
    backlog is gone beta and a newcomer take turns one for one: the level's
    virtual time moved on with the backlog, so beta owes nothing for it."""
    for i in range(300):
        _put(store, f"a{i}", "alpha", T0)
    now, sent = T0, 0
    while True:
        if sent < 20 and now >= T0 + 40 + 10 * sent:
            _put(store, f"b{sent}", "beta", now)
            sent += 1
        claim = store.claim("w", now)
        if claim is None:
            break
        now += 1.0
        store.finish(claim.job_id, claim.exec_token, "w", JobState.FINISHED, {"usage": _USAGE},
                     0, [], now)  # fmt: skip
    for i in range(10):
        _put(store, f"B{i}", "beta", now)
        _put(store, f"G{i}", "gamma", now)
    order = "".join(_serve(store, now + i, 1.0)[0] for i in range(20))
    assert order.count("B", 0, 10) == 5, order


def test_a_waiting_job_of_an_equal_turn_parks_the_runner(store: Store) -> None:
    """R (alpha, a turn ahead) runs; beta, with nothing waiting, sends W at the
    same turn and a key 11 s earlier: the claim would take W first (equal
    turns keep their places), so W parks R."""
    store.workers.heartbeat("w1", now=T0, ttl=10_000)
    _put(store, "a0", "alpha", T0, prompt=500)
    first = store.claim("w1", T0)
    assert first is not None
    store.finish("a0", first.exec_token, "w1", JobState.FINISHED, {"usage": _USAGE}, 0, [],
                 T0 + 0.05)  # fmt: skip
    _put(store, "R", "alpha", T0 + 0.1, prompt=500)
    assert (run := store.claim("w1", T0 + 0.1)) is not None and run.job_id == "R"
    _put(store, "W", "beta", T0 + 0.5)
    turns = [store.r.hget(store.keys.job(j), "fair_v") for j in ("R", "W")]
    assert turns[0] == turns[1]
    assert store.maybe_preempt(T0 + 1.0) == "w1"
