"""The worker loop with fakeredis and the fake engine."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis

from jobs.engine.llama import EngineError
from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import StepCall, Store
from jobs.worker.loop import Worker
from scheduler.settings import Settings
from tests.fakes import FakeEngine


class FlakyEngine(FakeEngine):
    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        if bytes(self.context[:4] + list(tokens)[:4]).startswith(b"boom"):
            raise EngineError("llama_decode returned -1")
        return super().eval(tokens, pos, seq)


@contextlib.contextmanager
def _running(worker: Worker) -> Iterator[None]:
    """The worker's loop in a thread for the duration of the block."""
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield
    finally:
        worker.stop()
        thread.join(timeout=10)


def _fails_once(call: Any) -> Any:
    """``call``, except that its first call raises a ConnectionError (a Redis blip)."""
    import redis

    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise redis.ConnectionError("Connection reset by peer")
        return call(*args, **kwargs)

    return flaky


def _submit(store: Store, rq: RQBridge, job_id: str, prompt: bytes) -> None:
    req = GenerationRequest("completion", "fake", list(prompt), 5, SamplingParams(temperature=0))
    rq.create(job_id, "test")
    store.enqueue(job_id, "completion", req.to_json(), 10, time.time())


def _wait_state(store: Store, job_id: str, states: set[str]) -> dict[str, str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rec = store.get(job_id)
        if rec and rec["state"] in states:
            return rec
        time.sleep(0.01)
    raise AssertionError(f"{job_id} never reached {states}")


def test_an_engine_error_fails_the_job_and_the_worker_carries_on(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    worker = Worker(settings, FlakyEngine(), fake_redis, name="w1")
    with _running(worker):
        _submit(store, rq, "bad", b"boom!")
        _submit(store, rq, "good", b"fine")
        bad = _wait_state(store, "bad", {"failed", "finished"})
        good = _wait_state(store, "good", {"failed", "finished"})
    assert bad["state"] == "failed" and "llama_decode" in bad["error"]
    events = store.events_after("bad", 0)
    assert json.loads(events[-2][1])["error"]["code"] == "engine_error"
    assert events[-1][1] == "[DONE]"
    assert good["state"] == "finished" and good["tokens"] == "5"
    assert rq.fetch("bad").get_status() == "failed"  # type: ignore[union-attr]
    assert rq.fetch("good").get_status() == "finished"  # type: ignore[union-attr]


def test_jobs_of_dead_workers_are_requeued_then_failed_after_the_crash_limit(
    store: Store,
) -> None:
    store.enqueue("j", "completion", {}, 0, 1.0)
    for crash in range(1, 4):
        store.workers.heartbeat(f"w{crash}", now=100.0 * crash, ttl=5)
        claim = store.claim(f"w{crash}", 100.0 * crash)
        assert claim is not None and claim.job_id == "j"
        reaped = store.reap(now=100.0 * crash + 10)  # the heartbeat expired
        assert [(r.worker, r.job_id) for r in reaped] == [(f"w{crash}", "j")]
        rec = store.get("j")
        assert rec is not None and rec["crashes"] == str(crash)
        if crash < 3:
            assert reaped[0].outcome == "requeued" and rec["state"] == "queued"
            assert store.queue_position("j") == 0
    assert reaped[0].outcome == "failed" and rec is not None and rec["state"] == "failed"
    assert store.queue_position("j") is None
    assert json.loads(store.events_after("j", 0)[0][1])["error"]["code"] == "worker_lost"


def test_a_live_worker_is_never_reaped(store: Store) -> None:
    store.enqueue("j", "completion", {}, 0, 1.0)
    store.workers.heartbeat("w", now=100.0, ttl=5)
    store.claim("w", 100.0)
    assert store.reap(now=104.0) == []
    rec = store.get("j")
    assert rec is not None and rec["state"] == "running"


def test_cancel_while_parking_ends_cancelled(store: Store) -> None:
    store.enqueue("j", "completion", {}, 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.r.hset(store.keys.worker("w"), "preempt", "1")
    step = store.step("j", claim.exec_token, "w", 1, 1, ["x"])
    assert step.flags == 2 and store.get("j")["state"] == "parking"  # type: ignore[index]
    assert store.cancel("j", 3.0) == "cancelling"
    assert store.park("j", claim.exec_token, "w", "{}", 4.0) == "cancelled"
    rec = store.get("j")
    assert rec is not None and rec["state"] == "cancelled" and "checkpoint" not in rec
    assert store.queue_position("j") is None


def test_park_requeues_with_the_original_score(store: Store) -> None:
    store.enqueue("old", "completion", {}, 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.enqueue("newer", "completion", {}, 0, 5.0)
    assert store.park("old", claim.exec_token, "w", '{"generated": []}', 6.0) == "parked"
    rec = store.get("old")
    assert rec is not None and rec["state"] == "parked" and rec["preemptions"] == "1"
    # Same level, earlier arrival: the parked job is still ahead of the newer one.
    assert store.queue_position("old") == 0 and store.queue_position("newer") == 1


def _parked_by_holder(store: Store, parked_at: float) -> None:
    """Job ``j``, claimed by ``holder`` at 10 s and parked at ``parked_at``
    (its KV kept there); ``other`` is alive too."""
    store.enqueue("j", "completion", {}, 0, 1.0)
    store.workers.heartbeat("holder", now=10.0, ttl=1000)
    store.workers.heartbeat("other", now=10.0, ttl=1000)
    claim = store.claim("holder", 10.0)
    assert claim is not None
    store.park("j", claim.exec_token, "holder", "{}", parked_at)


def test_a_parked_job_waits_for_its_checkpoint_holder_then_anyone_may_take_it(
    store: Store, settings: Settings
) -> None:
    _parked_by_holder(store, 11.0)
    soon = 11.0 + settings.affinity_seconds / 2
    assert store.claim("other", soon) is None  # left to the holder for a while
    late = 11.0 + settings.affinity_seconds + 0.1
    again = store.claim("other", late)
    assert again is not None and again.job_id == "j"
    assert (store.get("j") or {})["state"] == "running"  # the parked job, resumed elsewhere


def test_a_parked_job_that_ran_long_waits_for_its_holder_as_long_as_a_replay_would_take(
    store: Store, settings: Settings
) -> None:
    _parked_by_holder(store, 40.0)  # it ran 30 s
    assert store.claim("other", 40.0 + settings.affinity_seconds + 1) is None
    assert store.claim("other", 69.0) is None  # a replay would take about as long
    again = store.claim("other", 70.5)
    assert again is not None and again.job_id == "j"


def test_the_holder_takes_its_parked_job_back_at_once(store: Store) -> None:
    store.enqueue("j", "completion", {}, 0, 1.0)
    store.workers.heartbeat("holder", now=10.0, ttl=100)
    claim = store.claim("holder", 10.0)
    assert claim is not None
    store.park("j", claim.exec_token, "holder", "{}", 11.0)
    again = store.claim("holder", 11.01)
    assert again is not None and again.job_id == "j"


def test_a_worker_that_just_went_idle_is_not_counted_busy(store: Store) -> None:
    # Two workers run jobs; one of them parks between the two reads of runners().
    for name in ("a", "b"):
        store.workers.heartbeat(name, now=10.0, ttl=100)
    store.enqueue("low", "completion", {}, 0, 1.0)
    store.enqueue("high", "completion", {}, 5, 1.0)
    high = store.claim("a", 10.0)
    low = store.claim("b", 10.0)
    assert high is not None and low is not None and low.job_id == "low"
    real_pipeline = store.r.pipeline
    calls = {"n": 0}

    def pipeline(*args, **kwargs):  # b parks between the first and the second read
        calls["n"] += 1
        if calls["n"] == 2:
            store.park("low", low.exec_token, "b", "{}", 11.0)
        return real_pipeline(*args, **kwargs)

    store.r.pipeline = pipeline
    try:
        runners, idle, _, _ = store.runners(20.0)
    finally:
        store.r.pipeline = real_pipeline
    assert [r.job_id for r in runners] == ["high"]
    assert idle == 1


def test_a_job_whose_rq_function_is_not_parkqs_is_refused(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """Someone with Redis access queues an RQ job naming another function: the
    worker never runs it; RQ job data is JSON, never pickle."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    req = GenerationRequest("completion", "fake", list(b"hi"), 5, SamplingParams(temperature=0))
    rogue = Job.create(
        "os.system", args=("echo owned",), id="rogue", connection=fake_redis,
        serializer=JSONSerializer,
    )  # fmt: skip
    rogue.save()
    store.enqueue("rogue", "completion", req.to_json(), 10, time.time())
    _submit(store, rq, "good", b"fine")
    data = fake_redis.hget("rq:job:good", "data")
    assert data is not None  # zlib-compressed JSON (RQ's format), never a pickle
    # The name every parkq version has stored, whatever the module's path.
    assert json.loads(zlib.decompress(data))[0] == "jobs.rqjobs.generate"
    worker = Worker(settings, FakeEngine(), fake_redis, name="w1")
    with _running(worker):
        rogue_rec = _wait_state(store, "rogue", {"failed", "finished"})
        good = _wait_state(store, "good", {"failed", "finished"})
    assert rogue_rec["state"] == "failed" and rogue_rec["tokens"] == "0"
    assert json.loads(store.events_after("rogue", 0)[0][1])["error"]["code"] == "invalid_job"
    assert good["state"] == "finished"


def test_a_record_naming_parkqs_function_by_its_module_path_still_runs(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """parkq's function is known by its stored name and by where it lives now
    (jobs.store.rqjobs): a record naming either runs, neither is a rogue one."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    store = Store(fake_redis, settings)
    req = GenerationRequest("completion", "fake", list(b"new"), 5, SamplingParams(temperature=0))
    Job.create(
        "jobs.store.rqjobs.generate", args=("by-path",), id="by-path",
        connection=fake_redis, serializer=JSONSerializer,
    ).save()  # fmt: skip
    store.enqueue("by-path", "completion", req.to_json(), 10, time.time())
    worker = Worker(settings, FakeEngine(), fake_redis, name="w1")
    with _running(worker):
        rec = _wait_state(store, "by-path", {"failed", "finished"})
    assert rec["state"] == "finished" and rec["tokens"] == "5"


def _writes_for(
    fake_redis: fakeredis.FakeRedis, settings: Settings, interval: float
) -> tuple[int, list[str]]:
    """Run a 40-token job: the number of step writes it took, and its events."""
    settings = settings.model_copy(update={"write_interval_seconds": interval})
    store = Store(fake_redis, settings)
    worker = Worker(settings, FakeEngine(), fake_redis, name=f"w-{int(interval)}")
    writes: list[Any] = []
    steps = worker.store.steps  # a step's writes, all sequences' in one round trip
    worker.store.steps = lambda calls: writes.extend(calls) or steps(calls)  # type: ignore[method-assign]
    job_id = f"job-{int(interval)}"
    req = GenerationRequest("completion", "fake", list(b"go"), 40, SamplingParams(temperature=0))
    RQBridge(fake_redis, settings.queue_name, settings.result_ttl).create(job_id, "test")
    store.enqueue(job_id, "completion", req.to_json(), 10, time.time())
    with _running(worker):
        rec = _wait_state(store, job_id, {"finished", "failed"})
    assert rec["state"] == "finished" and rec["tokens"] == "40"
    events = store.events_after(job_id, 0)
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "[DONE]"
    return len(writes), [data.replace(job_id, "JOB") for _, data in events]


def test_fast_steps_share_writes_and_every_event_arrives_once(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    every_step, events = _writes_for(fake_redis, settings, 0.0)
    gathered, same = _writes_for(fake_redis, settings, 60.0)
    assert every_step >= 20  # about one write per step (a step may hold no event yet)
    assert gathered == 1  # the first event at once, the rest with the end
    assert same == events


class _PreemptOnFirstEval(FakeEngine):
    """Raises the worker's preempt flag at its first decode (inside the replay)."""

    def __init__(self, client: fakeredis.FakeRedis, flag_key: str) -> None:
        super().__init__()
        self.client, self.flag_key, self.armed = client, flag_key, True

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        if self.armed:
            self.armed = False
            self.client.hset(self.flag_key, "preempt", "1")
        return super().eval(tokens, pos, seq)


def _text(store: Store, job_id: str) -> str:
    return "".join(
        json.loads(data)["choices"][0]["text"]
        for _, data in store.events_after(job_id, 0)
        if data.startswith("{")
    )


def test_a_preemption_during_a_replay_never_leaves_the_job_parking(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    from jobs.worker.generation import Generation
    from jobs.worker.runner import PREEMPT, drive

    settings = settings.model_copy(update={"n_batch": 4, "write_interval_seconds": 0.0})
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    req = GenerationRequest("completion", "fake", list(b"replay me"), 21, SamplingParams())
    # A previous worker ran 20 of the 21 tokens and parked, its KV lost with it.
    rq.create("j", "test")
    store.enqueue("j", "completion", req.to_json(), 0, 1.0)
    claim = store.claim("old", 2.0)
    assert claim is not None
    engine = FakeEngine()
    gen = Generation("j", req, engine.token_bytes, engine.is_eog)

    def emit(payloads: list[str]) -> int:
        first = gen.events - len(payloads) + 1
        store.step("j", claim.exec_token, "old", len(gen.generated), first, payloads)
        return PREEMPT if len(gen.generated) == 20 else 0

    assert drive(engine, gen, emit, 4).state == "parked"
    assert store.park("j", claim.exec_token, "old", json.dumps(gen.state()), 3.0) == "parked"
    rq.create("ref", "test")  # the same request, uninterrupted, after it
    store.enqueue("ref", "completion", req.to_json(), -1, 4.0)
    # A new worker replays the 20 tokens and is asked to park during the replay;
    # the one token left would end the job right after it.
    flaky = _PreemptOnFirstEval(fake_redis, store.keys.worker("new"))
    worker = Worker(settings, flaky, fake_redis, name="new")
    with _running(worker):
        rec = _wait_state(store, "j", {"finished", "failed", "cancelled"})
        _wait_state(store, "ref", {"finished", "failed", "cancelled"})
    assert rec["state"] == "finished" and rec["tokens"] == "21"
    assert rec["preemptions"] == "2"  # the first park, and the one inside the replay
    assert _text(store, "j") == _text(store, "ref") != ""


class _SlowEngine(FakeEngine):
    """A slow model: 0.1 s per decode call."""

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        time.sleep(0.1)
        return super().eval(tokens, pos, seq)


def test_a_slow_replay_keeps_its_worker_alive(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    from jobs.worker.generation import Generation
    from jobs.worker.runner import PREEMPT, drive

    # A replay of 30 tokens at 0.1 s each, prefill chunks of 32: a heartbeat only
    # every chunk would leave 3 s between beats, past the 2 s TTL.
    settings = settings.model_copy(
        update={"n_batch": 32, "worker_ttl": 2.0, "heartbeat_seconds": 0.2}
    )
    store = Store(fake_redis, settings)
    req = GenerationRequest("completion", "fake", list(b"slow"), 32, SamplingParams())
    RQBridge(fake_redis, settings.queue_name, settings.result_ttl).create("slow", "test")
    store.enqueue("slow", "completion", req.to_json(), 0, 1.0)
    claim = store.claim("old", 2.0)
    assert claim is not None
    gen = Generation("slow", req, FakeEngine().token_bytes, FakeEngine().is_eog)
    drive(FakeEngine(), gen, lambda p: PREEMPT if len(gen.generated) == 30 else 0, 32)
    # Its events written, as a worker writes them before it parks.
    store.step("slow", claim.exec_token, "old", 30, 1, [f"e{i}" for i in range(1, gen.events + 1)])
    assert store.park("slow", claim.exec_token, "old", json.dumps(gen.state()), 3.0) == "parked"
    worker = Worker(settings, _SlowEngine(), fake_redis, name="slow-worker")
    thread = threading.Thread(target=worker.run)
    thread.start()
    reaped = []
    try:
        deadline = time.monotonic() + 30
        while (rec := store.get("slow")) and rec["state"] != "finished":
            assert time.monotonic() < deadline, rec
            reaped += [r.worker for r in Store(fake_redis, settings).reap(time.time())]
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(timeout=10)
    assert reaped == []  # never taken for dead while it replayed
    assert rec is not None and "crashes" not in rec


def test_a_job_whose_rq_record_was_deleted_still_runs(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """rq-dashboard's delete removes the RQ record; the RQ view never stops a job."""
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    _submit(store, rq, "orphan", b"still mine")
    fake_redis.delete("rq:job:orphan")
    worker = Worker(settings, FakeEngine(), fake_redis, name="w1")
    with _running(worker):
        rec = _wait_state(store, "orphan", {"failed", "finished"})
    assert rec["state"] == "finished" and rec["tokens"] == "5"
    assert fake_redis.llen(f"rq:queue:{settings.queue_name}") == 0


def test_a_redis_blip_between_claim_and_first_write_loses_nothing(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    _submit(store, rq, "blip", b"through a blip")
    worker = Worker(settings, FakeEngine(), fake_redis, name="w1")
    worker.store.get = _fails_once(worker.store.get)  # type: ignore[method-assign]
    worker.rq.fetch = _fails_once(worker.rq.fetch)  # type: ignore[method-assign]
    with _running(worker):
        rec = _wait_state(store, "blip", {"failed", "finished"})
    assert rec["state"] == "finished" and rec["tokens"] == "5"


class _StepEngine(FakeEngine):
    """20 ms per decode call: steps faster than a 0.2 s write interval."""

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        time.sleep(0.02)
        return super().eval(tokens, pos, seq)


def test_a_redis_blip_on_a_write_of_several_steps_loses_none_of_them(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """Steps faster than the write interval share one write; that write, retried
    after a blip, still carries every one of them, numbered in order."""
    settings = settings.model_copy(update={"write_interval_seconds": 0.2})
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    req = GenerationRequest("completion", "fake", list(b"steps"), 40, SamplingParams(temperature=0))
    for job_id in ("clean", "gather"):
        rq.create(job_id, "test")
    store.enqueue("clean", "completion", req.to_json(), 10, time.time())
    with _running(Worker(settings, _StepEngine(), fake_redis, name="w0")):
        _wait_state(store, "clean", {"finished"})
    store.enqueue("gather", "completion", req.to_json(), 10, time.time())
    worker = Worker(settings, _StepEngine(), fake_redis, name="w1")
    steps, blips = worker.store.steps, list[int]()

    def blip_on_a_gathered_write(calls: list[StepCall]) -> Any:
        gathered = [len(c.payloads) for c in calls if len(c.payloads) > 1]
        if gathered and not blips:  # payloads of several steps
            blips.append(gathered[0])
            raise redis.ConnectionError("Connection reset by peer")
        return steps(calls)

    worker.store.steps = blip_on_a_gathered_write  # type: ignore[method-assign]
    with _running(worker):
        rec = _wait_state(store, "gather", {"failed", "finished"})
    assert blips, "no write gathered several steps"
    events = store.events_after("gather", 0)
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    assert rec["tokens"] == "40"
    assert _text(store, "gather") == _text(store, "clean")


def test_a_parked_job_held_by_a_busy_worker_does_not_make_others_park(
    store: Store, settings: Settings
) -> None:
    """No ping-pong: a waiting job that only its checkpoint holder may take (for the
    affinity window) must not make another worker park its own job, which that
    worker would then claim straight back."""
    for name in ("holder", "other"):
        store.workers.heartbeat(name, now=10.0, ttl=1000)
    store.enqueue("a", "completion", {}, 5, 1.0)
    claim_a = store.claim("holder", 10.0)
    assert claim_a is not None
    store.enqueue("c", "completion", {}, 9, 11.0)  # more urgent: it will run on the holder
    store.park("a", claim_a.exec_token, "holder", "{}", 12.0)
    assert store.claim("holder", 12.0).job_id == "c"  # type: ignore[union-attr]
    store.enqueue("b", "completion", {}, 0, 2.0)  # low: it runs on the other worker
    assert store.claim("other", 12.0).job_id == "b"  # type: ignore[union-attr]
    # The head of the queue is a, which beats b, but only the holder may take it now.
    assert store.maybe_preempt(12.5) is None
    store.workers.heartbeat("idle", now=12.5, ttl=1)  # a free sequence, gone by 13.5
    assert store.claim("idle", 12.5) is None
    # Once the affinity window has passed, anyone may take a: b's worker is the victim.
    assert store.maybe_preempt(12.0 + settings.affinity_seconds + 1) == "other"


def test_a_worker_that_stalled_past_its_ttl_does_not_reap_itself(store: Store) -> None:
    """A worker frozen past its TTL (a long GC pause, a starved CPU) that beats again
    is alive: its own beat must not requeue its job and forget it in RQ; other
    workers may reap it meanwhile (the fencing covers that)."""
    store.enqueue("j", "completion", {}, 0, 1.0)
    store.workers.heartbeat("slowpoke", now=10.0, ttl=3)
    claim = store.claim("slowpoke", 10.0)
    assert claim is not None
    assert store.reap(now=20.0, me="slowpoke") == []  # its own beat, 7 s late
    rec = store.get("j")
    assert rec is not None and rec["state"] == "running"
    assert f"{rec['exec']}.{rec['nonce']}" == claim.exec_token
    reaped = store.reap(now=20.0)  # anyone else: dead
    assert [(r.worker, r.job_id, r.outcome) for r in reaped] == [("slowpoke", "j", "requeued")]


def test_a_worker_deletes_the_jobs_index_earlier_versions_left(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    fake_redis.zadd("{parkq}:jobs", {"old-job": 1.0})  # written, never read, never trimmed
    worker = Worker(settings, FakeEngine(), fake_redis, name="w1")
    with _running(worker):
        deadline = time.monotonic() + 20
        while fake_redis.exists("{parkq}:jobs"):
            assert time.monotonic() < deadline
            time.sleep(0.01)


class _TwoSequences(FakeEngine):
    """Two sequences with a context each, 5 ms a call; logs each call as
    ``(kind, sequences)``."""

    n_seq_max = 2

    def __init__(self) -> None:
        super().__init__()
        self.contexts: dict[int, list[int]] = {0: [], 1: []}
        self.log: list[tuple[str, tuple[int, ...]]] = []

    def clear(self, seq: int = 0) -> None:
        self.contexts[seq] = []

    def truncate(self, pos: int, seq: int = 0) -> None:
        del self.contexts[seq][pos:]

    def save_seq(self, seq: int = 0) -> bytes:
        return bytes(json.dumps(self.contexts[seq]), "ascii")

    def load_seq(self, data: bytes | memoryview, seq: int = 0) -> None:
        self.contexts[seq] = json.loads(bytes(data))

    def decode(self, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        self.log.append(("decode", tuple(seq for seq, _, _ in steps)))
        return [self._eval([token], pos, seq) for seq, token, pos in steps]

    def prefill(self, chunks: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        self.log.append(("prefill", tuple(seq for seq, _, _ in chunks)))
        return [self._eval(tokens, pos, seq) for seq, tokens, pos in chunks]

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        self.log.append(("prefill" if len(tokens) > 1 else "decode", (seq,)))
        return self._eval(tokens, pos, seq)

    def _eval(self, tokens: Sequence[int], pos: int, seq: int) -> np.ndarray:
        time.sleep(0.005)
        self.context = self.contexts[seq]
        return super().eval(tokens, pos, seq)


def test_a_person_who_arrives_while_another_decodes_gets_the_first_token_first(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """An interactive prompt that joins a decoding sequence is prefilled before
    that step's decode, not after it: the newcomer's first token does not wait
    for the other's next one (issue 34: time to first token at 8 people)."""
    settings = settings.model_copy(update={"max_seqs": 2})
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    engine = _TwoSequences()
    long = GenerationRequest("completion", "fake", list(b"long one"), 200,
                             SamplingParams(temperature=0), ignore_eos=True)  # fmt: skip
    short = GenerationRequest("completion", "fake", list(b"hello"), 5,
                              SamplingParams(temperature=0), ignore_eos=True)  # fmt: skip
    rq.create("long", "test")
    store.enqueue("long", "completion", long.to_json(), 10, time.time())
    with _running(Worker(settings, engine, fake_redis, name="w0")):
        deadline = time.monotonic() + 20
        while int((store.get("long") or {}).get("tokens", 0)) < 5:
            assert time.monotonic() < deadline, "the long job never decoded"
            time.sleep(0.01)
        rq.create("short", "test")
        store.enqueue("short", "completion", short.to_json(), 10, time.time())
        _wait_state(store, "short", {"finished"})
        _wait_state(store, "long", {"finished"})
    prompts = [i for i, (kind, _) in enumerate(engine.log) if kind == "prefill"]
    assert len(prompts) == 2, engine.log  # each prompt in one chunk
    joined = prompts[1]
    (newcomer,) = engine.log[joined][1]
    (other,) = engine.log[0][1]
    # Right before the newcomer's prompt: the other's decode of the step before;
    # right after it: the other's decode of this step, alone; then both together.
    assert engine.log[joined - 1] == ("decode", (other,))
    assert engine.log[joined + 1] == ("decode", (other,))
    assert set(engine.log[joined + 2][1]) == {other, newcomer}


def _request(prompt: bytes, tokens: int) -> dict[str, Any]:
    return GenerationRequest("completion", "fake", list(prompt), tokens,
                             SamplingParams(temperature=0), ignore_eos=True).to_json()  # fmt: skip


def _counting_claims(worker: Worker) -> list[int]:
    claims = [0]
    real_claim = worker.store.claim

    def counted(*args: Any, **kwargs: Any) -> Any:
        claims[0] += 1
        return real_claim(*args, **kwargs)

    worker.store.claim = counted  # type: ignore[method-assign]
    return claims


def _tokens(store: Store, job_id: str) -> int:
    return int((store.get(job_id) or {}).get("tokens", 0))


def _decoding(store: Store, job_id: str, tokens: int) -> None:
    deadline = time.monotonic() + 30
    while _tokens(store, job_id) < tokens:
        assert time.monotonic() < deadline, f"{job_id} never decoded {tokens} tokens"
        time.sleep(0.01)


def _state(store: Store, job_id: str) -> str:
    return (store.get(job_id) or {}).get("state", "")


def test_a_head_the_worker_may_not_take_is_not_claimed_at_every_step(
    fake_redis: fakeredis.FakeRedis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free sequence behind a waiting job it may not take (here a parked job
    left to its holder) claims again when the head changes or a job arrives,
    not at every step write that sees the same queue."""
    import jobs.worker.loop as loop

    # No claim by the clock while the long job runs: only what the step writes see.
    monkeypatch.setattr(loop, "CLAIM_SECONDS", 60.0)
    monkeypatch.setattr(loop, "CLAIM_BACKSTOP_SECONDS", 120.0)
    settings = settings.model_copy(update={"max_seqs": 2, "affinity_seconds": 3600})
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    now = time.time()
    store.workers.heartbeat("holder", now=now, ttl=3600)
    store.enqueue("held", "completion", {}, 9, now)
    claim = store.claim("holder", now)
    assert claim is not None
    store.park("held", claim.exec_token, "holder", "{}", now)
    rq.create("long", "test")
    store.enqueue("long", "completion", _request(b"long one", 1_000_000), 5, time.time())
    worker = Worker(settings, _TwoSequences(), fake_redis, name="w0")
    claims = _counting_claims(worker)
    with _running(worker):
        _decoding(store, "long", 150)
        # The long job's claim, the free sequence's, and one at the first step
        # write that saw the held job at the head; none at the 150 steps after.
        assert claims[0] <= 3, claims
        # A job behind the head (a worse key: the head stays): the queue grew.
        # Then one ahead of it: the head changed.
        for job_id, level in (("behind", 0), ("ahead", 10)):
            rq.create(job_id, "test")
            store.enqueue(job_id, "completion", _request(job_id.encode(), 3), level, time.time())
            _wait_state(store, job_id, {"finished"})
        assert _state(store, "long") == "running"
        assert _state(store, "held") == "parked"


class _ThreeSequences(_TwoSequences):
    n_seq_max = 3

    def __init__(self) -> None:
        super().__init__()
        self.contexts[2] = []


def test_a_capped_tenants_next_job_starts_when_its_running_one_ends_here(
    fake_redis: fakeredis.FakeRedis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant capped at one running job: its next job, passed over at the head,
    starts on this worker as soon as the running one ends here (no step write
    sees a change of the queue: the same head, the same length)."""
    import jobs.worker.loop as loop

    monkeypatch.setattr(loop, "CLAIM_SECONDS", 60.0)
    monkeypatch.setattr(loop, "CLAIM_BACKSTOP_SECONDS", 120.0)
    settings = settings.model_copy(update={"max_seqs": 3})
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    rq.create("long", "test")
    store.enqueue("long", "completion", _request(b"long one", 1_000_000), 0, time.time())
    for job_id, tokens in (("first", 40), ("second", 3)):
        rq.create(job_id, "test")
        store.enqueue(job_id, "completion", _request(job_id.encode(), tokens), 10, time.time(),
                      owner="capped", extra={"max_running": "1"}, weight=1.0,
                      caps=True)  # fmt: skip
    worker = Worker(settings, _ThreeSequences(), fake_redis, name="w0")
    claims = _counting_claims(worker)
    with _running(worker):
        _wait_state(store, "second", {"finished"})
        assert _state(store, "long") == "running"
    first, second = store.get("first") or {}, store.get("second") or {}
    assert float(second["started_at"]) >= float(first["finished_at"])  # the cap held
    assert claims[0] <= 6, claims  # not one at each of the first job's 40 steps
