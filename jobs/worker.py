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
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import redis

from jobs.batches import BatchStore
from jobs.checkpoints import Checkpoint, CheckpointStore, PrefixCache
from jobs.engine import Engine, EngineError
from jobs.events import DONE, error_event
from jobs.generation import Generation, GenerationRequest
from jobs.identity import ModelIdentity
from jobs.rqjobs import RQBridge
from jobs.runner import CANCEL, PREEMPT, Eval, Outcome, generate
from jobs.store import CANCEL_EVENTS, Claim, Fenced, Store, TransitionRefused
from scheduler.batching import SeqView, plan_step
from scheduler.policy import PRIORITY_LEVELS, priority_label
from scheduler.settings import Settings
from scheduler.state import TERMINAL, JobState

__all__ = ["Worker", "default_worker_name"]

T = TypeVar("T")

log = logging.getLogger(__name__)


#: How often an idle worker looks for workers whose connections are gone.
CONN_CHECK_SECONDS = 0.5


def default_worker_name() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


@dataclass(frozen=True)
class Slot:
    """One place to run a generation: a worker of its own to the scheduler."""

    name: str
    index: int


@dataclass(frozen=True)
class InPlace:
    """A parked job whose KV stays in its engine sequence (nothing copied)."""

    exec_token: str
    n_past: int
    seq: int


@dataclass
class SharedPrompt:
    """A prompt's KV and last logits, computed by one choice of a request with
    ``n`` > 1, for its siblings that start on this worker: they skip the prefill
    (a copy of KV the same engine calls computed, so nothing changes)."""

    tokens: tuple[int, ...]
    kv: bytes
    logits: np.ndarray
    #: Siblings that may still take it.
    left: int


#: Shared prompts kept at once (each holds one prompt's KV).
SHARED_PROMPTS = 8

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
        self._free_seqs = list(range(n_seqs - 1, -1, -1))  # popped from the end: 0 first
        self._in_place: OrderedDict[str, InPlace] = OrderedDict()
        self._in_place_max = n_seqs - n_slots
        self._running: dict[int, _Running] = {}
        #: Measured: one decode call of n sequences (ms), one prefill chunk (ms).
        self._decode_ms: dict[int, float] = {}
        self._prefill_ms: float | None = None
        self._next_claim = 0.0
        self._work_waiting = False
        self.checkpoints = CheckpointStore(settings.checkpoint_bytes)
        self.prefixes = PrefixCache(settings.prefix_cache_bytes)
        self._shared: OrderedDict[str, SharedPrompt] = OrderedDict()
        #: Requests (response ids) with a choice prefilling its prompt here.
        self._prefilling: dict[str, int] = {}
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
        backoff = 0.0
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
                    backoff = 0.0
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Redis restarting: wait and carry on (its AOF keeps the jobs).
                    self._redis_lost_at = time.time()
                    backoff = min(5.0, backoff * 2 or 0.2)
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
        kv_bytes, rss = self.checkpoints.bytes, resident_bytes()
        for slot in self.slots:  # the process's figures once, on its own name
            ttl = self.settings.worker_ttl
            self.store.heartbeat(slot.name, now, ttl, kv_bytes, rss, self.name)
            kv_bytes = rss = 0
        self.rq.heartbeat(int(self.settings.worker_ttl) + 60)
        held = [*self.checkpoints.job_ids(), *self._in_place]
        if held:
            for job_id, state in self.store.job_states(held).items():
                if state is None or JobState(state) in TERMINAL:
                    self._drop_kept(job_id)
                    log.info("job %s: ended while parked; checkpoint freed", job_id)
                elif state == JobState.RUNNING and job_id in self._in_place:
                    self._drop_kept(job_id)  # resumed elsewhere: this copy is stale
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
            if reaped.outcome == "requeued":
                self.rq.requeued(reaped.job_id)
            elif reaped.outcome == "failed":
                self.telemetry.count("jobs_failed")
                self.rq.ended(reaped.job_id, "failed", error="worker lost")

    def _feed_batch(self, job_id: str) -> None:
        """A batch's job left this worker: queue the batch's next lines."""
        batch = self.store.batch_of(job_id)
        if batch is not None:
            BatchStore(self.store).feed(batch)

    # -- one job ----------------------------------------------------------

    def _execution(
        self, slot: Slot, claim: Claim, running: _Running
    ) -> Generator[Eval, np.ndarray, None]:
        """One claimed job on ``slot``, from its first read to its last write;
        yields the engine calls of its generation. Its engine sequence is freed
        at the end, unless it keeps a job parked in place."""
        try:
            yield from self._job(slot, claim, running)
        finally:
            self._prefilled(running)
            if running.seq >= 0 and not running.kept:
                self._release_seq(running.seq)

    def _job(
        self, slot: Slot, claim: Claim, running: _Running
    ) -> Generator[Eval, np.ndarray, None]:
        t_claim = time.perf_counter()
        job_id, token = claim.job_id, claim.exec_token
        # Between the claim and the first fenced write nothing may drop the job on
        # a Redis blip: it would stay `running` on this live worker forever.
        record = self._retrying(lambda: self.store.get(job_id))
        if record is None:
            return
        if not self._retrying(lambda: self.rq.allowed(job_id)):
            log.warning("job %s: refused, not a parkq job", job_id)
            self._fail(slot, claim, "refused: not a parkq job", "invalid_job")
            return
        request = GenerationRequest.from_json(json.loads(record["request"]))
        saved = record.get("checkpoint")
        resume = saved is not None or int(record.get("seq", "0")) > 0
        e = self.engine
        if saved is not None:
            gen = Generation.restore(
                job_id, request, e.token_bytes, e.is_eog, json.loads(saved), e.constraint
            )
        else:
            gen = Generation(job_id, request, e.token_bytes, e.is_eog, e.constraint)
        kv, in_place = self._kv_for(job_id, record, gen, running)
        seq = running.seq
        keep = None
        shared = None
        if not resume and request.choices > 1:
            # One of several choices: take a sibling's prompt, or wait while a
            # sibling here computes it, or compute it for them.
            while (shared := self._take_shared(request)) is None:
                if not self._prefilling.get(request.response_id):
                    running.sharing = request.response_id
                    self._prefilling[running.sharing] = 1 + self._prefilling.get(running.sharing, 0)
                    break
                yield WAIT
        if shared is not None:
            kv = shared.kv
            gen.n_prefilled = len(request.prompt_ids)
            self._metric(lambda: self.telemetry.count("prompt_tokens_shared", gen.n_prefilled))
        elif not resume and (hit := self.prefixes.best(request.prompt_ids, self.settings.n_batch)):
            kv, keep = hit[0].kv, hit[1]
            gen.n_prefilled = keep
            self._metric(lambda: self.telemetry.record(prefix_hit_tokens=keep))
        log.info(
            "job %s: %s on %s (%d prompt tokens, %d generated, %s)",
            job_id,
            "resuming" if resume else "running",
            slot.name,
            len(request.prompt_ids),
            len(gen.generated),
            "from its KV, kept in place"
            if in_place
            else "the prompt computed by a sibling choice"
            if shared is not None
            else "from its checkpoint"
            if kv is not None and keep is None
            else "replaying"
            if resume
            else f"{keep} prompt tokens cached"
            if keep
            else "fresh",
        )
        self.rq.started(job_id, int(self.settings.worker_ttl) + 60)
        since = time.time()
        my_key = -float(record["score"])
        request_level = int(record.get("priority", "0"))
        running.key = my_key
        running.interactive = request_level > PRIORITY_LEVELS["batch"]
        last_check: dict[str, float | None] = {"head": None, "at": 0.0}

        timing = {"last": 0.0}
        gone = {"yes": False}
        detached = record.get("detached_at")
        if detached and self._abandoned(request_level, float(detached)):
            log.info("job %s: its client left before it ran", job_id)
            self._end(slot, claim, gen, Outcome("cancelled", []), client_gone=True)
            return

        # Tokens of steps faster than the write interval wait here for one write:
        # a Redis round trip per 0.2 ms step would cost more than the step, and
        # on a busy machine each one waits for a time slice.
        unwritten: list[str] = []
        write_at = {"t": 0.0}

        def emit(payloads: list[str]) -> int:
            self.beat(force=False)
            now_m = time.monotonic()
            if now_m < write_at["t"] and not self.stopping.is_set():
                unwritten.extend(payloads)
                return 0
            write_at["t"] = now_m + self.settings.write_interval_seconds
            payloads = [*unwritten, *payloads]
            unwritten.clear()
            first = gen.events - len(payloads) + 1
            latency = None
            if payloads:
                now = time.time()
                if timing["last"]:  # per event, when a write carries several steps
                    latency = (now - timing["last"]) * 1000 / len(payloads)
                elif first == 1:  # the job's first event: its time to first token
                    ttft = (now - float(record["created_at"])) * 1000
                    label = f"ttft_ms:{priority_label(request_level)}"
                    self._metric(lambda: self.telemetry.observe(label, ttft))
                timing["last"] = now
            step = self._retrying(
                lambda: self.store.step(
                    job_id, token, slot.name, len(gen.generated), first, payloads, latency
                )
            )
            if step.head_key is not None:
                self._work_waiting = True
            if self.stopping.is_set():
                # Shutting down: park (at the next step), so another worker resumes it.
                if not step.flags & (CANCEL | PREEMPT):
                    self.store.request_park(slot.name)
                return step.flags
            if step.detached_at is not None and self._abandoned(request_level, step.detached_at):
                gone["yes"] = True
                return CANCEL
            if not self.settings.preempt:
                return step.flags & ~PREEMPT
            if step.flags == 0 and step.head_key is not None:
                head = step.head_key
                self._metric(lambda: self._check_preempt(head, my_key, since, last_check))
            return step.flags

        def ready() -> None:
            if resume and (kv is not None or in_place):  # resumed from a checkpoint
                resume_ms = (time.perf_counter() - t_claim) * 1000
                self._metric(lambda: self.telemetry.record(resume_ms=resume_ms))
                self._metric(lambda: self.telemetry.observe("resume_ms", resume_ms))

        try:
            outcome = yield from generate(
                self.engine,
                gen,
                emit,
                self.settings.n_batch,
                kv=kv,
                resume=resume,
                ready=ready,
                keep=keep,
                seq=seq,
                in_place=in_place,
                prompt_logits=None if shared is None else shared.logits.copy(),
                prefilled=(lambda logits: self._share(running, request, logits))
                if running.sharing
                else None,
            )
        except Fenced:
            log.warning("job %s: execution %s was superseded; dropping it", job_id, token)
            return
        except (EngineError, ValueError) as exc:
            log.exception("job %s: engine error", job_id)
            self._fail(slot, claim, f"engine error: {exc}", "engine_error")
            return
        if outcome.state == "parked":
            self._park(slot, claim, gen, running, with_kv=outcome.kv_valid)
            return
        if unwritten:  # the last steps' tokens go out with the final events
            outcome = Outcome(outcome.state, [*unwritten, *outcome.payloads])
        self._end(slot, claim, gen, outcome, client_gone=gone["yes"])
        # Keep the prompt's KV for a request that starts the same way (the next turn).
        long_prompt = len(request.prompt_ids) >= 2 * self.settings.n_batch
        if outcome.state == "finished" and long_prompt and self.prefixes.budget:
            self.prefixes.put(request.prompt_ids, self.engine.save_seq(seq))

    # -- a request's choices share its prompt -----------------------------

    def _take_shared(self, request: GenerationRequest) -> SharedPrompt | None:
        shared = self._shared.get(request.response_id)
        if shared is None or shared.tokens != tuple(request.prompt_ids):
            return None
        shared.left -= 1
        if shared.left <= 0:
            del self._shared[request.response_id]
        return shared

    def _share(self, running: _Running, request: GenerationRequest, logits: np.ndarray) -> None:
        """``running`` computed its request's prompt: keep it for the siblings."""
        self._prefilled(running)
        kv = bytes(self.engine.save_seq(running.seq))
        tokens = tuple(request.prompt_ids)
        left = request.choices - 1
        self._shared[request.response_id] = SharedPrompt(tokens, kv, logits.copy(), left)
        while len(self._shared) > SHARED_PROMPTS:
            self._shared.popitem(last=False)

    def _prefilled(self, running: _Running) -> None:
        """``running`` no longer computes a prompt for its siblings."""
        if running.sharing:
            left = self._prefilling.pop(running.sharing, 1) - 1
            if left > 0:
                self._prefilling[running.sharing] = left
            running.sharing = ""

    # -- KV: engine sequences, kept in place or copied out ------------------

    def _kv_for(
        self, job_id: str, record: dict[str, str], gen: Generation, running: _Running
    ) -> tuple[bytes | memoryview | None, bool]:
        """Give ``running`` an engine sequence: the one that kept the job's KV in
        place (then True), else a free one and the job's RAM checkpoint, if any."""
        entry = self._in_place.pop(job_id, None)
        if entry is not None:
            if entry.exec_token == record.get("ckpt_exec") and entry.n_past == gen.n_past:
                running.seq = entry.seq
                return None, True
            log.warning("job %s: stale in-place checkpoint discarded", job_id)
            self._release_seq(entry.seq)
        running.seq = self._acquire_seq()
        return self._checkpoint_for(job_id, record, gen), False

    def _acquire_seq(self) -> int:
        if not self._free_seqs:  # every spare sequence keeps a parked job: copy one out
            self._swap_out()
        return self._free_seqs.pop()

    def _release_seq(self, seq: int) -> None:
        self.engine.clear(seq)
        self._free_seqs.append(seq)

    def _swap_out(self) -> None:
        """Copy the oldest job parked in place to the RAM checkpoint store; free
        its sequence."""
        job_id, entry = self._in_place.popitem(last=False)
        kv = self.engine.save_seq(entry.seq)
        self.checkpoints.put(job_id, Checkpoint(entry.exec_token, entry.n_past, bytes(kv)))
        self._release_seq(entry.seq)
        log.info("job %s: parked KV copied out of the engine (%d bytes)", job_id, len(kv))

    def _drop_kept(self, job_id: str) -> None:
        self.checkpoints.drop(job_id)
        entry = self._in_place.pop(job_id, None)
        if entry is not None:
            self._release_seq(entry.seq)

    def _checkpoint_for(
        self, job_id: str, record: dict[str, str], gen: Generation
    ) -> bytes | memoryview | None:
        checkpoint = self.checkpoints.take(job_id)
        if checkpoint is None:
            return None
        if checkpoint.exec_token != record.get("ckpt_exec") or checkpoint.n_past != gen.n_past:
            log.warning("job %s: stale checkpoint discarded", job_id)
            return None
        return checkpoint.kv

    def _check_preempt(
        self, head_key: float, my_key: float, since: float, last: dict[str, float | None]
    ) -> None:
        """A better job waits: once this runner is preemptible, pick the victim.

        The enqueuer flags a victim at once when one is ripe; this covers the
        winner that arrived while every runner was still in its minimum run
        time. Throttled to when the head changes or every 100 ms.
        """
        policy = self.store.preempt_policy
        now = time.time()
        if not policy.beats(head_key, my_key) or not policy.ripe(since, now):
            return
        at = last["at"] or 0.0
        if last["head"] == head_key and now - at < 0.1:
            return
        last["head"], last["at"] = head_key, now
        self.store.maybe_preempt(now)

    def _park(
        self, slot: Slot, claim: Claim, gen: Generation, running: _Running, with_kv: bool = True
    ) -> None:
        """Record the park. The KV stays in its engine sequence while a spare one
        is left (nothing copied), else it is copied to the RAM checkpoint store;
        without KV (a park during a replay) the job resumes by replay."""
        job_id = claim.job_id
        t0 = time.perf_counter()
        in_place = with_kv and self._in_place_max > 0
        kv = self.engine.save_seq(running.seq) if with_kv and not in_place else b""
        state = json.dumps(gen.state(), separators=(",", ":"))
        try:
            outcome = self._retrying(
                lambda: self.store.park(
                    job_id, claim.exec_token, slot.name, state, time.time(), self.name
                )
            )
        except Fenced:
            return
        if outcome == "parked":
            if in_place:
                self._in_place[job_id] = InPlace(claim.exec_token, gen.n_past, running.seq)
                running.kept = True
                while len(self._in_place) > self._in_place_max:
                    self._swap_out()
            elif kv:
                self.checkpoints.put(job_id, Checkpoint(claim.exec_token, gen.n_past, kv))
            park_ms = (time.perf_counter() - t0) * 1000
            self._metric(lambda: self.telemetry.record(park_ms=park_ms, checkpoint_bytes=len(kv)))
            self._metric(lambda: self.telemetry.observe("park_ms", park_ms))
            self._metric(lambda: self.telemetry.count("preemptions"))
            n = len(gen.generated)
            self._metric(lambda: self.telemetry.log_preemption(job_id, slot.name, n, park_ms))
            self.rq.requeued(job_id)
            log.info(
                "job %s: parked after %d tokens (%s, %.1f ms)",
                job_id,
                len(gen.generated),
                "KV kept in place" if in_place else f"{len(kv)} KV bytes",
                park_ms,
            )
        else:
            self.telemetry.count("jobs_cancelled")
            self.rq.ended(job_id, "canceled")
            log.info("job %s: cancelled while parking", job_id)

    def _metric(self, call: Callable[[], object]) -> None:
        """A measurement or a hint (not the job's own data): skipped on a Redis blip."""
        try:
            call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("worker %s: a measurement was dropped (%s)", self.name, exc)

    def _retrying(self, call: Callable[[], T]) -> T:
        """A write that survives a Redis restart: retried for up to 60 s. Steps
        and finishes are safe to repeat (events are numbered, writes fenced)."""
        deadline = time.monotonic() + 60
        delay = 0.1
        while True:
            try:
                return call()
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _abandoned(self, level: int, detached_at: float) -> bool:
        """An interactive job whose readers left longer ago than the grace period."""
        grace = self.settings.disconnect_grace_seconds
        return level > PRIORITY_LEVELS["batch"] and time.time() - detached_at > grace

    def _end(
        self,
        slot: Slot,
        claim: Claim,
        gen: Generation,
        outcome: Outcome,
        client_gone: bool = False,
    ) -> None:
        job_id = claim.job_id
        if outcome.state == "cancelled" and client_gone:
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
                    job_id, claim.exec_token, slot.name, state, fields, first, payloads, time.time()
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

    def _fail(self, slot: Slot, claim: Claim, message: str, code: str) -> None:
        payloads = [error_event(message, "server_error", code), DONE]
        try:
            self.store.finish(
                claim.job_id,
                claim.exec_token,
                slot.name,
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
