"""The worker process: claim the best jobs, run them on the engine, repeat.

One process per GPU, no fork (llama.cpp's thread pool does not survive one),
the model loaded once. The engine serves ``PARKQ_MAX_SEQS`` sequences; each
is a worker of its own to the scheduler (a name, a heartbeat, a claim, a
preempt flag; sequence 0 carries the process's name, the others
``<name>/<i>``), so victim choice, fencing and crash recovery work per
sequence. The loop is: beat and reap, claim into free sequences, then one
step: one engine call decodes a token of every decoding sequence, and at
most one prefill chunk runs in a call of its own. A generation runs until it
finishes, is cancelled or is parked; a parked job's KV goes to the process's
RAM checkpoint store and its generation state to Redis, so it resumes in this
process without a copy of the prompt, or anywhere by replay.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from jobs.batches import BatchStore
from jobs.engine import Engine, EngineError
from jobs.events import DONE, error_event
from jobs.execution import Job, StepWriter
from jobs.generation import Generation, GenerationRequest
from jobs.identity import ModelIdentity
from jobs.rqjobs import RQBridge
from jobs.runner import CANCEL, PREEMPT, Eval, Outcome, Source, Start, generate
from jobs.sequences import Sequences
from jobs.store import (
    CANCEL_EVENTS,
    Claim,
    Fenced,
    Parked,
    ReapOutcome,
    Step,
    Store,
    TransitionRefused,
)
from scheduler.batching import SeqView, plan_step
from scheduler.policy import PRIORITY_LEVELS
from scheduler.settings import Settings
from scheduler.state import TERMINAL, JobState

__all__ = ["Worker", "default_worker_name"]

T = TypeVar("T")

log = logging.getLogger(__name__)


#: Fenced writes (steps, parks, finishes) through a Redis restart: back-off
#: from 0.2 s to 2 s, about a minute in all.
WRITE_RETRY = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=32)
#: The loop's wait while Redis is unavailable: 0.2 s doubling to 5 s.
LOOP_BACKOFF = ExponentialBackoff(cap=5.0, base=0.1)

#: How a job's log line tells where its KV came from.
_STARTS = {
    Source.FRESH: "fresh",
    Source.CHECKPOINT: "from its checkpoint",
    Source.IN_PLACE: "from its KV, kept in place",
    Source.REPLAY: "replaying",
    Source.PREFIX: "{keep} prompt tokens cached",
    Source.SIBLING: "the prompt computed by a sibling choice",
}

#: How often an idle worker looks for workers whose connections are gone.
CONN_CHECK_SECONDS = 0.5


def default_worker_name() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


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
class _Running:
    """A generation in progress on a slot, and the engine call it waits for."""

    slot: Slot
    job_id: str
    #: The engine sequence holding its KV (chosen once the job is read).
    seq: int = -1
    run: Generator[Eval, np.ndarray, None] | None = None
    call: Eval = field(default_factory=lambda: Eval([], 0))
    #: Its job's ordering key and whether it is interactive (set once read).
    key: float = 0.0
    interactive: bool = False
    #: Steps since it was last served.
    waited: int = 0
    #: Parked in place: its sequence now holds a parked job's KV.
    kept: bool = False
    #: The request (response id) whose prompt it is prefilling for its siblings.
    sharing: str = ""

    def send(self, result: np.ndarray | EngineError) -> None:
        assert self.run is not None
        if isinstance(result, EngineError):
            self.call = self.run.throw(result)
        else:
            self.call = self.run.send(result)


#: How fast the measured step times follow a change (exponential average).
EWMA = 0.2


#: A sequence that is free claims at the next step when a step write saw a
#: waiting job, else at least this often.
CLAIM_SECONDS = 0.1


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        client: redis.Redis,
        name: str | None = None,
        model: ModelIdentity | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.store = Store(client, settings, model)
        self.telemetry = self.store.telemetry
        self.rq = RQBridge(client, settings.queue_name, settings.result_ttl)
        self.name = name or settings.worker_name or default_worker_name()
        # Generations at once, and the engine sequences beyond them that keep
        # parked jobs' KV in place.
        n_seqs = int(getattr(engine, "n_seq_max", 1))
        n_slots = max(1, min(settings.max_seqs, n_seqs))
        self.slots = [Slot(self.name if i == 0 else f"{self.name}/{i}", i) for i in range(n_slots)]
        self.kv = Sequences(
            engine, n_seqs, n_slots, settings.checkpoint_bytes, settings.prefix_cache_bytes
        )
        self._running: dict[int, _Running] = {}
        #: Measured: one decode call of n sequences (ms), one prefill chunk (ms).
        self._decode_ms: dict[int, float] = {}
        self._prefill_ms: float | None = None
        self._next_claim = 0.0
        self._work_waiting = False
        self.stopping = threading.Event()
        self._next_beat = 0.0
        # Connection liveness: workers seen without a connection, and since when;
        # when this worker last lost Redis itself (then everyone looks gone).
        self._absent: dict[str, float] = {}
        self._next_conn_check = 0.0
        self._redis_lost_at = 0.0

    # -- lifecycle --------------------------------------------------------

    def run(self) -> None:
        """Work until :meth:`stop` is called."""
        # A worker restarted under its old name (a crash restart, a container's
        # `restart:`) is that name's previous life, not a live twin: it takes
        # over what the previous instance held (its jobs are requeued now, not
        # after the TTL) before its own first heartbeat refreshes the name.
        if any([self.store.retire_worker(slot.name) for slot in self.slots]):
            log.warning(
                "worker %s: a previous instance under this name did not sign off; "
                "taking over its jobs",
                self.name,
            )
        # (Also when its liveness had already been expired by someone else.)
        self._reap(time.time(), previous_life=True)
        self.store.drop_retired_keys()
        self.rq.register_worker(self.name)
        self.beat()
        served = f"serving {self.store.model.describe()}, " if self.store.model else ""
        log.info(
            "worker %s ready (%sn_ctx=%d, %d sequence%s)",
            self.name,
            served,
            self.engine.n_ctx,
            len(self.slots),
            "" if len(self.slots) == 1 else "s",
        )
        failures = 0
        try:
            while not self.stopping.is_set() or self._running:
                try:
                    self.beat(force=False)
                    self._reap_disconnected(time.time())
                    if not self.stopping.is_set():
                        self._admit()
                    if self._running:
                        self._step()
                    elif not self.stopping.is_set():
                        self.store.wait_for_work(
                            timeout=min(CONN_CHECK_SECONDS, self.settings.heartbeat_seconds)
                        )
                    failures = 0
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Redis restarting: wait and carry on (its AOF keeps the jobs).
                    self._redis_lost_at = time.time()
                    failures += 1
                    backoff = LOOP_BACKOFF.compute(failures)
                    log.warning("worker %s: Redis unavailable (%s); retry in %.1f s",
                                self.name, exc, backoff)  # fmt: skip
                    time.sleep(backoff)
        finally:
            try:
                for slot in self.slots:
                    self.store.remove_worker(slot.name)
                self.rq.unregister_worker()
            except redis.ConnectionError:
                log.warning("worker %s: Redis gone; could not sign off", self.name)
            log.info("worker %s stopped", self.name)

    def stop(self) -> None:
        self.stopping.set()

    # -- sequences --------------------------------------------------------

    def _admit(self) -> None:
        """Claim jobs into free sequences: at once when idle, else when a step
        saw a waiting job (or every CLAIM_SECONDS)."""
        free = [s for s in self.slots if s.index not in self._running]
        if not free:
            return
        now_m = time.monotonic()
        if self._running and not self._work_waiting and now_m < self._next_claim:
            return
        self._next_claim = now_m + CLAIM_SECONDS
        self._work_waiting = False
        for slot in free:
            claim = self.store.claim(slot.name, time.time(), self.name)
            if claim is None:
                return
            self._start(slot, claim)

    def _start(self, slot: Slot, claim: Claim) -> None:
        running = _Running(slot, claim.job_id)
        running.run = self._execution(slot, claim, running)
        try:
            running.call = next(running.run)
        except StopIteration:  # ended before it needed the engine
            self._feed_batch(claim.job_id)
            return
        self._running[slot.index] = running

    def _step(self) -> None:
        """One engine step. Alone: its next call. Several: the planner
        (scheduler.batching) picks, from the measured step times, who decodes
        a token in this step's one call and whose prefill chunks run, each in a
        call of its own, with the boundaries it has alone."""
        waiting = [r for r in self._running.values() if r.call is WAIT]
        runs = [r for r in self._running.values() if r.call is not WAIT]
        if len(runs) == 1:
            (r,) = runs
            prefill = len(r.call.tokens) > 1
            ms = self._serve([r], lambda: [self.engine.eval(r.call.tokens, r.call.pos, r.seq)])
            if len(self.slots) > 1:  # what the planner needs: one sequence's pace
                self._measured(None if prefill else 1, ms)
        elif runs:
            views = [
                SeqView(r.slot.index, r.key, r.interactive, len(r.call.tokens) > 1, r.waited)
                for r in runs
            ]
            pace = self.settings.interactive_pace
            plan = plan_step(views, self._decode_ms, self._prefill_ms, pace)
            for r in runs:
                r.waited += 1
            decoding = [self._running[index] for index in plan.decode]
            if decoding:
                steps = [(r.seq, r.call.tokens[0], r.call.pos) for r in decoding]
                ms = self._serve(decoding, lambda: self.engine.decode(steps))
                self._measured(len(steps), ms)
            for p in [self._running[index] for index in plan.prefill]:
                self._measured(None, self._serve([p], self._call_of(p)))
        for r in waiting:  # a sibling's prompt may be ready now
            self._deliver(r, NOTHING)

    def _call_of(self, r: _Running) -> Callable[[], list[np.ndarray]]:
        """``r``'s pending engine call, alone (a prefill chunk)."""
        call = r.call
        return lambda: [self.engine.eval(call.tokens, call.pos, r.seq)]

    def _measured(self, n: int | None, ms: float) -> None:
        """Fold a call's duration into the step times the planner is given: a
        decode of ``n`` sequences, or (None) a prefill chunk."""
        if n is None:
            old = self._prefill_ms if self._prefill_ms is not None else ms
            self._prefill_ms = old + EWMA * (ms - old)
        else:
            old = self._decode_ms.get(n, ms)
            self._decode_ms[n] = old + EWMA * (ms - old)

    def _serve(self, runs: list[_Running], call: Callable[[], list[np.ndarray]]) -> float:
        """Make one engine call for ``runs`` and send each its logits (or the
        engine's error); a generation that ends frees its sequence. Returns the
        call's duration in ms."""
        t0 = time.perf_counter()
        try:
            results: list[np.ndarray | EngineError] = list(call())
        except EngineError as exc:
            results = [exc] * len(runs)
        ms = (time.perf_counter() - t0) * 1000
        for r, result in zip(runs, results, strict=True):
            r.waited = 0
            self._deliver(r, result)
        return ms

    def _deliver(self, r: _Running, result: np.ndarray | EngineError) -> None:
        """Send ``r`` its call's result; a generation that ends frees its slot."""
        try:
            r.send(result)
        except StopIteration:
            del self._running[r.slot.index]
            self._feed_batch(r.job_id)
        except BaseException:
            del self._running[r.slot.index]  # a Redis outage past the retries
            raise

    def beat(self, force: bool = True) -> None:
        """Heartbeat; requeue dead workers' jobs; free checkpoints of ended jobs."""
        now = time.time()
        if not force and now < self._next_beat:
            return
        self._next_beat = now + self.settings.heartbeat_seconds
        try:
            self._beat(now)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._redis_lost_at = now
            log.warning("worker %s: heartbeat failed (%s)", self.name, exc)

    def _reap_disconnected(self, now: float) -> None:
        """Requeue at once the jobs of workers whose Redis connections are gone.

        A process that dies (SIGKILL, a segfault, the OOM killer) closes its
        connections at once, long before its heartbeat expires. A worker is
        taken for dead when it is missing from CLIENT LIST in two looks
        CONN_CHECK_SECONDS apart; not within a worker TTL after this worker
        itself lost Redis (a Redis restart drops everyone's connections). A
        frozen or partitioned worker keeps its connection or its heartbeat
        ages out: the TTL and the fencing cover it, as before.
        """
        if now < self._next_conn_check or not self.store.named_connection():
            return
        self._next_conn_check = now + CONN_CHECK_SECONDS
        if now - self._redis_lost_at < self.settings.worker_ttl:
            self._absent.clear()
            return
        gone = self.store.disconnected_workers(now, self.name)
        if gone is None:
            return
        dead = [w for w in gone if now - self._absent.get(w, now) >= CONN_CHECK_SECONDS]
        self._absent = {w: self._absent.get(w, now) for w in gone if w not in dead}
        for w in dead:
            log.warning("worker %s: its Redis connections are gone; taking it for dead", w)
            self.store.retire_worker(w)
        if dead:
            self._reap(now)

    def _beat(self, now: float) -> None:
        # Reap before the heartbeat: a beat must never refresh a dead worker of
        # the same name before its jobs are requeued.
        self._reap(now)
        kv_bytes, rss = self.kv.checkpoints.bytes, resident_bytes()
        for slot in self.slots:  # the process's figures once, on its own name
            ttl = self.settings.worker_ttl
            self.store.heartbeat(slot.name, now, ttl, kv_bytes, rss, self.name)
            kv_bytes = rss = 0
        self.rq.heartbeat(int(self.settings.worker_ttl) + 60)
        held = self.kv.held()
        if held:
            for job_id, state in self.store.job_states(held).items():
                if state is None or JobState(state) in TERMINAL:
                    self.kv.drop(job_id)
                    log.info("job %s: ended while parked; checkpoint freed", job_id)
                elif state == JobState.RUNNING and job_id in self.kv.in_place:
                    self.kv.drop(job_id)  # resumed elsewhere: this copy is stale
                    log.info("job %s: resumed elsewhere; in-place checkpoint freed", job_id)

    def _reap(self, now: float, previous_life: bool = False) -> None:
        """Requeue (or fail) the jobs of workers whose liveness expired; this worker's
        own name only for its previous life (at start), never while it runs."""
        for reaped in self.store.reap(now, "" if previous_life else self.name):
            if reaped.proc in ("", reaped.worker):  # a process's own name is RQ's worker
                self.rq.forget_worker(reaped.worker)
            if not reaped.job_id:
                continue
            log.warning(
                "job %s: worker %s died; job %s", reaped.job_id, reaped.worker, reaped.outcome
            )
            if reaped.outcome is ReapOutcome.REQUEUED:
                self.rq.requeued(reaped.job_id)
            elif reaped.outcome is ReapOutcome.FAILED:
                self.telemetry.count("jobs_failed")
                self.rq.ended(reaped.job_id, "failed", error="worker lost")

    def _feed_batch(self, job_id: str) -> None:
        """A batch's job left this worker: queue the batch's next lines."""
        batch = self.store.batch_of(job_id)
        if batch is not None:
            BatchStore(self.store).feed(batch)

    # -- one job: claim -> plan -> drive -> apply ---------------------------

    def _execution(
        self, slot: Slot, claim: Claim, running: _Running
    ) -> Generator[Eval, np.ndarray, None]:
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
        e = self.engine
        if saved is not None:
            gen = Generation.restore(
                job_id, request, e.token_bytes, e.is_eog, json.loads(saved), e.constraint
            )
        else:
            gen = Generation(job_id, request, e.token_bytes, e.is_eog, e.constraint)
        detached = record.get("detached_at")
        return Job(
            slot=slot.name,
            claim=claim,
            request=request,
            gen=gen,
            level=int(record.get("priority", "0")),
            key=-float(record["score"]),
            created_at=float(record["created_at"]),
            detached_at=float(detached) if detached else None,
            resumed=saved is not None or int(record.get("seq", "0")) > 0,
            ckpt_exec=record.get("ckpt_exec"),
        )

    def _plan(self, job: Job, running: _Running) -> Generator[Eval, np.ndarray, Start]:
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
        self, job: Job, running: _Running, start: Start
    ) -> Generator[Eval, np.ndarray, Outcome | None]:
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
        if job.detached_at is not None and self._abandoned(job.level, job.detached_at):
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
        except (EngineError, ValueError) as exc:
            log.exception("job %s: engine error", job_id)
            self._fail(job.slot, job.claim, f"engine error: {exc}", "engine_error")
            return None
        if writer.unwritten and outcome.state != "parked":
            # The last steps' tokens go out with the final events.
            outcome = Outcome(outcome.state, [*writer.unwritten, *outcome.payloads])
        return outcome

    def _apply(self, job: Job, running: _Running, outcome: Outcome) -> None:
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

    def _not_sharing(self, running: _Running) -> None:
        """``running`` no longer computes a prompt for its siblings."""
        if running.sharing:
            self.kv.prefill_ended(running.sharing)
            running.sharing = ""

    # -- a job's steps --------------------------------------------------------

    def _emit(self, job: Job, writer: StepWriter, payloads: list[str]) -> int:
        """A step's payloads: written now or with a later step; the flags that
        steer the generation (CANCEL, PREEMPT)."""
        self.beat(force=False)
        write = writer.take(payloads, self.stopping.is_set())
        if write is None:
            return 0
        c, tokens = job.claim, len(job.gen.generated)
        step = self._retrying(
            lambda: self.store.step(
                c.job_id, c.exec_token, job.slot, tokens, write.first, write.payloads,
                write.latency_ms,
            )
        )  # fmt: skip
        return self._control(job, step)

    def _observe(self, histogram: str, value_ms: float) -> None:
        self._metric(lambda: self.telemetry.observe(histogram, value_ms))

    def _control(self, job: Job, step: Step) -> int:
        """What a step write read back: a waiting job (claim soon), shutdown (park,
        so another worker resumes it), a client gone, a cancel or a park."""
        if step.head_key is not None:
            self._work_waiting = True
        if self.stopping.is_set():
            if not step.flags & (CANCEL | PREEMPT):
                self.store.request_park(job.slot)  # parked at the next step
            return step.flags
        if step.detached_at is not None and self._abandoned(job.level, step.detached_at):
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
        time. Throttled to when the head changes or every 100 ms.
        """
        policy = self.store.preempt_policy
        now = time.time()
        if not policy.beats(head_key, job.key) or not policy.ripe(job.started_at, now):
            return
        if job.checked_head == head_key and now - job.checked_at < 0.1:
            return
        job.checked_head, job.checked_at = head_key, now
        self.store.maybe_preempt(now)

    def _park(self, job: Job, running: _Running, with_kv: bool = True) -> None:
        """Record the park and keep the KV (in its sequence, or copied out; see
        :class:`Sequences`); without KV (a park during a replay) the job resumes
        by replay."""
        job_id, claim, gen = job.job_id, job.claim, job.gen
        t0 = time.perf_counter()
        state = json.dumps(gen.state(), separators=(",", ":"))
        try:
            outcome = self._retrying(
                lambda: self.store.park(
                    job_id, claim.exec_token, job.slot, state, time.time(), self.name
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
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("worker %s: a measurement was dropped (%s)", self.name, exc)

    def _retrying(self, call: Callable[[], T]) -> T:
        """A write that survives a Redis restart: retried for about a minute
        (redis-py's ``Retry``). Steps and finishes are safe to repeat (events
        are numbered, writes fenced)."""
        result: T = WRITE_RETRY.call_with_retry(call, lambda exc: None)
        return result

    def _abandoned(self, level: int, detached_at: float) -> bool:
        """An interactive job whose readers left longer ago than the grace period."""
        grace = self.settings.disconnect_grace_seconds
        return level > PRIORITY_LEVELS["batch"] and time.time() - detached_at > grace

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
            payloads = outcome.payloads
            state = JobState.FINISHED
        # Cancel events are appended after whatever the stream holds (first = 0).
        first = gen.events - len(payloads) + 1 if state is JobState.FINISHED else 0
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

    def _fail(self, slot: str, claim: Claim, message: str, code: str) -> None:
        payloads = [error_event(message, "server_error", code), DONE]
        try:
            self.store.finish(
                claim.job_id,
                claim.exec_token,
                slot,
                JobState.FAILED,
                {"error": message},
                0,
                payloads,
                time.time(),
            )
        except (Fenced, TransitionRefused):
            return
        self.telemetry.count("jobs_failed")
        self.rq.ended(claim.job_id, "failed", error=message)
