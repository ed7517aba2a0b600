import fakeredis
import pytest

from jobs.store.events import DONE
from jobs.store.identity import ModelIdentity
from jobs.store.scheduling import Diverged, Fenced, JobEnded, Lost, Step, StepCall, Store
from scheduler.settings import Settings
from scheduler.state import JobState


def _enqueue(store: Store, job_id: str, level: int, at: float) -> None:
    assert store.enqueue(job_id, "completion", {"x": 1}, level, at)


def test_claim_takes_highest_priority_then_oldest(store: Store) -> None:
    _enqueue(store, "batch", 0, 100.0)
    _enqueue(store, "late", 10, 102.0)
    _enqueue(store, "early", 10, 101.0)
    order = [store.claim(f"w{i}", 200.0).job_id for i in range(3)]  # type: ignore[union-attr]
    assert order == ["early", "late", "batch"]
    assert store.claim("w3", 200.0) is None


def test_a_claim_first_requeues_a_job_its_sequence_no_longer_runs(store: Store) -> None:
    """Redis still records job a on sequence w (its end was lost in a failover),
    and w, free, claims: a goes back to the queue, fenced, no crash counted,
    and w gets the best job, a itself if it is."""
    _enqueue(store, "a", 10, 1.0)
    _enqueue(store, "b", 0, 2.0)
    first = store.claim("w", 3.0)
    assert first is not None and first.job_id == "a"
    again = store.claim("w", 4.0)
    assert again is not None and again.job_id == "a"
    assert again.exec_token != first.exec_token  # the lost execution is fenced
    record = store.get("a") or {}
    assert record["state"] == "running" and int(record.get("crashes", 0)) == 0
    with pytest.raises(Fenced):
        store.step("a", first.exec_token, "w", 1, 1, ["x"])


def test_enqueue_refuses_a_taken_id(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    assert not store.enqueue("a", "completion", {}, 0, 2.0)


def test_claim_marks_running_with_a_fresh_execution_token(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    claim = store.claim("w1", 5.0)
    assert claim is not None and claim.job_id == "a"
    rec = store.get("a")
    assert rec is not None
    assert rec["state"] == "running" and rec["worker"] == "w1"
    assert f"{rec['exec']}.{rec['nonce']}" == claim.exec_token


def test_step_appends_numbered_events_and_reports_cancel(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    assert store.step("a", claim.exec_token, "w", 1, 1, ["one"]).flags == 0
    assert store.step("a", claim.exec_token, "w", 2, 2, ["two", "three"]).flags == 0
    assert store.events_after("a", 0) == [(1, "one"), (2, "two"), (3, "three")]
    assert store.events_after("a", 2) == [(3, "three")]
    assert store.cancel("a", 3.0) == "cancelling"
    assert store.step("a", claim.exec_token, "w", 2, 4, []).flags & 1


def test_replayed_events_are_written_once(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.step("a", claim.exec_token, "w", 2, 1, ["one", "two"])
    # A replay re-creates events 1 and 2, then makes new ones.
    store.step("a", claim.exec_token, "w", 1, 1, ["one"])
    store.step("a", claim.exec_token, "w", 3, 2, ["two", "three"])
    assert store.events_after("a", 0) == [(1, "one"), (2, "two"), (3, "three")]


def test_a_stale_execution_cannot_write(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    with pytest.raises(Fenced):
        store.step("a", "999", "w", 1, 1, ["x"])
    assert store.events_after("a", 0) == []


def test_cancel_queued_job_ends_its_stream_and_it_never_runs(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    assert store.cancel("a", 2.0) == "cancelled"
    assert store.claim("w", 3.0) is None
    events = store.events_after("a", 0)
    assert '"job_cancelled"' in events[0][1] and events[-1] == (2, DONE)
    with pytest.raises(JobEnded) as ended:
        store.cancel("a", 4.0)
    assert ended.value.state is JobState.CANCELLED
    assert store.cancel("nope", 4.0) is None


def test_finish_sets_terminal_state_and_last_events(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.finish(
        "a", claim.exec_token, "w", JobState.FINISHED, {"finish_reason": "stop"}, 1, [DONE], 3.0
    )
    rec = store.get("a")
    assert rec is not None and rec["state"] == "finished" and rec["finish_reason"] == "stop"
    assert store.events_after("a", 0) == [(1, DONE)]


def _model(name: str, digest: str) -> ModelIdentity:
    return ModelIdentity(name, digest * 64, 2048, 600, "v" * 64)


def test_a_job_is_claimed_only_by_a_worker_serving_its_model(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    web_a = Store(fake_redis, settings, _model("a", "a"))
    web_b = Store(fake_redis, settings, _model("b", "b"))
    worker_a = Store(fake_redis, settings, _model("a", "a"))
    _enqueue(web_a, "for-a", 10, 1.0)  # the best job, but not for model b
    _enqueue(web_b, "for-b", 0, 2.0)
    claim = Store(fake_redis, settings, _model("b", "b")).claim("wb", 5.0)
    assert claim is not None and claim.job_id == "for-b"
    assert Store(fake_redis, settings, _model("b", "b")).claim("wb2", 6.0) is None
    rec = web_a.get("for-a")
    assert rec is not None and rec["state"] == "queued"  # left for a worker serving a
    claim = worker_a.claim("wa", 7.0)
    assert claim is not None and claim.job_id == "for-a"


def _b_runs_a_long_job(fake_redis: fakeredis.FakeRedis, settings: Settings) -> None:
    """Worker ``wb`` (model b) runs ``long-b``, a batch job queued at 1 s."""
    worker_b = Store(fake_redis, settings, _model("b", "b"))
    worker_b.workers.heartbeat("wb", now=1.0, ttl=1000)
    _enqueue(worker_b, "long-b", 0, 1.0)
    assert worker_b.claim("wb", 2.0) is not None


def test_preemption_considers_only_workers_serving_the_jobs_model(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    _b_runs_a_long_job(fake_redis, settings)
    web_a = Store(fake_redis, settings, _model("a", "a"))
    _enqueue(web_a, "urgent-a", 10, 500.0)
    # wb runs the lowest-key job, long past its minimum run time, but it could
    # not run the waiting job: parking it would only cost it work.
    assert web_a.maybe_preempt(500.0) is None
    web_b = Store(fake_redis, settings, _model("b", "b"))
    # Jobs only model a can run never park wb, whoever asks.
    assert web_b.maybe_preempt(500.0) is None
    _enqueue(web_b, "urgent-b", 10, 500.0)
    assert web_b.maybe_preempt(500.0) == "wb"


def test_a_job_that_moves_to_another_device_is_counted_and_named(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    cpu = ModelIdentity("m", "d" * 64, 2048, 600, "v" * 64, device="CPU")
    gpu = ModelIdentity("m", "d" * 64, 2048, 600, "v" * 64, device="CUDA0 (NVIDIA H200)")
    on_cpu, on_gpu = Store(fake_redis, settings, cpu), Store(fake_redis, settings, gpu)
    _enqueue(on_cpu, "j", 0, 1.0)
    claim = on_cpu.claim("w-cpu", 2.0)
    assert claim is not None and claim.moved_from is None
    assert on_cpu.park("j", claim.exec_token, "w-cpu", '{"generated": []}', 3.0) == "parked"
    # Resumed on the same device: no move.
    again = on_cpu.claim("w-cpu", 4.0)
    assert again is not None and again.moved_from is None
    assert on_cpu.park("j", again.exec_token, "w-cpu", '{"generated": []}', 5.0) == "parked"
    moved = on_gpu.claim("w-gpu", 100.0)  # past the holder's affinity
    assert moved is not None and moved.moved_from == "CPU"
    rec = on_gpu.get("j")
    assert rec is not None
    assert rec["device"] == "CUDA0 (NVIDIA H200)" and rec["device_moves"] == "1"


def test_the_steps_of_several_jobs_go_in_one_round_trip_and_a_stale_one_is_fenced(
    store: Store,
) -> None:
    claims = {}
    for job_id in ("a", "b", "c"):
        _enqueue(store, job_id, 0, 1.0)
        claim = store.claim(f"w-{job_id}", 2.0)
        assert claim is not None and claim.job_id == job_id
        claims[job_id] = claim
    calls = [
        StepCall("a", claims["a"].exec_token, "w-a", 1, 1, ["a1"]),
        StepCall("b", "stale", "w-b", 1, 1, ["b1"]),
        StepCall("c", claims["c"].exec_token, "w-c", 2, 1, ["c1", "c2"]),
    ]
    got = store.steps(calls)
    assert isinstance(got[0], Step) and got[0].flags == 0
    assert isinstance(got[1], Fenced)
    assert isinstance(got[2], Step)
    assert store.events_after("a", 0) == [(1, "a1")]
    assert store.events_after("b", 0) == []  # nothing written for a stale execution
    assert store.events_after("c", 0) == [(1, "c1"), (2, "c2")]
    # Repeated (a retry after a lost reply): nothing twice, not even in the
    # inter-token histogram; and after Redis lost its scripts (a restart).
    timed = [StepCall("a", claims["a"].exec_token, "w-a", 2, 2, ["a2"], 12.0)]
    store.steps(timed)
    store.r.script_flush()
    store.steps(timed)
    assert store.events_after("a", 0) == [(1, "a1"), (2, "a2")]
    assert store.telemetry.histogram("inter_token_ms")["count"] == 1
    store.steps(calls)
    assert store.events_after("c", 0) == [(1, "c1"), (2, "c2")]


def test_a_claim_reads_past_any_number_of_jobs_it_may_not_take(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    web_a = Store(fake_redis, settings, _model("a", "a"))
    for i in range(150):  # more than two pages of another model's jobs, all better
        _enqueue(web_a, f"for-a-{i}", 10, 1.0 + i)
    web_b = Store(fake_redis, settings, _model("b", "b"))
    _enqueue(web_b, "for-b", 0, 500.0)
    claim = Store(fake_redis, settings, _model("b", "b")).claim("wb", 600.0)
    assert claim is not None and claim.job_id == "for-b"


def test_preemption_reads_past_jobs_no_runner_may_take(
    fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    _b_runs_a_long_job(fake_redis, settings)
    web_a = Store(fake_redis, settings, _model("a", "a"))
    for i in range(100):
        _enqueue(web_a, f"urgent-a-{i}", 10, 300.0 + i)
    web_b = Store(fake_redis, settings, _model("b", "b"))
    # Jobs only model a can run never park wb, whoever asks.
    assert web_b.maybe_preempt(500.0) is None
    _enqueue(web_b, "urgent-b", 10, 500.0)
    assert web_b.maybe_preempt(500.0) == "wb"


def test_a_hand_back_requeues_only_the_named_sequence_and_counts_no_redis_crash(
    store: Store,
) -> None:
    """A worker hands one sequence's job back after a Redis outage longer than its
    TTL: its other sequence's job, whose heartbeat aged out too, keeps running."""
    _enqueue(store, "a", 0, 1.0)
    _enqueue(store, "b", 0, 1.5)
    store.workers.heartbeat("w", now=1.0, ttl=3, proc="w")
    store.workers.heartbeat("w/1", now=1.0, ttl=3, proc="w")
    first, second = store.claim("w", 2.0, "w"), store.claim("w/1", 2.0, "w")
    assert first is not None and second is not None
    store.workers.retire("w/1")
    reaped = store.reap(100.0, "w", only=["w/1"], crash=False)
    assert [(r.worker, r.job_id) for r in reaped] == [("w/1", second.job_id)]
    assert (store.get(first.job_id) or {})["state"] == "running"
    back = store.get(second.job_id) or {}
    assert back["state"] == "queued" and back.get("crashes", "0") == "0"


def test_a_replayed_event_that_differs_is_never_spliced(store: Store) -> None:
    _enqueue(store, "a", 0, 1.0)
    store.workers.heartbeat("w", now=1.0, ttl=100)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.step("a", claim.exec_token, "w", 3, 1, ["one", "two", "three"])
    # A replay (another execution) re-creates the same first two events: skipped.
    store.workers.retire("w")
    store.reap(10.0)
    again = store.claim("w2", 11.0)
    assert again is not None
    store.step("a", again.exec_token, "w2", 2, 1, ["one", "two"])
    # Its third differs from the stored one: refused, nothing from it on written.
    with pytest.raises(Diverged) as caught:
        store.step("a", again.exec_token, "w2", 4, 3, ["THREE", "four"])
    assert caught.value.seq == 3
    assert [d for _, d in store.events_after("a", 0)] == ["one", "two", "three"]
    with pytest.raises(Diverged):
        store.finish("a", again.exec_token, "w2", JobState.FINISHED, {}, 3, ["THREE", DONE], 12.0)


def test_events_lost_in_a_failover_are_noticed_never_skipped_over(store: Store) -> None:
    """The primary took events 1-5, the replica that replaced it had only 1-3:
    the next step (6 on) writes nothing and says so (:class:`Lost`), so the job
    is replayed instead of its stream going on with a hole; the finish too."""
    _enqueue(store, "a", 0, 1.0)
    store.workers.heartbeat("w", now=1.0, ttl=100)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.step("a", claim.exec_token, "w", 5, 1, ["1", "2", "3", "4", "5"])
    # What the replica had: three events.
    events = store.keys.events("a")
    store.r.delete(events)
    for i in (1, 2, 3):
        store.r.xadd(events, {"d": str(i)}, id=f"{i}-0")
    store.r.hset(store.keys.job("a"), "seq", 3)
    with pytest.raises(Lost) as caught:
        store.step("a", claim.exec_token, "w", 6, 6, ["6"])
    assert caught.value.have == 3
    [result] = store.steps([StepCall("a", claim.exec_token, "w", 6, 6, ["6"])])
    assert isinstance(result, Lost)
    with pytest.raises(Lost):
        store.finish("a", claim.exec_token, "w", JobState.FINISHED, {}, 6, ["6", DONE], 3.0)
    assert [d for _, d in store.events_after("a", 0)] == ["1", "2", "3"]
    assert store.get("a")["state"] == "running"  # type: ignore[index]
    # A replay writes 4 and 5 again (compared where stored), then goes on.
    store.step("a", claim.exec_token, "w", 6, 1, ["1", "2", "3", "4", "5", "6"])
    assert [d for _, d in store.events_after("a", 0)] == ["1", "2", "3", "4", "5", "6"]


def test_a_park_whose_checkpoint_is_ahead_of_the_stream_is_refused(store: Store) -> None:
    """A step's events were lost in a failover, then the job was asked to park:
    its checkpoint counts 5 events, the stream holds 3. The park writes nothing
    (:class:`Lost`), so no resume can start from a checkpoint ahead of the stream."""
    _enqueue(store, "a", 0, 1.0)
    store.workers.heartbeat("w", now=1.0, ttl=100)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.step("a", claim.exec_token, "w", 3, 1, ["1", "2", "3"])
    with pytest.raises(Lost):
        store.park("a", claim.exec_token, "w", '{"events": 5}', 3.0)
    assert (store.get("a") or {})["state"] == "running"
    assert store.park("a", claim.exec_token, "w", '{"events": 3}', 3.0) == "parked"


def test_a_step_reads_the_queue_head_once_and_says_what_it_added(store: Store) -> None:
    """Several jobs' writes of one step: the first reads the queue head and
    length, every job gets them, even when that first write was fenced; each
    says how many events it added (a replay's events already stored: none)."""
    for job_id in ("a", "b"):
        _enqueue(store, job_id, 0, 1.0)
    store.workers.heartbeat("w1", now=1.0, ttl=100)
    store.workers.heartbeat("w2", now=1.0, ttl=100)
    a, b = store.claim("w1", 2.0), store.claim("w2", 2.0)
    assert a is not None and b is not None
    _enqueue(store, "waiting", 10, 3.0)
    calls = [StepCall(a.job_id, a.exec_token, "w1", 1, 1, ["x"]),
             StepCall(b.job_id, b.exec_token, "w2", 1, 1, ["y"])]  # fmt: skip
    first, second = store.steps(calls)
    assert isinstance(first, Step) and isinstance(second, Step)
    assert first.head_key is not None and second.head_key == first.head_key
    assert first.queued == second.queued == 1
    assert (first.written, second.written) == (1, 1)
    # Replayed (already stored): nothing added.
    [again] = store.steps([StepCall(a.job_id, a.exec_token, "w1", 1, 1, ["x"])])
    assert isinstance(again, Step) and again.written == 0
    # The first write fenced: the others still get the head.
    stale = StepCall(a.job_id, "stale", "w1", 2, 2, ["x2"])
    fenced, ok = store.steps([stale, StepCall(b.job_id, b.exec_token, "w2", 2, 2, ["y2"])])
    assert isinstance(fenced, Fenced)
    assert isinstance(ok, Step) and ok.head_key == first.head_key
    _enqueue(store, "later", 0, 4.0)
    fenced, ok = store.steps([stale, StepCall(b.job_id, b.exec_token, "w2", 3, 3, ["y3"])])
    assert isinstance(ok, Step) and ok.head_key == first.head_key and ok.queued == 2


def test_a_claim_lost_in_a_failover_never_hands_out_the_same_token_again(store: Store) -> None:
    """Worker w1's claim is lost (the replica had the job queued, its execution
    counter one lower); w2 claims it and counts to the same number: the tokens
    still differ, so w1's writes are fenced, never interleaved with w2's."""
    _enqueue(store, "a", 0, 1.0)
    store.workers.heartbeat("w1", now=1.0, ttl=100)
    first = store.claim("w1", 2.0)
    assert first is not None
    # What the new primary holds: the job as it was before that claim.
    key = store.keys.job("a")
    store.r.hset(key, mapping={"state": "queued", "exec": 0})
    store.r.zadd(store.keys.queue, {"a": float(store.r.hget(key, "score") or 0)})
    store.workers.heartbeat("w2", now=3.0, ttl=100)
    second = store.claim("w2", 3.0)
    assert second is not None and second.job_id == "a"
    assert first.exec_token.split(".")[0] == second.exec_token.split(".")[0]  # same count
    assert first.exec_token != second.exec_token
    with pytest.raises(Fenced):
        store.step("a", first.exec_token, "w1", 1, 1, ["from w1"])
    store.step("a", second.exec_token, "w2", 1, 1, ["from w2"])
    assert [d for _, d in store.events_after("a", 0)] == ["from w2"]
