"""One claimed job on a worker: claim -> plan -> drive -> apply.

:class:`Executions` (the part of :class:`jobs.worker.loop.Worker` that runs a job)
reads the claimed job (a :class:`Job`), plans where its KV comes from (a
:class:`jobs.worker.runner.Start`), drives its generation (each step's events
gathered into writes by a :class:`StepWriter`, the flags read back steering
it) and applies the outcome: finished, cancelled or parked. The worker
(``loop.py``) owns the loop, the sequences' steps and liveness.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from jobs.engine.llama import Engine, EngineError
from jobs.engine.request import GenerationRequest
from jobs.store.events import DONE, error_event
from jobs.store.faults import MOVED_PRIMARY, TRANSIENT, error_code
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import (
    CANCEL_EVENTS,
    Claim,
    Diverged,
    Fenced,
    Parked,
    Step,
    StepCall,
    Store,
    TransitionRefused,
)
from jobs.store.telemetry import Telemetry, bucket_of
from jobs.worker.generation import Generation
from jobs.worker.runner import (
    CANCEL,
    PREEMPT,
    Deferred,
    Eval,
    Outcome,
    Source,
    Start,
    Yielded,
    generate,
)
from jobs.worker.sequences import Sequences
from scheduler.policy import PRIORITY_LEVELS, priority_label
from scheduler.settings import Settings
from scheduler.state import JobState

__all__ = ["TRANSIENT", "WAIT", "Executions", "Job", "Running", "Slot", "StepWriter", "Write"]

T = TypeVar("T")

log = logging.getLogger(__name__)


#: How often, at most, a worker process's steps ask whether a tenant under its
#: share of the sequences should park one of a tenant over it (scheduler/fairness.py).
SHARES_SECONDS = 1.0
#: Fenced writes (steps, parks, finishes) through a Redis restart: back-off
#: from 0.2 s to 2 s, about a minute in all.
WRITE_RETRY = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=32, supported_errors=TRANSIENT)
#: How a job's log line tells where its KV came from.
_STARTS = {
    Source.FRESH: "fresh",
    Source.CHECKPOINT: "from its checkpoint",
    Source.IN_PLACE: "from its KV, kept in place",
    Source.REPLAY: "replaying",
    Source.PREFIX: "{keep} prompt tokens cached",
    Source.SIBLING: "the prompt computed by a sibling choice",
}


@dataclass(frozen=True)
class Slot:
    """One place to run a generation: a worker of its own to the scheduler."""

    name: str
    index: int


#: The engine call of a choice waiting for a sibling's prefill on this worker:
#: none; it is asked again after the next step.
WAIT = Eval([], 0)
NOTHING = np.empty(0, dtype=np.float32)


@dataclass
class Running:
    """A generation in progress on a slot, and the engine call it waits for."""

    slot: Slot
    job_id: str
    #: The engine sequence holding its KV (chosen once the job is read).
    seq: int = -1
    run: Generator[Yielded, Any, None] | None = None
    #: Its next engine call; between the engine call and the step's writes,
    #: its deferred step write (the worker makes them all in one round trip).
    call: Yielded = field(default_factory=lambda: Eval([], 0))
    #: Its job's ordering key and whether it is interactive (set once read).
    key: float = 0.0
    interactive: bool = False
    #: Steps since it was last served.
    waited: int = 0
    #: Parked in place: its sequence now holds a parked job's KV.
    kept: bool = False
    #: The request (response id) whose prompt it is prefilling for its siblings.
    sharing: str = ""

    def send(self, result: np.ndarray | EngineError | int | Exception) -> None:
        """Resume the generation with its engine call's logits (or the engine's
        error), or its deferred write's flags (or the write's failure)."""
        assert self.run is not None
        if isinstance(result, Exception):
            self.call = self.run.throw(result)
        else:
            self.call = self.run.send(result)

    @property
    def engine_call(self) -> Eval:
        """Its next engine call (no deferred write is pending)."""
        assert isinstance(self.call, Eval), "a deferred write is pending"
        return self.call


@dataclass
class Job:
    """A claimed job as read from its record."""

    #: The name of the slot (a worker to the scheduler) running it.
    slot: str
    claim: Claim
    request: GenerationRequest
    gen: Generation
    #: Its priority level and ordering key (higher runs first).
    level: int
    key: float
    created_at: float
    #: When its client's stream readers all left (None: one reads, or never read).
    detached_at: float | None
    #: A parked or moved job continuing.
    resumed: bool
    #: The execution that wrote its checkpoint (a kept KV must be of it).
    ckpt_exec: str | None = None
    claimed_at: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)
    #: Its client left for longer than the grace period: it is cancelled.
    client_gone: bool = False
    #: The queue head it last asked a preemption for, and when.
    checked_head: float | None = None
    checked_at: float = 0.0

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    @property
    def interactive(self) -> bool:
        return self.level > PRIORITY_LEVELS["batch"]


class StepWrite(Deferred):
    """A job's step write, deferred to the worker (which makes all of a step's
    writes in one round trip), and what turns its :class:`Step` into flags."""

    def __init__(self, call: StepCall, control: Callable[[Step], int]) -> None:
        self.call = call
        self.control = control


@dataclass(frozen=True)
class Write:
    """One write of a job's events: ``payloads`` numbered from ``first``, and
    the time since the previous token (ms, per event) for the histogram."""

    payloads: list[str]
    first: int
    latency_ms: float | None


class StepWriter:
    """Gathers a job's events into writes: one per step, or one per write
    interval when steps are faster. Tokens of steps faster than the interval
    wait for one write: a Redis round trip per 0.2 ms step would cost more than
    the step, and on a busy machine each one waits for a time slice.
    """

    def __init__(self, job: Job, settings: Settings, observe: Callable[[str, float], None]) -> None:
        self.job = job
        self.settings = settings
        self._observe = observe
        #: Payloads produced but not written yet.
        self.unwritten: list[str] = []
        self._write_at = 0.0
        self._last_event_at = 0.0

    def take(self, payloads: list[str], now_due: bool) -> Write | None:
        """The write due now with ``payloads`` (and those waiting), or None:
        they wait for a later one. Observes the time to first token."""
        if not now_due and time.monotonic() < self._write_at:
            self.unwritten.extend(payloads)
            return None
        self._write_at = time.monotonic() + self.settings.write_interval_seconds
        payloads = [*self.unwritten, *payloads]
        self.unwritten.clear()
        first = self.job.gen.events - len(payloads) + 1
        latency = None
        if payloads:
            now = time.time()
            if self._last_event_at:  # per event, when a write carries several steps
                latency = (now - self._last_event_at) * 1000 / len(payloads)
            elif first == 1:  # the job's first event: its time to first token
                ttft = (now - self.job.created_at) * 1000
                self._observe(f"ttft_ms:{priority_label(self.job.level)}", ttft)
            self._last_event_at = now
        return Write(payloads, first, latency)


class Executions:
    """The part of a worker that runs one claimed job. A :class:`jobs.worker.loop.Worker`
    is one; these are the parts of it a job's execution uses."""

    settings: Settings
    engine: Engine
    store: Store
    telemetry: Telemetry
    rq: RQBridge
    kv: Sequences
    name: str
    stopping: threading.Event
    #: A step write saw a waiting job: free sequences claim at the next step.
    _work_waiting: bool
    #: When (monotonic) a step write last saw the queue empty.
    _empty_seen_at: float
    #: The queue's head key and length that the last step write saw (None:
    #: empty; the length None: not read).
    _seen_head: tuple[float | None, int | None]
    #: The queue's head key and length when this worker's last claim found
    #: nothing it may take (a capped tenant's jobs, another model's, a parked
    #: job left to its holder): while step writes see the same head and no
    #: more jobs than that, free sequences claim on the clock, not at every
    #: step (the length is lowered as jobs leave, so an arrival shows).
    _passed: tuple[float, int] | None
    #: Inter-token latencies not yet in Redis: observations per bucket, and the
    #: sum of their milliseconds (written at each beat and at each job's end, one
    #: round trip, not three commands in every step write).
    _gaps: dict[str, int]
    _gaps_ms: float
    #: When Redis last failed a call (see Worker._reap_disconnected).
    _redis_lost_at: float
    #: When a step last asked for a park by tenants' shares (_check_preempt).
    _shares_checked_at: float = 0.0

    def beat(self, force: bool = True) -> None:
        raise NotImplementedError

    # -- one job: claim -> plan -> drive -> apply ---------------------------

    def _execution(
        self, slot: Slot, claim: Claim, running: Running
    ) -> Generator[Yielded, Any, None]:
        """One claimed job on ``slot``, from its first read to its last write;
        yields the engine calls of its generation. Its engine sequence is freed
        at the end, unless it keeps a job parked in place."""
        try:
            job = self._read(slot, claim)
            if job is None:
                return
            running.key, running.interactive = job.key, job.interactive
            start = yield from self._plan(job, running)
            outcome = yield from self._drive(job, running, start)
            if outcome is not None:
                self._apply(job, running, outcome)
        finally:
            self._not_sharing(running)
            if running.seq >= 0 and not running.kept:
                self.kv.release(running.seq)

    def _read(self, slot: Slot, claim: Claim) -> Job | None:
        """The claimed job and its generation state (None: nothing to run)."""
        job_id = claim.job_id
        # Between the claim and the first fenced write nothing may drop the job on
        # a Redis blip: it would stay `running` on this live worker forever.
        record = self._retrying(lambda: self.store.get(job_id))
        if record is None:
            return None
        if not self._retrying(lambda: self.rq.allowed(job_id)):
            log.warning("job %s: refused, not a parkq job", job_id)
            self._fail(slot.name, claim, "refused: not a parkq job", "invalid_job")
            return None
        request = GenerationRequest.from_json(json.loads(record["request"]))
        saved = record.get("checkpoint")
        if saved is not None and int(json.loads(saved).get("events", 0)) > int(
            record.get("seq", "0")
        ):
            # Ahead of the stream: events it counts were lost (a Redis failover).
            # A replay from the prompt writes them again, compared where stored.
            log.warning("job %s: its checkpoint is ahead of its stream (writes lost); it "
                        "is replayed from its prompt", job_id)  # fmt: skip
            saved = None
        e = self.engine
        if saved is not None:
            gen = Generation.restore(
                job_id, request, e.token_bytes, e.is_eog, json.loads(saved), e.constraint
            )
        else:
            gen = Generation(job_id, request, e.token_bytes, e.is_eog, e.constraint)
        detached = record.get("detached_at")
        level = int(record.get("priority", "0"))
        if record.get("exec") == "1" and record.get("started_at"):  # its first claim
            waited = float(record["started_at"]) - float(record["created_at"])
            self._observe(f"queue_wait_ms:{priority_label(level)}", max(0.0, waited) * 1000)
        return Job(
            slot=slot.name,
            claim=claim,
            request=request,
            gen=gen,
            level=level,
            key=claim.key if claim.key is not None else -float(record["score"]),
            created_at=float(record["created_at"]),
            detached_at=float(detached) if detached else None,
            resumed=saved is not None or int(record.get("seq", "0")) > 0,
            ckpt_exec=record.get("ckpt_exec"),
        )

    def _plan(self, job: Job, running: Running) -> Generator[Yielded, Any, Start]:
        """Where the job's KV comes from: kept on this worker, replayed, a
        sibling choice's prompt (waiting while a sibling here computes it), a
        cached prompt prefix, or nothing."""
        gen, request = job.gen, job.request
        kept = self.kv.take(job.job_id, job.ckpt_exec, gen.n_past)
        running.seq = kept.seq
        if job.resumed:
            if kept.in_place:
                return Start.in_place()
            return Start.replay() if kept.kv is None else Start.checkpoint(kept.kv)
        if request.choices > 1:
            while (shared := self.kv.take_shared(request)) is None:
                if not self.kv.sibling_prefilling(request):
                    running.sharing = request.response_id  # it computes it for them
                    self.kv.prefill_started(running.sharing)
                    break
                yield WAIT
            if shared is not None:
                n = len(request.prompt_ids)
                self._metric(lambda: self.telemetry.count("prompt_tokens_shared", n))
                return Start.sibling(shared.kv, shared.logits.copy())
        if hit := self.kv.prefixes.best(request.prompt_ids, self.settings.n_batch):
            entry, keep = hit
            self._metric(lambda: self.telemetry.record(prefix_hit_tokens=keep))
            return Start.prefix(entry.kv, keep)
        return Start.fresh()

    def _drive(
        self, job: Job, running: Running, start: Start
    ) -> Generator[Yielded, Any, Outcome | None]:
        """Run the generation; its outcome (None: superseded or failed here)."""
        job_id, gen = job.job_id, job.gen
        log.info(
            "job %s: %s on %s (%d prompt tokens, %d generated, %s)",
            job_id,
            "resuming" if job.resumed else "running",
            job.slot,
            len(job.request.prompt_ids),
            len(gen.generated),
            _STARTS[start.source].format(keep=start.keep),
        )
        self.rq.started(job_id, int(self.settings.worker_ttl) + 60)
        if job.detached_at is not None and self._abandoned(job, job.detached_at):
            log.info("job %s: its client left before it ran", job_id)
            job.client_gone = True
            return Outcome("cancelled", [])
        writer = StepWriter(job, self.settings, self._observe)

        def ready() -> None:
            if start.source in (Source.CHECKPOINT, Source.IN_PLACE):
                resume_ms = (time.perf_counter() - job.claimed_at) * 1000
                self._metric(lambda: self.telemetry.record(resume_ms=resume_ms))
                self._metric(lambda: self.telemetry.observe("resume_ms", resume_ms))

        def share(logits: np.ndarray) -> None:
            self._not_sharing(running)
            self.kv.share(job.request, running.seq, logits)

        try:
            outcome = yield from generate(
                self.engine,
                gen,
                partial(self._emit, job, writer),
                self.settings.n_batch,
                start,
                running.seq,
                ready=ready,
                prefilled=share if running.sharing else None,
            )
        except Fenced:
            log.warning("job %s: execution %s was superseded; dropping it", job_id,
                        job.claim.exec_token)  # fmt: skip
            return None
        except Diverged as exc:
            self._diverged(job, exc)
            return None
        except (EngineError, ValueError) as exc:
            log.exception("job %s: engine error", job_id)
            self._fail(job.slot, job.claim, f"engine error: {exc}", "engine_error")
            return None
        if writer.unwritten and outcome.state != "parked":
            # The last steps' tokens go out with the final events.
            outcome = Outcome(outcome.state, [*writer.unwritten, *outcome.payloads])
        return outcome

    def _apply(self, job: Job, running: Running, outcome: Outcome) -> None:
        """Record how the generation ended: parked, or finished or cancelled."""
        if outcome.state == "parked":
            self._park(job, running, with_kv=outcome.kv_valid)
            return
        self._end(job, outcome)
        # Keep the prompt's KV for a request that starts the same way (the next turn).
        prompt = job.request.prompt_ids
        long_prompt = len(prompt) >= 2 * self.settings.n_batch
        if outcome.state == "finished" and long_prompt and self.kv.prefixes.budget:
            self.kv.prefixes.put(prompt, self.engine.save_seq(running.seq))

    def _not_sharing(self, running: Running) -> None:
        """``running`` no longer computes a prompt for its siblings."""
        if running.sharing:
            self.kv.prefill_ended(running.sharing)
            running.sharing = ""

    # -- a job's steps --------------------------------------------------------

    def _emit(self, job: Job, writer: StepWriter, payloads: list[str]) -> int | StepWrite:
        """A step's payloads: written with this step's writes (a deferred write:
        the worker makes all of a step's in one round trip and sends the flags
        that steer the generation, CANCEL and PREEMPT) or with a later step (no
        flags: 0)."""
        self.beat(force=False)
        write = writer.take(payloads, self.stopping.is_set())
        if write is None:
            return 0
        c, tokens = job.claim, len(job.gen.generated)
        call = StepCall(c.job_id, c.exec_token, job.slot, tokens, write.first, write.payloads)
        return StepWrite(call, partial(self._control, job, write.latency_ms))

    def _observe(self, histogram: str, value_ms: float) -> None:
        self._metric(lambda: self.telemetry.observe(histogram, value_ms))

    def _flush_gaps(self) -> None:
        """Write the inter-token latencies gathered since the last flush (kept for
        the next one on a Redis blip)."""
        if not self._gaps:
            return
        gaps, total = dict(self._gaps), self._gaps_ms
        try:
            self.telemetry.observe_many("inter_token_ms", gaps, total)
        except redis.RedisError as exc:  # a measurement: never the job's end or the loop
            if isinstance(exc, TRANSIENT):
                self._redis_lost_at = time.time()
            log.warning("worker %s: latencies kept for the next write (%s)", self.name, exc)
            return
        for bucket, n in gaps.items():
            left = self._gaps[bucket] - n
            if left:
                self._gaps[bucket] = left
            else:
                del self._gaps[bucket]
        self._gaps_ms -= total

    def _control(self, job: Job, latency_ms: float | None, step: Step) -> int:
        """What a step write read back: a waiting job (claim soon), shutdown (park,
        so another worker resumes it), a client gone, a cancel or a park. The
        events it added count in the inter-token latencies, each at the write's
        mean gap ``latency_ms`` (a replay's events already stored do not)."""
        if latency_ms is not None and step.written:
            bucket = bucket_of(latency_ms)
            self._gaps[bucket] = self._gaps.get(bucket, 0) + step.written
            self._gaps_ms += latency_ms * step.written
        head, queued = step.head_key, step.queued
        self._seen_head = (head, queued)
        passed = self._passed
        if head is None:
            self._empty_seen_at = time.monotonic()
            self._passed = None  # (a job requeued later may come back at that key)
        elif passed is None or head != passed[0] or queued is None or queued > passed[1]:
            self._work_waiting = True  # maybe one this worker may take
        elif queued < passed[1]:
            self._passed = (head, queued)
        if self.stopping.is_set():
            if not step.flags & (CANCEL | PREEMPT):
                # Parked at the next step; a blip here is asked again then
                # (every write is due while stopping).
                self._metric(lambda: self.store.request_park(job.slot))
            return step.flags
        if step.detached_at is not None and self._abandoned(job, step.detached_at):
            job.client_gone = True
            return CANCEL
        if not self.settings.preempt:
            return step.flags & ~PREEMPT
        if step.flags == 0 and step.head_key is not None:
            head = step.head_key
            self._metric(lambda: self._check_preempt(job, head))
        return step.flags

    def _check_preempt(self, job: Job, head_key: float) -> None:
        """A better job waits: once this runner is preemptible, pick the victim.

        The enqueuer flags a victim at once when one is ripe; this covers the
        winner that arrived while every runner was still in its minimum run
        time. Throttled to when the head changes or every 100 ms (a park by
        tenants' shares: every SHARES_SECONDS).
        """
        policy = self.store.preempt_policy
        now = time.time()
        if not policy.ripe(job.started_at, now):
            return
        if not policy.beats(head_key, job.key):
            # No key beats it; a tenant under its share of the sequences at the
            # head's level may still park one of a tenant over it (its request
            # came while every runner was in its minimum run time, or a batch
            # line fed since): asked once a second per worker process.
            if self.settings.fair_share and now - self._shares_checked_at >= SHARES_SECONDS:
                self._shares_checked_at = now
                self.store.maybe_preempt(now)
            return
        if job.checked_head == head_key and now - job.checked_at < 0.1:
            return
        job.checked_head, job.checked_at = head_key, now
        self.store.maybe_preempt(now)

    def _park(self, job: Job, running: Running, with_kv: bool = True) -> None:
        """Record the park and keep the KV (in its sequence, or copied out; see
        :class:`Sequences`); without KV (a park during a replay) the job resumes
        by replay."""
        job_id, claim, gen = job.job_id, job.claim, job.gen
        t0 = time.perf_counter()
        state = json.dumps(gen.state(), separators=(",", ":"))
        try:
            outcome = self._retrying(
                lambda: self.store.park(
                    job_id, claim.exec_token, job.slot, state, time.time(), self.name, with_kv
                )
            )
        except Fenced:
            return
        if outcome is not Parked.PARKED:
            self.telemetry.count("jobs_cancelled")
            self.rq.ended(job_id, "canceled")
            log.info("job %s: cancelled while parking", job_id)
            return
        size = 0
        if with_kv:
            size = self.kv.park(job_id, claim.exec_token, gen.n_past, running.seq)
            running.kept = size == 0
        park_ms = (time.perf_counter() - t0) * 1000
        self._metric(lambda: self.telemetry.record(park_ms=park_ms, checkpoint_bytes=size))
        self._metric(lambda: self.telemetry.observe("park_ms", park_ms))
        self._metric(lambda: self.telemetry.count("preemptions"))
        n = len(gen.generated)
        self._metric(lambda: self.telemetry.log_preemption(job_id, job.slot, n, park_ms))
        self.rq.requeued(job_id)
        kept = "KV kept in place" if running.kept else f"{size} KV bytes"
        log.info("job %s: parked after %d tokens (%s, %.1f ms)", job_id, n, kept, park_ms)

    def _metric(self, call: Callable[[], object]) -> None:
        """A measurement or a hint (not the job's own data): skipped on a Redis blip."""
        try:
            call()
        except TRANSIENT as exc:
            self._redis_lost_at = time.time()
            log.warning("worker %s: a measurement was dropped (%s)", self.name, exc)

    def _retrying(self, call: Callable[[], T]) -> T:
        """A write that survives a Redis restart: retried for about a minute
        (redis-py's ``Retry``). Steps and finishes are safe to repeat (events
        are numbered, writes fenced)."""
        result: T = WRITE_RETRY.call_with_retry(call, self._redis_failed)
        return result

    def _redis_failed(self, exc: Exception) -> None:
        """Redis failed a call. Remember when (other workers' connections may be
        missing for a while after an outage or a failover: no one is taken for
        dead by its connections meanwhile). A server that refuses writes as a
        replica (its primary moved): drop the pooled connections, so the next try
        connects anew."""
        self._redis_lost_at = time.time()
        if error_code(exc) in MOVED_PRIMARY:
            self.store.r.connection_pool.disconnect()

    def _abandoned(self, job: Job, detached_at: float) -> bool:
        """An interactive job whose readers left longer ago than the grace period
        (not a background response: it runs to its end unread). Not within a
        reader's lease after this worker lost Redis: the readers could not renew
        their leases either, and do once it answers."""
        grace, now = self.settings.disconnect_grace_seconds, time.time()
        if now - self._redis_lost_at < self.store.lease_seconds():
            return False
        if job.request.background:
            return False
        return job.level > PRIORITY_LEVELS["batch"] and now - detached_at > grace

    def _end(self, job: Job, outcome: Outcome) -> None:
        job_id, claim, gen = job.job_id, job.claim, job.gen
        if outcome.state == "cancelled" and job.client_gone:
            message = "The client disconnected and did not come back within the grace period."
            payloads = [error_event(message, "cancelled", "client_disconnected"), DONE]
            fields = {"finish_reason": "client_gone", "tokens": str(len(gen.generated))}
            state = JobState.CANCELLED
        elif outcome.state == "cancelled":
            payloads = list(CANCEL_EVENTS)
            fields = {"finish_reason": "cancelled", "tokens": str(len(gen.generated))}
            state = JobState.CANCELLED
        else:
            fields = {
                "finish_reason": gen.finish_reason or "",
                "usage": json.dumps(gen.usage),
                "tokens": str(len(gen.generated)),
            }
            if gen.request.choice > 0:  # the response counts its prompt once: choice 0's
                fields["usage_prompt"] = "0"
            payloads = outcome.payloads
            state = JobState.FINISHED
        if self.store.model is not None and self.store.model.fingerprint:
            fields["fingerprint"] = self.store.model.fingerprint  # system_fingerprint
        # Cancel events are appended after whatever the stream holds (first = 0).
        first = gen.events - len(payloads) + 1 if state is JobState.FINISHED else 0
        self._flush_gaps()  # its latencies are in the metrics before its [DONE]
        try:
            self._retrying(
                lambda: self.store.finish(
                    job_id, claim.exec_token, job.slot, state, fields, first, payloads, time.time()
                )
            )
        except Fenced:
            log.warning(
                "job %s: execution %s was superseded; dropping it", job_id, claim.exec_token
            )
            return
        except Diverged as exc:
            self._diverged(job, exc)
            return
        except TransitionRefused as exc:
            log.error("%s; left as it is", exc)
            return
        self.telemetry.count(f"jobs_{state.value}")
        self.rq.ended(job_id, "finished" if state is JobState.FINISHED else "canceled")
        log.info(
            "job %s: %s (%s, %d tokens)",
            job_id,
            state.value,
            fields["finish_reason"],
            len(gen.generated),
        )

    def _diverged(self, job: Job, exc: Diverged) -> None:
        """A replay that computed other events than the stream holds: the job ends
        with an error after what its clients already have, never spliced."""
        log.error("job %s: %s; the job fails (device %s)", job.job_id, exc,
                  self.store.model.device if self.store.model else "CPU")  # fmt: skip
        self._metric(lambda: self.telemetry.count("replay_divergences"))
        self._fail(job.slot, job.claim,
                   f"The job's replay computed other tokens than its first run (from event "
                   f"{exc.seq} on: another kernel path, thread count or device), so its stream "
                   "cannot continue exactly.", "replay_diverged")  # fmt: skip

    def _fail(self, slot: str, claim: Claim, message: str, code: str) -> None:
        payloads = [error_event(message, "server_error", code), DONE]
        try:
            self._retrying(
                lambda: self.store.finish(
                    claim.job_id, claim.exec_token, slot, JobState.FAILED,
                    {"error": message, "error_code": code}, 0, payloads, time.time(),
                )
            )  # fmt: skip
        except (Fenced, TransitionRefused):
            return
        self.telemetry.count("jobs_failed")
        self.rq.ended(claim.job_id, "failed", error=message)
