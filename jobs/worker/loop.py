"""The worker process: claim the best jobs, run them on the engine, repeat.

One process per GPU, no fork (llama.cpp's thread pool does not survive one),
the model loaded once. The engine serves ``PARKQ_MAX_SEQS`` sequences; each
is a worker of its own to the scheduler (a name, a heartbeat, a claim, a
preempt flag; sequence 0 carries the process's name, the others
``<name>/<i>``), so victim choice, fencing and crash recovery work per
sequence. The loop is: beat and reap, claim into free sequences, then one
step: one engine call decodes a token of every decoding sequence the planner
(``scheduler/batching.py``) picks, and prefill chunks run in calls of their
own. Each claimed job runs as ``jobs/worker/execution.py`` describes; its KV lives
where ``jobs/worker/sequences.py`` keeps it (in its sequence, parked in place, or in
the RAM checkpoint store), so a parked job resumes in this process without a
copy of the prompt, or anywhere by replay.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import redis
from redis.backoff import ExponentialBackoff

from jobs.engine.llama import Engine, EngineError
from jobs.store.batches import BatchStore
from jobs.store.faults import passes
from jobs.store.identity import ModelIdentity
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import (
    Claim,
    Diverged,
    Fenced,
    Lost,
    ReapOutcome,
    StepCall,
    Store,
)
from jobs.worker.execution import (
    NOTHING,
    TRANSIENT,
    WAIT,
    Executions,
    Running,
    Slot,
    StepWrite,
)
from jobs.worker.sequences import Sequences
from jobs.worker.stepclock import CLOCK
from scheduler.batching import SeqView, plan_step
from scheduler.settings import Settings
from scheduler.state import TERMINAL, JobState

__all__ = ["Worker", "default_worker_name"]

T = TypeVar("T")
#: An engine call's outcome for one sequence: its logits, or the engine's error.
Result = np.ndarray | EngineError

log = logging.getLogger(__name__)


#: The loop's wait while Redis is unavailable: 0.2 s doubling to 5 s.
LOOP_BACKOFF = ExponentialBackoff(cap=5.0, base=0.1)

#: How often an idle worker looks for workers whose connections are gone.
CONN_CHECK_SECONDS = 0.5


@dataclass(frozen=True)
class Returning:
    """A sequence whose job raised, to be handed back to the queue."""

    slot: Slot
    #: Counted against the job's PARKQ_CRASH_LIMIT (not for a Redis failure).
    crash: bool
    #: What the job ends with if that was its last chance.
    failure: str | None = None


def default_worker_name() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


#: How fast the measured step times follow a change (exponential average).
EWMA = 0.2


#: A sequence that is free claims at the next step when a step write saw a
#: waiting job (one other than the head its last claim passed over), else at
#: least this often, unless a step write saw the queue empty within that time.
#: Every step write (a prompt chunk's too, with no events) reads the queue's
#: head, so this covers steps whose writes did not happen (Redis refusing them
#: for a while) and jobs waiting behind a head this worker may not take.
CLAIM_SECONDS = 0.1
#: ... and at least this often, whatever the step writes saw.
CLAIM_BACKSTOP_SECONDS = 1.0


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Worker(Executions):
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
        n_slots = max(1, min(settings.max_seqs or n_seqs, n_seqs))
        self.slots = [Slot(self.name if i == 0 else f"{self.name}/{i}", i) for i in range(n_slots)]
        self.kv = Sequences(
            engine, n_seqs, n_slots, settings.checkpoint_bytes, settings.prefix_cache_bytes
        )
        self._running: dict[int, Running] = {}
        #: Sequences between a claim and their generation's first engine call.
        self._starting: dict[int, str] = {}
        #: Sequences whose job raised and is not yet handed back to the queue
        #: (Redis was unavailable): no claim takes them until it is.
        self._returning: dict[int, Returning] = {}
        #: Measured: one decode call of n sequences (ms), one prefill chunk (ms).
        self._decode_ms: dict[int, float] = {}
        self._prefill_ms: float | None = None
        self._next_claim = 0.0
        self._backstop = 0.0
        self._work_waiting = False
        self._empty_seen_at = -1e9
        self._seen_head = (None, None)
        self._passed = None
        self.stopping = threading.Event()
        self._next_beat = 0.0
        self._next_clock_flush = 0.0
        # Connection liveness: workers seen without a connection, and since when;
        # when this worker last lost Redis itself (then everyone looks gone).
        self._absent: dict[str, float] = {}
        self._next_conn_check = 0.0
        self._redis_lost_at = 0.0
        self._gaps: dict[str, int] = {}
        self._gaps_ms = 0.0

    # -- lifecycle --------------------------------------------------------

    def run(self) -> None:
        """Work until :meth:`stop` is called."""
        # A worker restarted under its old name (a crash restart, a container's
        # `restart:`) is that name's previous life, not a live twin: it takes
        # over what the previous instance held (its jobs are requeued now, not
        # after the TTL) before its own first heartbeat refreshes the name.
        if any([self.store.workers.retire(slot.name) for slot in self.slots]):
            log.warning(
                "worker %s: a previous instance under this name did not sign off; "
                "taking over its jobs",
                self.name,
            )
        # (Also when its liveness had already been expired by someone else.)
        self._reap(time.time(), previous_life=True)
        self.store.workers.drop_retired_keys()
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
                    self._return_jobs()
                    busy = time.perf_counter() if self._running else None
                    self.beat(force=False)
                    self._reap_disconnected(time.time())
                    if not self.stopping.is_set():
                        self._admit()
                    if self._running:
                        busy = busy or time.perf_counter()
                        self._step()
                    if busy is not None:
                        CLOCK.busy += time.perf_counter() - busy
                    elif not self.stopping.is_set():
                        self.store.wait_for_work(
                            timeout=min(CONN_CHECK_SECONDS, self.settings.heartbeat_seconds)
                        )
                    self._flush_clock()
                    failures = 0
                except TRANSIENT as exc:
                    # Redis restarting, or refusing writes for a while (maxmemory):
                    # wait and carry on (its AOF keeps the jobs).
                    self._redis_lost_at = time.time()
                    self._redis_failed(exc)
                    failures += 1
                    backoff = LOOP_BACKOFF.compute(failures)
                    log.warning("worker %s: Redis unavailable (%s); retry in %.1f s",
                                self.name, exc, backoff)  # fmt: skip
                    time.sleep(backoff)
        finally:
            self._sign_off()

    def _sign_off(self) -> None:
        """Leave the registry. A sequence whose job is still here (the loop ended on
        an exception, a second signal, a bug) is not removed but marked dead, and
        its job requeued now as a dead worker's is: no job is left running
        without a worker. Where Redis is gone nothing can be written: the
        heartbeats age out and the next reaper requeues them."""
        held = {*self._running, *self._returning}
        self._flush_gaps()
        try:
            names = [slot.name for slot in self.slots if slot.index in held]
            for name in names:
                self.store.workers.retire(name)
            if names:
                self._reap(time.time(), only=names)
            for slot in self.slots:
                self.store.workers.remove(slot.name)
            self.rq.unregister_worker()
        except redis.RedisError as exc:
            log.warning("worker %s: could not sign off (%s); its heartbeat will age out",
                        self.name, exc)  # fmt: skip
        if held:
            log.warning("worker %s: stopped with %d job(s) in flight; requeued",
                        self.name, len(held))  # fmt: skip
        # Their generations end now, while the engine is alive (their cleanup
        # frees engine sequences; left to the garbage collector at exit, it would
        # run after llama.cpp freed its context).
        for r in list(self._running.values()):
            if r.run is not None:
                with contextlib.suppress(Exception):
                    r.run.close()
        self._running.clear()
        log.info("worker %s stopped", self.name)

    def stop(self) -> None:
        self.stopping.set()

    def _flush_clock(self) -> None:
        """Add the step clock's seconds to the fleet's counters, once per
        heartbeat interval, between loop iterations (where every part of the
        iteration is in both the parts and the busy time)."""
        now = time.monotonic()
        if now < self._next_clock_flush:
            return
        self._next_clock_flush = now + self.settings.heartbeat_seconds
        spent = CLOCK.take()
        if any(spent.values()):
            self._metric(lambda: self.telemetry.add_step_seconds(spent))
        counts = CLOCK.take_counts()
        if any(counts.values()):
            self._metric(lambda: self.telemetry.add_counts(counts))

    # -- sequences --------------------------------------------------------

    def _admit(self) -> None:
        """Claim jobs into free sequences: at once when idle, else when a step
        saw a waiting job other than the head the last claim passed over, or
        every CLAIM_SECONDS unless a step write saw the queue empty in that
        time (and every CLAIM_BACKSTOP_SECONDS)."""
        free = [s for s in self.slots if s.index not in self._running | self._returning.keys()]
        if not free:
            return
        now_m = time.monotonic()
        if self._running and not self._work_waiting:
            if now_m < self._next_claim:
                return
            if now_m - self._empty_seen_at < CLAIM_SECONDS and now_m < self._backstop:
                return  # a step write just saw the queue empty
        self._next_claim = now_m + CLAIM_SECONDS
        self._backstop = now_m + CLAIM_BACKSTOP_SECONDS
        self._work_waiting = False
        for slot in free:
            if slot.index in self._returning:  # (a beat during a start found it stale)
                continue
            claim = self.store.claim(slot.name, time.time(), self.name)
            if claim is None:
                # Nothing here fits: until the head changes, a job arrives or
                # a sequence here frees, claims go by the clock.
                head, queued = self._seen_head
                self._passed = None if head is None or queued is None else (head, queued)
                return
            self._passed = None
            self._start(slot, claim)

    def _start(self, slot: Slot, claim: Claim) -> None:
        if claim.moved_from is not None:
            log.warning(
                "job %s was computed on %s and continues on %s: from here on its tokens "
                "are not bit-identical to an uninterrupted run's",
                claim.job_id,
                claim.moved_from,
                self.store.model.device if self.store.model else "CPU",
            )
        running = Running(slot, claim.job_id)
        running.run = self._execution(slot, claim, running)
        self._starting[slot.index] = claim.job_id  # (a beat meanwhile: see _reconcile)
        try:
            running.call = next(running.run)
        except StopIteration:  # ended before it needed the engine
            self._feed_batch(claim.job_id)
            return
        except Exception as exc:  # e.g. its record unreadable: the job, not the worker
            self._hand_back(running, exc)
            return
        finally:
            del self._starting[slot.index]
        self._running[slot.index] = running
        self._write_steps()  # a sibling's prompt can make it write before any call

    def _step(self) -> None:
        """One engine step. Alone: its next call. Several: the planner
        (scheduler.batching) picks, from the measured step times, who decodes
        a token in this step's one call and whose prefill chunks run, with the
        boundaries each has alone, several in one call where the engine's
        kernels allow it (:meth:`_prefill_groups`)."""
        self._write_steps()  # left by an iteration that ended on a Redis error
        waiting = [r for r in self._running.values() if r.call is WAIT]
        runs = [r for r in self._running.values() if r.call is not WAIT]
        if len(runs) == 1:
            (r,) = runs
            call = r.engine_call
            prefill = len(call.tokens) > 1
            ms = self._serve([r], lambda: [self.engine.eval(call.tokens, call.pos, r.seq)])
            if prefill:
                CLOCK.count("prefill_calls")
                CLOCK.count("prefill_chunks")
            if len(self.slots) > 1:  # what the planner needs: one sequence's pace
                self._measured(None if prefill else 1, ms)
        elif runs:
            views = [
                SeqView(r.slot.index, r.key, r.interactive, len(r.engine_call.tokens) > 1,
                        r.waited)
                for r in runs
            ]  # fmt: skip
            pace = self.settings.interactive_pace
            plan = plan_step(views, self._decode_ms, self._prefill_ms, pace)
            for r in runs:
                r.waited += 1
            decoding = [self._running[index] for index in plan.decode]
            prefilling = [self._running[index] for index in plan.prefill]
            # A person waiting for a first token goes before the decoders' next
            # one: their prompts are prefilled first in the step (the decoders'
            # token comes one prefill later, once; their pace is the same). A
            # batch chunk comes after the decode, as the planner sized it.
            first = any(r.interactive for r in prefilling)
            if first:
                self._prefill(prefilling)
            if decoding:
                steps = [(r.seq, r.engine_call.tokens[0], r.engine_call.pos) for r in decoding]
                ms = self._serve(decoding, lambda: self.engine.decode(steps))
                self._measured(len(steps), ms)
                self._write_steps()  # every decoding sequence's tokens: one round trip
            if not first:
                self._prefill(prefilling)
        for r in waiting:  # a sibling's prompt may be ready now
            self._deliver(r, NOTHING)
        self._write_steps()

    def _prefill(self, runs: list[Running]) -> None:
        """The step's prefill chunks, in as few calls as the kernels allow."""
        for group in self._prefill_groups(runs):
            ms = self._serve(group, self._prefill_of(group))
            if len(group) == 1:  # what the planner weighs: a chunk alone (batch ones are)
                self._measured(None, ms)
            CLOCK.count("prefill_calls")
            CLOCK.count("prefill_chunks", len(group))
            # A prompt just prefilled has its first token: out now, not after
            # the other prompts' chunks of this step.
            self._write_steps()

    def _write_steps(self) -> None:
        """Make the step writes the generations left to the worker, all in one
        round trip (a pipeline), and send each generation its flags: a step of
        several sequences costs one Redis round trip, not one per sequence.

        A write that fails past the retries (Redis gone) leaves the writes
        pending: the loop waits and the next step makes them again (a step
        write is safe to repeat: events are numbered, writes fenced). A stale
        execution is thrown :class:`Fenced` at its write, as a write of its
        own would have raised it."""
        while pending := [r for r in self._running.values() if isinstance(r.call, StepWrite)]:
            writes = [r.call for r in pending if isinstance(r.call, StepWrite)]
            calls = [w.call for w in writes]
            t0 = time.perf_counter()
            try:
                results: list[Any] = list(self._retrying(partial(self.store.steps, calls)))
            except redis.RedisError as exc:
                if passes(exc):
                    raise  # Redis's state: the loop waits, the writes stay pending
                # A reply that did not pass in the retries: one write's own? Each
                # alone, so that only the one Redis refuses is handed back.
                results = [self._alone(call) for call in calls]
            finally:
                CLOCK.add("redis", time.perf_counter() - t0)
            for r, write, result in zip(pending, writes, results, strict=True):
                if isinstance(result, Exception):
                    self._deliver(r, result)  # handed back, counted as a crash
                    continue
                if isinstance(result, Fenced | Diverged | Lost):
                    self._deliver(r, result)
                    continue
                try:
                    flags = write.control(result)
                except Exception as exc:
                    self._deliver(r, exc)
                    continue
                self._deliver(r, flags)

    def _alone(self, call: StepCall) -> Any:
        """One step write on its own: its result, or the error Redis answered it
        with (an error that passes is raised: the loop waits it out)."""
        try:
            return self.store.steps([call])[0]
        except redis.RedisError as exc:
            if passes(exc):
                raise
            return exc

    def _call_of(self, r: Running) -> Callable[[], list[np.ndarray]]:
        """``r``'s pending engine call, alone (a prefill chunk)."""
        call = r.engine_call
        return lambda: [self.engine.eval(call.tokens, call.pos, r.seq)]

    def _prefill_groups(self, runs: list[Running]) -> list[list[Running]]:
        """The planned prefill chunks as engine calls, in the plan's order: up to
        the engine's :attr:`max_prefill` chunks per call (where its kernels give
        each chunk its logits alone, or PARKQ_EXACT is off:
        tools/worker_process.py), so that people arriving together wait for one
        prefill call, not one each. The step's work is the same either way."""
        width = self.engine.max_prefill
        return [runs[i : i + width] for i in range(0, len(runs), width)]

    def _prefill_of(self, group: list[Running]) -> Callable[[], Sequence[Result]]:
        """One call for ``group``'s prefill chunks (one chunk: :meth:`_call_of`).
        If the shared call fails, each chunk runs again alone (its sequence cut
        back to the chunk's start first), so that one chunk llama.cpp refuses
        fails its own job only."""
        if len(group) == 1:
            return self._call_of(group[0])
        chunks = [(r.seq, r.engine_call.tokens, r.engine_call.pos) for r in group]

        def call() -> list[Result]:
            try:
                return list(self.engine.prefill(chunks))
            except EngineError as exc:
                log.warning("a prefill call of %d prompts failed (%s); each alone",
                            len(chunks), exc)  # fmt: skip
            out: list[Result] = []
            for seq, tokens, pos in chunks:
                try:
                    self.engine.truncate(pos, seq)
                    out.append(self.engine.eval(tokens, pos, seq))
                except EngineError as exc:
                    out.append(exc)
            return out

        return call

    def _measured(self, n: int | None, ms: float) -> None:
        """Fold a call's duration into the step times the planner is given: a
        decode of ``n`` sequences, or (None) a prefill chunk."""
        if n is None:
            old = self._prefill_ms if self._prefill_ms is not None else ms
            self._prefill_ms = old + EWMA * (ms - old)
        else:
            old = self._decode_ms.get(n, ms)
            self._decode_ms[n] = old + EWMA * (ms - old)

    def _serve(self, runs: list[Running], call: Callable[[], Sequence[Result]]) -> float:
        """Make one engine call for ``runs`` and send each its logits (or the
        engine's error); a generation that ends frees its sequence. Returns the
        call's duration in ms."""
        t0 = time.perf_counter()
        try:
            results: list[Result] = list(call())
        except EngineError as exc:
            results = [exc] * len(runs)
        seconds = time.perf_counter() - t0
        CLOCK.add("engine", seconds)
        ms = seconds * 1000
        for r, result in zip(runs, results, strict=True):
            r.waited = 0
            self._deliver(r, result)
        return ms

    def _deliver(self, r: Running, result: np.ndarray | EngineError | int | Exception) -> None:
        """Send ``r`` its engine call's result or its write's flags (or what
        failed); a generation that ends frees its slot."""
        try:
            r.send(result)
        except StopIteration:
            del self._running[r.slot.index]
            self._freed()
            self._feed_batch(r.job_id)
        except Exception as exc:  # (a signal's SystemExit: the loop's sign-off hands it back)
            del self._running[r.slot.index]
            self._freed()
            self._hand_back(r, exc)

    def _freed(self) -> None:
        """A sequence here is free: a waiting job this worker passed over may
        fit now (its tenant's running job was this one), so claim at once."""
        self._passed = None
        if self._seen_head[0] is not None:
            self._work_waiting = True

    def _hand_back(self, r: Running, exc: Exception) -> None:
        """A job whose generation raised (an engine error, its own data, a bug, Redis
        past the write retries): the worker goes on without it, and the job goes
        back to the queue as a dead worker's would (it resumes from its checkpoint
        or by replay, here or elsewhere; after PARKQ_CRASH_LIMIT such ends it fails
        with an error event and its [DONE])."""
        if isinstance(exc, Lost):
            # Redis failed over and lost events it had taken: a replay writes them
            # again (identical: the stream's stored events are compared).
            log.warning("job %s: %s (a Redis failover); it goes back to the queue to be "
                        "replayed", r.job_id, exc)  # fmt: skip
            self._metric(lambda: self.telemetry.count("writes_lost"))
            # Its checkpoint is ahead of the stream too: the replay starts from what
            # Redis holds, never from it (else every resume would find the same hole).
            self.kv.drop(r.job_id)
            back = Returning(r.slot, crash=False)
        elif passes(exc):
            # Not the job's fault: requeued without counting against its crash limit.
            log.warning("job %s: Redis failed under it (%s); it goes back to the queue",
                        r.job_id, exc)  # fmt: skip
            back = Returning(r.slot, crash=False)
        else:
            log.error("job %s: %s: %s; it goes back to the queue", r.job_id,
                      type(exc).__name__, exc, exc_info=exc)  # fmt: skip
            back = Returning(r.slot, crash=True,
                             failure=f"The job failed: {type(exc).__name__}: {exc}")  # fmt: skip
        self._returning[r.slot.index] = back
        with contextlib.suppress(*TRANSIENT):  # else the loop tries again once Redis answers
            self._return_jobs()

    def _return_jobs(self) -> None:
        """Requeue the jobs of the sequences in ``_returning`` (each marked dead and
        reaped alone, fenced as any dead worker's; this worker's other sequences
        are left alone even when their heartbeats have aged out in an outage),
        then announce those sequences alive again, free. A step that fails on
        Redis leaves the rest for the next try (a repeat finds nothing to reap)."""
        if not self._returning:
            return
        now = time.time()
        handled = list(self._returning.items())
        for _, back in handled:
            self.store.workers.retire(back.slot.name)
            self._reap(now, only=[back.slot.name], crash=back.crash, failure=back.failure)
        for index, _ in handled:  # (the beat below may find more: kept for the next call)
            del self._returning[index]
        self._beat(time.time())  # registered again before any claim can take them

    def beat(self, force: bool = True) -> None:
        """Heartbeat; requeue dead workers' jobs; free checkpoints of ended jobs."""
        now = time.time()
        if not force and now < self._next_beat:
            return
        self._next_beat = now + self.settings.heartbeat_seconds
        try:
            self._beat(now)
        except TRANSIENT as exc:
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
        if now < self._next_conn_check or not self.store.workers.named_connection():
            return
        self._next_conn_check = now + CONN_CHECK_SECONDS
        if now - self._redis_lost_at < self.settings.worker_ttl:
            self._absent.clear()
            return
        gone = self.store.workers.disconnected(now, self.name)
        if gone is None:
            return
        dead = [w for w in gone if now - self._absent.get(w, now) >= CONN_CHECK_SECONDS]
        self._absent = {w: self._absent.get(w, now) for w in gone if w not in dead}
        for w in dead:
            log.warning("worker %s: its Redis connections are gone; taking it for dead", w)
            self.store.workers.retire(w)
        if dead:
            self._reap(now)

    def _beat(self, now: float) -> None:
        t0 = time.perf_counter()
        # Reap before the heartbeat: a beat must never refresh a dead worker of
        # the same name before its jobs are requeued.
        self._reap(now)
        kv_bytes, rss = self.kv.checkpoints.bytes, resident_bytes()
        for slot in self.slots:  # the process's figures once, on its own name
            ttl = self.settings.worker_ttl
            self.store.workers.heartbeat(slot.name, now, ttl, kv_bytes, rss, self.name)
            kv_bytes = rss = 0
        self.rq.heartbeat(int(self.settings.worker_ttl) + 60)
        self._reconcile()
        self._flush_gaps()
        held = self.kv.held()
        if held:
            for job_id, state in self.store.job_states(held).items():
                if state is None or JobState(state) in TERMINAL:
                    self.kv.drop(job_id)
                    log.info("job %s: ended while parked; checkpoint freed", job_id)
                elif state == JobState.RUNNING and job_id in self.kv.in_place:
                    self.kv.drop(job_id)  # resumed elsewhere: this copy is stale
                    log.info("job %s: resumed elsewhere; in-place checkpoint freed", job_id)
        if self._running:  # the clock counts stepping time (see jobs/worker/stepclock.py)
            CLOCK.add("redis", time.perf_counter() - t0)

    def _reconcile(self) -> None:
        """A sequence that Redis records as running a job it does not run: the
        write that ended or handed back that job was lost (Redis failed over to a
        replica that had not received it). The job would stay `running` on a live
        worker for good; it is handed back, to be finished (or replayed) anew."""
        names = [slot.name for slot in self.slots]
        for slot, job_id in zip(self.slots, self.store.workers.slot_jobs(names), strict=True):
            if job_id is None or slot.index in self._returning:
                continue
            running = self._running.get(slot.index)
            runs = running.job_id if running is not None else self._starting.get(slot.index)
            if runs != job_id:
                log.warning("worker %s: Redis says it runs job %s, which it does not (a "
                            "lost write); the job goes back to the queue",
                            slot.name, job_id)  # fmt: skip
                self._returning[slot.index] = Returning(slot, crash=False)

    def _reap(
        self,
        now: float,
        previous_life: bool = False,
        only: list[str] | None = None,
        crash: bool = True,
        failure: str | None = None,
    ) -> None:
        """Requeue (or fail) the jobs of workers whose liveness expired; this worker's
        own name only for its previous life (at start), never while it runs;
        ``only``: just these of its own sequences, which it hands back."""
        me = "" if previous_life else self.name
        for reaped in self.store.reap(now, me, only, crash, failure):
            if not only and reaped.proc in ("", reaped.worker):  # RQ's worker: the process
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
