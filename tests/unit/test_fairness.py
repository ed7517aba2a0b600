"""Fair turns between tenants at one level (scheduler/fairness.py), on fakeredis
with parkq's own enqueue, feed, claim and finish scripts: what order the claims
come in. Against real processes and real llama.cpp: tests/integration/test_limits.py."""

from __future__ import annotations

import json
import time
from collections import Counter

import fakeredis
import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from jobs.store.scheduling import Store
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
    # beta's turn comes right after alpha's first: second of 51.
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


def test_a_cancelled_flood_is_not_charged(store: Store) -> None:
    """alpha queues 50 and cancels them, then beta queues 10 and alpha one
    more: alpha's is not behind its cancelled jobs' turns (none of them ran)."""
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0)
    for i in range(50):
        store.cancel(f"a{i}", T0 + 1)
    for i in range(10):
        _put(store, f"b{i}", "beta", T0 + 2)
    _put(store, "a-next", "alpha", T0 + 3)
    assert _claims(store, 11, T0 + 4).index("a-next") <= 1
    # Nothing of alpha's is left listed.
    assert not store.r.exists(store.keys.tenant_queue(0, "alpha"))
    assert store.r.zrange(store.keys.turns(0), 0, -1) == []


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


def test_a_finished_jobs_output_becomes_the_tenants_usual_output(store: Store) -> None:
    _put(store, "a0", "alpha", T0, max_tokens=1000)
    claim = store.claim("w0", T0)
    assert claim is not None
    usage = json.dumps({"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30})
    store.finish("a0", claim.exec_token, "w0", JobState.FINISHED, {"usage": usage}, 0, [], T0)
    assert float(store.r.hget(store.keys.fair, "s|alpha") or 0) == 20.0
    # The next job is expected to take 10 + 20 tokens (not 10 + 256).
    _put(store, "a1", "alpha", T0 + 1, max_tokens=1000)
    assert float(store.r.hget(store.keys.job("a1"), "fair_tokens") or 0) == 30.0


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


def test_the_janitor_drops_what_no_longer_counts(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    app = create_app(settings, vocab=FakeVocab(), client=fake_redis)
    store: Store = app.extensions["parkq"].store
    k = store.keys
    now = time.time()
    for i in range(3):
        _put(store, f"a{i}", "alpha", now)
    _put(store, "b0", "beta", now)
    assert _claims(store, 2, now) == ["a0", "b0"]
    # gamma ran long ago (its clock is behind the level's virtual time) and
    # waits for nothing; a job of delta's ended waiting without a claim or a
    # cancel (its record expired): delta's queue names it alone.
    fake_redis.hset(k.fair, "c|0|gamma", "-5")
    _put(store, "d0", "delta", now)
    fake_redis.delete(k.job("d0"))
    fake_redis.hset(k.fair, mapping={"g|0": "50", "g_at|0": "1 2 3 1", "c|0|old": "1 2 a0"})
    fake_redis.hset(k.fair_earlier, mapping={"rate": "50", "v|0": str(now)})  # a dev build's
    Janitor(app)._fair()
    fields = {f.decode() for f in fake_redis.hkeys(k.fair)}
    assert fields == {"v|0", "c|0|alpha", "c|0|beta"}  # alpha waits; beta's is ahead
    assert not fake_redis.exists(k.fair_earlier)
    assert fake_redis.zrange(k.turns(0), 0, -1) == [b"alpha"]
    assert not fake_redis.exists(k.tenant_queue(0, "delta"))


def _arrivals(gap: float) -> st.SearchStrategy[list[tuple[str, float, int, int, int, bool]]]:
    """Jobs of tenants a, b and c: each its tenant, the seconds since the last
    (up to ``gap``), its max_tokens, its level, how many claims come after it
    and a flag (what the test does after those claims)."""
    one = st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, gap), st.integers(1, 400),
                    st.sampled_from([0, 1, 10]), st.integers(0, 2), st.booleans())  # fmt: skip
    return st.lists(one, min_size=1, max_size=40)


def _places(
    fair: bool, arrivals: list[tuple[str, float, int, int, int, bool]]
) -> list[tuple[str, str]]:
    """Each claim's job's level and the key it runs at, with fair turns or
    without (the last job claimed after an arrival parked where it says)."""
    settings = Settings(redis_url="redis://fake", n_ctx=0, fair_share=fair)
    store = Store(fakeredis.FakeRedis(), settings)
    weight = {"a": 0.001, "b": 1.0, "c": 3.0}
    at, out = T0, []
    for i, (owner, gap, tokens, level, claims, park) in enumerate(arrivals):
        at += gap
        _put(store, f"{owner}{i}", owner, at, weight=weight[owner], level=level, max_tokens=tokens)
        last = None
        for n in range(claims + (len(arrivals) if i == len(arrivals) - 1 else 0)):
            last = store.claim(f"w{i}-{n}", at)
            if last is None:
                break
            raw = store.r.hget(store.keys.job(last.job_id), "priority")
            out.append(((raw or b"").decode(), repr(last.key)))
        if park and last is not None and i < len(arrivals) - 1:
            store.park(last.job_id, last.exec_token, f"w{i}-{claims - 1}", "{}", at)
    return out


@hsettings(max_examples=80, deadline=None)
@given(arrivals=_arrivals(700))
@example(
    arrivals=[("a", 0.0, 100, 0, 0, False), ("a", 0.0, 100, 0, 1, False)]
    + [("c", 20.0, 100, 1, 0, False)] * 4 + [("b", 1.0, 100, 0, 0, False)]
)  # fmt: skip
@example(
    arrivals=[("c", 0.0, 100, 0, 1, False), ("c", 0.0, 100, 0, 0, False),
              ("a", 5.0, 100, 0, 0, False), ("b", 60.0, 100, 1, 0, False)]
)  # fmt: skip
@example(
    arrivals=[("a", 0.0, 100, 0, 0, False), ("a", 0.0, 100, 0, 1, False),
              ("c", 700.0, 100, 10, 0, False)] + [("b", 10.0, 100, 0, 1, True)] * 5
)  # fmt: skip
def test_turns_leave_every_levels_places_as_without_them(
    arrivals: list[tuple[str, float, int, int, int, bool]],
) -> None:
    """Jobs of three tenants (weights 0.001, 1 and 3) at levels 0, 1 and 10,
    claims and parks between them: the levels claims take and the keys they
    run at are the same with fair turns and without. Turns only choose which of a
    level's jobs takes each of its places, so a job of another level waits
    exactly as it would without them (a weight-0.001 tenant's old job heading
    a level does not hold a place there for other tenants' newer ones)."""
    on, off = _places(True, arrivals), _places(False, arrivals)
    # (Redis orders equal scores by member: two jobs of different levels at
    # exactly one key may be claimed in either order.)
    assert [key for _, key in on] == [key for _, key in off]
    assert sorted(on) == sorted(off)


@hsettings(max_examples=80, deadline=None)
@given(
    arrivals=_arrivals(20),
    weights=st.tuples(*[st.sampled_from([0.5, 1.0, 3.0])] * 3),
)
@example(arrivals=[("a", 0.0, 100, 0, 0, False)] * 5 + [("b", 1.0, 100, 0, 0, False)],
         weights=(1.0, 1.0, 1.0))  # fmt: skip
def test_any_arrivals_claims_and_cancels_keep_the_levels_each_tenants_order_and_its_share(
    arrivals: list[tuple[str, float, int, int, int, bool]], weights: tuple[float, float, float]
) -> None:
    """Jobs of three tenants arrive at levels 0, 1 and 10, and claims and
    cancels come between them:
    - each tenant's jobs at a level keep their order, and none is lost;
    - while two tenants both have jobs waiting at a level, the expected tokens
      over weight claimed for one never lead the other's by more than their
      largest jobs' (start-time fair queueing's bound)."""
    store = Store(fakeredis.FakeRedis(), Settings(redis_url="redis://fake", n_ctx=0))
    weight = dict(zip("abc", weights, strict=True))
    at = T0
    sent: dict[tuple[str, int], list[str]] = {}
    waiting: dict[str, tuple[float, int, str]] = {}
    order: list[str] = []
    cancelled: set[str] = set()
    # (level, tenant, other): what the tenant was charged beyond the other
    # since both last had jobs waiting there; each tenant's largest charge.
    lead: dict[tuple[int, str, str], float] = {}
    largest: dict[str, float] = dict.fromkeys("abc", 0.0)

    def claim(n: int) -> None:
        for claimed in _claims(store, n, at, by=f"w{len(order)}-"):
            _, level, owner = waiting.pop(claimed)
            charge = float(store.r.hget(store.keys.job(claimed), "fair_tokens") or 0)
            for other in "abc":
                key = (level, owner, other)
                if other != owner and key in lead:
                    lead[key] += charge
                    lead[(level, other, owner)] -= charge
                    assert lead[key] <= largest[owner] + largest[other] + 1e-6, (claimed, lead)
            order.append(claimed)
            backlogged()

    def backlogged() -> None:
        """Start counting for the pairs that both have jobs waiting at a level,
        stop for those that do not."""
        here = {(lv, o) for _, lv, o in waiting.values()}
        for x in "abc":
            for y in "abc":
                for level in (0, 1, 10):
                    both = x != y and (level, x) in here and (level, y) in here
                    if not both:
                        lead.pop((level, x, y), None)
                    elif (level, x, y) not in lead:
                        lead[(level, x, y)] = 0.0

    for i, (owner, gap, tokens, level, claims, cancel) in enumerate(arrivals):
        at += gap
        job_id = f"{owner}{i}"
        _put(store, job_id, owner, at, weight=weight[owner], level=level, max_tokens=tokens)
        charge = float(store.r.hget(store.keys.job(job_id), "fair_tokens") or 0)
        largest[owner] = max(largest[owner], charge)
        sent.setdefault((owner, level), []).append(job_id)
        waiting[job_id] = (at, level, owner)
        backlogged()
        claim(claims)
        if cancel and waiting:
            victim = min(waiting)
            store.cancel(victim, at)
            cancelled.add(victim)
            waiting.pop(victim)
            backlogged()
    at += 1
    claim(len(arrivals) + 1)
    assert sorted(order) == sorted(j for ids in sent.values() for j in ids if j not in cancelled)
    for ids in sent.values():
        assert [j for j in order if j in set(ids)] == [j for j in ids if j not in cancelled]
    assert store.r.zcard(store.keys.queue) == 0
    for level in (0, 1, 10):
        assert store.r.zcard(store.keys.turns(level)) == 0


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
    # The level's virtual time moved with alpha's claims: alpha's turn is one
    # job ahead of it, not 500.
    turns = store.r.hgetall(store.keys.fair)
    assert float(turns[b"c|10|alpha"]) - float(turns[b"v|10"]) <= 110
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


def test_a_job_taken_in_anothers_place_is_not_parked_for_it(store: Store) -> None:
    """a1's key is before b0's, but b0's turn is earlier: the claim takes b0
    in a1's place, and a1 waiting (in b0's) does not park it."""
    store.workers.heartbeat("w", now=T0, ttl=10_000)
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0)
    first = store.claim("w", T0)
    assert first is not None and first.job_id == "a0"
    _put(store, "b0", "beta", T0 + 4)
    store.finish("a0", first.exec_token, "w", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0 + 5)
    claim = store.claim("w", T0 + 5)
    assert claim is not None and claim.job_id == "b0"
    # a1 took b0's place in the queue (b0 runs in a1's): nothing to park for.
    assert store.r.zrange(store.keys.queue, 0, -1) == [b"a2", b"a1"]
    assert store.maybe_preempt(T0 + 6) is None


def test_an_old_backlog_does_not_hold_back_another_tenants_request(store: Store) -> None:
    """alpha's 1,000 one-second jobs have waited longer than any level is worth
    when gamma sends one request: it runs next. So does the first of two of a
    weight-0.001 tenant; its second, whose turn is 1,000 of alpha's later,
    runs after alpha's 700 left."""
    for i in range(1000):
        _put(store, f"a{i}", "alpha", T0 + i * 0.001)
    now = T0
    for _ in range(300):
        _serve(store, now, 1.0)
        now += 1.0
    _put(store, "g0", "gamma", now)
    assert _serve(store, now, 1.0) == "g0"
    for j in ("t0", "t1"):
        _put(store, j, "tiny", now, weight=0.001)
    order = [_serve(store, now + i, 1.0) for i in range(702)]
    assert order[:2] == ["t0", "a300"] and order[-1] == "t1"


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


def _engine(store: Store, n: int, at: float) -> None:
    for i in range(n):
        store.workers.heartbeat(f"w{i}", now=at, ttl=10_000)


@pytest.mark.parametrize(
    ("alpha_runs", "beta_runs", "beta_weight", "parks"),
    [(2, 0, 1.0, True), (1, 0, 1.0, False), (3, 1, 1.0, True), (2, 1, 1.0, False),
     (2, 0, 0.25, False), (8, 0, 0.25, True)],
)  # fmt: skip
def test_a_tenant_under_its_share_of_the_sequences_parks_one_over_it(
    store: Store, alpha_runs: int, beta_runs: int, beta_weight: float, parks: bool
) -> None:
    """All the engine's sequences run interactive work; beta sends a request
    of the same level: it parks alpha's newest job exactly when alpha would
    still hold, over its weight, more than beta would after (a park that
    only swaps two tenants' places is not made)."""
    n = alpha_runs + beta_runs
    _engine(store, n, T0)
    for i in range(alpha_runs):
        _put(store, f"a{i}", "alpha", T0 + i, level=10)
    for i in range(beta_runs):
        _put(store, f"b{i}", "beta", T0 + 10 + i, level=10, weight=beta_weight)
    assert len(_claims(store, n, T0 + 20)) == n
    _put(store, "a-more", "alpha", T0 + 21, level=10)  # alpha's backlog
    _put(store, "B", "beta", T0 + 22, level=10, weight=beta_weight)
    runs = {store.r.hget(store.keys.worker(f"w{i}"), "job"): f"w{i}" for i in range(n)}
    newest = runs[f"a{alpha_runs - 1}".encode()]
    assert store.maybe_preempt(T0 + 23) == (newest if parks else None)


def test_a_share_park_hands_the_sequence_to_the_tenant_under_its_share(store: Store) -> None:
    """beta's request parks one of alpha's two runners; the freed sequence
    claims beta's, not alpha's parked job or its backlog, and nothing parks again."""
    _engine(store, 2, T0)
    for i in range(4):
        _put(store, f"a{i}", "alpha", T0 + i, level=10)
    assert _claims(store, 2, T0 + 4) == ["a0", "a1"]
    _put(store, "B", "beta", T0 + 5, level=10)
    victim = store.maybe_preempt(T0 + 6)
    assert victim == "w1"
    exec_token = store.r.hget(store.keys.worker("w1"), "exec")
    assert exec_token is not None
    store.park("a1", exec_token.decode(), "w1", "{}", T0 + 6)
    assert store.r.hget(store.keys.job("a1"), "state") == b"parked"
    claim = store.claim("w1", T0 + 6)
    assert claim is not None and claim.job_id == "B"
    assert store.maybe_preempt(T0 + 7) is None


def test_a_tenant_that_parks_only_batch_work_parks_no_share_of_interactive_work(
    store: Store,
) -> None:
    _engine(store, 2, T0)
    for i in range(3):
        _put(store, f"a{i}", "alpha", T0, level=10)
    assert len(_claims(store, 2, T0 + 1)) == 2
    assert store.enqueue("B", "completion", _request(), 10, T0 + 5, owner="beta",
                         extra={"parks_others": "batch"}, weight=1.0)  # fmt: skip
    assert store.maybe_preempt(T0 + 6) is None


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


def _park_runner(store: Store, worker: str, now: float, keeps_kv: bool = False) -> str:
    """``worker``'s job parks (by default keeping no KV: any sequence may take it)."""
    job = (store.r.hget(store.keys.worker(worker), "job") or b"").decode()
    exec_token = (store.r.hget(store.keys.worker(worker), "exec") or b"").decode()
    store.park(job, exec_token, worker, "{}", now, keeps_kv=keeps_kv)
    return job


def test_no_share_park_for_a_tenant_no_sequence_may_serve(store: Store) -> None:
    """beta runs one job, at its max_running of 1, and has another waiting at
    the earliest turn; alpha holds the other three sequences. No park is made
    for beta (the claim would pass its job over and hand the sequence back):
    not by the next request either."""
    _engine(store, 4, T0)

    def put_beta(job_id: str, at: float) -> None:
        assert store.enqueue(job_id, "completion", _request(), 10, at, owner="beta", weight=1.0,
                             extra={"max_running": "1"}, caps=True)  # fmt: skip

    for i in range(3):
        _put(store, f"a{i}", "alpha", T0 + i, level=10)
    put_beta("b0", T0 + 3)
    assert sorted(_claims(store, 4, T0 + 4)) == ["a0", "a1", "a2", "b0"]
    for i in range(3, 8):
        _put(store, f"a{i}", "alpha", T0 + i, level=10)
    put_beta("b1", T0 + 20)
    assert store.maybe_preempt(T0 + 30) is None
    _put(store, "d0", "delta", T0 + 31, level=0)
    assert store.maybe_preempt(T0 + 31) is None


def test_no_share_park_for_a_parked_job_left_to_its_checkpoints_holder(store: Store) -> None:
    """beta's job is parked with its KV in process P2 (busy with a higher
    level's job); P1's two sequences run alpha's: no park of P1's is made for
    beta, whose job only P2 may take yet."""
    for worker, proc in (("P1a", "P1"), ("P1b", "P1"), ("P2", "P2")):
        store.workers.heartbeat(worker, now=T0, ttl=10_000, proc=proc)
    _put(store, "Bp", "beta", T0)
    assert (first := store.claim("P2", T0 + 0.5, proc="P2")) is not None and first.job_id == "Bp"
    for i in range(10):
        _put(store, f"a{i}", "alpha", T0 + 1 + i * 0.01)
    claims = [store.claim(w, T0 + 1.1, proc="P1") for w in ("P1a", "P1b")]
    assert [c.job_id if c else None for c in claims] == ["a0", "a1"]
    assert _park_runner(store, "P2", T0 + 2, keeps_kv=True) == "Bp"
    _put(store, "G", "gamma", T0 + 2, level=20)
    assert (top := store.claim("P2", T0 + 2, proc="P2")) is not None and top.job_id == "G"
    assert store.maybe_preempt(T0 + 3) is None


def test_a_backlogs_parked_jobs_do_not_win_every_equal_turn(store: Store) -> None:
    """alpha's four running jobs were parked (by a higher level's burst, say);
    gamma's request, sent once the first is running again, runs next."""
    _engine(store, 4, T0)
    for i in range(8):
        _put(store, f"a{i}", "alpha", T0 + i * 0.01)
    assert len(_claims(store, 4, T0 + 1)) == 4
    for i in range(4):
        _park_runner(store, f"w{i}", T0 + 2)
    assert _serve(store, T0 + 3, 1.0) == "a0"
    _put(store, "g0", "gamma", T0 + 4)
    assert [_serve(store, T0 + 5 + i, 1.0) for i in range(3)] == ["g0", "a1", "a2"]


def test_a_job_queued_by_release_0_2_0_is_charged_when_it_runs(store: Store) -> None:
    """0.2.0 gave a job its turn where it was queued (fair_v, fair_tokens, in
    no tenant's queue): claimed after an upgrade, it moves its tenant's clock,
    so another tenant's request does not wait behind all of them."""
    for i in range(20):
        _put(store, f"old{i}", "alpha", T0 + i * 0.01, weight=0.0)
        store.r.hset(store.keys.job(f"old{i}"), mapping={"fair_tokens": "110",
                                                         "fair_v": str(110 * i)})  # fmt: skip
    store.r.hset(store.keys.fair, mapping={"v|0": "0", "c|0|alpha": f"2200 {T0 + 30} old19"})
    _put(store, "g0", "gamma", T0 + 60)
    assert [_serve(store, T0 + 61 + i, 1.0) for i in range(21)].index("g0") <= 2


def test_a_runner_the_claim_would_hand_its_place_back_is_not_parked(store: Store) -> None:
    """X (alpha) comes back to the queue with an old key when its worker dies;
    G (gamma), of an earlier turn, runs: parking G for X's key would see the
    claim hand G the sequence again."""
    store.workers.heartbeat("w1", now=T0, ttl=30)
    store.workers.heartbeat("w2", now=T0, ttl=10_000)
    _put(store, "X", "alpha", T0, prompt=500)
    assert (x := store.claim("w1", T0)) is not None and x.job_id == "X"
    _put(store, "G", "gamma", T0 + 10)
    assert (g := store.claim("w2", T0 + 10)) is not None and g.job_id == "G"
    store.reap(T0 + 60)
    assert store.r.hget(store.keys.job("X"), "state") == b"queued"
    assert store.maybe_preempt(T0 + 61) is None


def test_tenants_passed_over_for_their_caps_do_not_hide_the_next_turn(store: Store) -> None:
    """40 tenants at their max_running of 1, each with one more waiting at an
    earlier turn than alpha's flood: beta's request, sent while the flood
    waits, still runs next."""
    for t in range(40):
        for n in range(2):
            assert store.enqueue(f"t{t}-{n}", "completion", _request(), 0, T0, owner=f"t{t}",
                                 weight=1.0, extra={"max_running": "1"}, caps=True)  # fmt: skip
        assert (c := store.claim(f"cap{t}", T0)) is not None and c.job_id == f"t{t}-0"
    for i in range(50):
        _put(store, f"a{i}", "alpha", T0 + 1 + i * 0.001)
    assert _claims(store, 5, T0 + 2, by="x") == [f"a{i}" for i in range(5)]
    _put(store, "b0", "beta", T0 + 3)
    assert _claims(store, 1, T0 + 4, by="y") == ["b0"]


def test_no_share_park_that_the_claim_would_hand_back(store: Store) -> None:
    """alpha holds two of three sequences with small jobs (the third runs a
    higher level's); beta, behind in turns after a large job, sends one:
    parking one of alpha's would see the claim hand it straight back
    (alpha's turn is earlier), so none is made."""
    _engine(store, 3, T0)
    _put(store, "g0", "gamma", T0, prompt=3000, level=10)
    assert (g := store.claim("w2", T0)) is not None and g.job_id == "g0"
    _put(store, "b0", "beta", T0 + 0.5, prompt=2000)
    done = store.claim("w0", T0 + 0.5)
    assert done is not None and done.job_id == "b0"
    _put(store, "a0", "alpha", T0 + 1)
    _put(store, "a1", "alpha", T0 + 1.5)
    store.finish("b0", done.exec_token, "w0", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0 + 3)
    assert [c.job_id if c else None for c in (store.claim(w, T0 + 3) for w in ("w0", "w1"))] == [
        "a0",
        "a1",
    ]
    _put(store, "b1", "beta", T0 + 4)
    assert store.maybe_preempt(T0 + 5) is None


def test_a_parked_job_whose_place_is_given_away_is_left_to_no_holder(store: Store) -> None:
    """P (alpha) parked keeping its KV in process X; X's claim gives P's place
    to beta's H (an earlier turn) and P takes H's: P is no longer left to X
    alone, so Y, once free, takes P before a lower level's R."""
    for w in ("X", "Y"):
        store.workers.heartbeat(w, now=T0, ttl=10_000, proc=w)
    _put(store, "P", "alpha", T0, level=10)
    assert (p := store.claim("X", T0, proc="X")) is not None and p.job_id == "P"
    _put(store, "Z", "delta", T0 + 1, level=20)
    z = store.claim("Y", T0 + 1, proc="Y")
    assert z is not None and z.job_id == "Z"
    _put(store, "R", "gamma", T0 + 1.5, level=0)
    _put(store, "H", "beta", T0 + 1.6, level=10)
    assert _park_runner(store, "X", T0 + 2, keeps_kv=True) == "P"
    assert (h := store.claim("X", T0 + 2.1, proc="X")) is not None and h.job_id == "H"
    store.finish("Z", z.exec_token, "Y", JobState.FINISHED, {"usage": _USAGE}, 0, [], T0 + 2.5)
    assert (y := store.claim("Y", T0 + 2.5, proc="Y")) is not None and y.job_id == "P"


def test_jobs_queued_by_release_0_2_0_keep_their_order_before_the_tenants_new_ones(
    store: Store,
) -> None:
    for i in range(3):
        _put(store, f"old{i}", "alpha", T0 + i * 0.01, weight=0.0)
        store.r.hset(store.keys.job(f"old{i}"), mapping={"fair_tokens": "110",
                                                         "fair_v": str(110 * i)})  # fmt: skip
    for i in range(3):
        _put(store, f"new{i}", "alpha", T0 + 60 + i)
    assert _claims(store, 6, T0 + 70) == [f"old{i}" for i in range(3)] + [
        f"new{i}" for i in range(3)
    ]


def test_a_resumed_job_takes_its_turn_behind_a_tenant_waiting_at_it(store: Store) -> None:
    """alpha's four jobs run; beta's three, claimed meanwhile, move the
    level's virtual time past alpha's clock; alpha's park. Each of alpha's
    jobs resumed charges a token: gamma's request, sent after the first
    resumed, runs next (at an equal turn the first job's tenant, alpha,
    would take every place)."""
    _engine(store, 4, T0)
    for i in range(4):
        _put(store, f"a{i}", "alpha", T0 + i * 0.01)
    assert len(_claims(store, 4, T0 + 1)) == 4
    for i in range(3):
        _put(store, f"b{i}", "beta", T0 + 1.5 + i)
        assert _claims(store, 1, T0 + 1.5 + i, by=f"x{i}-") == [f"b{i}"]
    turns = store.r.hgetall(store.keys.fair)
    assert float(turns[b"v|0"]) > float(turns[b"c|0|alpha"])  # the case at hand
    for i in range(4):
        _park_runner(store, f"w{i}", T0 + 5)
    assert _serve(store, T0 + 6, 1.0) == "a0"
    _put(store, "g0", "gamma", T0 + 7)
    assert [_serve(store, T0 + 8 + i, 1.0) for i in range(2)] == ["g0", "a1"]


def test_an_equal_turn_goes_to_the_first_jobs_tenant(store: Store) -> None:
    """gamma's g0 took alpha's a1's place (a1 now waits at g0's, behind a2);
    then alpha and gamma wait at equal turns, alpha's a2 first in the queue
    and gamma's g1 before a1: alpha's turn, and its first job, a1, is taken."""
    _put(store, "a0", "alpha", T0)
    assert _claims(store, 1, T0 + 1, by="x") == ["a0"]
    _put(store, "a1", "alpha", T0 + 2)
    _put(store, "a2", "alpha", T0 + 3)
    _put(store, "g0", "gamma", T0 + 4)
    assert _claims(store, 1, T0 + 5, by="y") == ["g0"]
    _put(store, "g1", "gamma", T0 + 3.5)
    assert store.r.zrange(store.keys.queue, 0, -1) == [b"a2", b"g1", b"a1"]
    turns = dict(store.r.zrange(store.keys.turns(0), 0, -1, withscores=True))
    assert turns[b"alpha"] == turns[b"gamma"]
    assert _claims(store, 1, T0 + 6, by="z") == ["a1"]
