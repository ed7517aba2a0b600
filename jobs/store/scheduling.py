"""The Redis side of scheduling: enqueue, claim, per-step writes, park, finish,
cancel, preempt flags and the reaper.

Every multi-key change is one Lua script (``scheduler/lua``), so a job is never
half enqueued, half claimed, half parked or half cancelled. Key names come
from :class:`scheduler.keys.Keys` only.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from jobs.store.events import DONE, error_event
from jobs.store.identity import ModelIdentity
from jobs.store.registry import WorkerRegistry
from jobs.store.telemetry import Telemetry, as_text, bucket_of, lua_script
from scheduler import fairness
from scheduler.keys import Keys
from scheduler.policy import PRIORITY_LEVELS, Policy
from scheduler.preempt import PreemptPolicy, Runner, choose_victim
from scheduler.settings import Settings
from scheduler.state import LIVE, TERMINAL, JobState, sources

log = logging.getLogger(__name__)

__all__ = [
    "CANCEL_EVENTS",
    "Cancelled",
    "Claim",
    "Diverged",
    "Ending",
    "Fenced",
    "JobEnded",
    "Lost",
    "Parked",
    "QueueFull",
    "ReapOutcome",
    "Reaped",
    "Step",
    "StepCall",
    "Store",
    "TransitionRefused",
]

#: Queue entries a claim or a preemption check reads at a time; they read on
#: past the jobs they may not take (another model's, parked jobs left to their
#: holder): a claim up to SCAN_LIMIT entries (the whole queue when
#: PARKQ_MAX_QUEUE is smaller), in one script.
QUEUE_PAGE = 64
SCAN_LIMIT = 4096
#: Pages a preemption check reads (it runs at every enqueue and, while a better
#: job waits, every 100 ms per running job).
PREEMPT_PAGES = 4
#: The queue entries a preemption check reads first: the first job that may run
#: decides, and it is nearly always among the first few; the check reads on
#: in pages of QUEUE_PAGE only past them (up to PREEMPT_FIRST_PAGE + QUEUE_PAGE
#: x PREEMPT_PAGES entries in all).
PREEMPT_FIRST_PAGE = 8
#: A preemption check's answer: the best job that may run interrupts no one.
NO_ONE = "no one"

#: What a cancelled job's stream ends with.
CANCEL_EVENTS = [error_event("The job was cancelled.", "cancelled", "job_cancelled"), DONE]


def _states(*states: JobState) -> str:
    return ",".join(s.value for s in states)


class Lost(Exception):
    """Events this execution wrote are no longer in the job's stream (Redis failed
    over to a replica that had not received them): nothing more was written; the
    job is replayed to write them again."""

    def __init__(self, job_id: str, have: int) -> None:
        super().__init__(f"job {job_id}: the stream holds {have} events, fewer than were written")
        self.job_id = job_id
        self.have = have


@dataclass(frozen=True)
class Ending:
    """How a job ended (:meth:`Store.ending`): its state, its stream's last event
    and whether that is the ``[DONE]``."""

    state: JobState
    last_seq: int
    done: bool
    error: str | None
    code: str
    #: Its per-token events have expired (past PARKQ_REPLAY_SECONDS).
    expired: bool = False

    def closing_events(self) -> list[str]:
        """What a stream that ended without its ``[DONE]`` is closed with: the
        job's error (a failed or cancelled job) and ``[DONE]``."""
        if self.state is JobState.CANCELLED:
            return CANCEL_EVENTS
        if self.state is JobState.FAILED:
            message = self.error or "The job failed."
            return [error_event(message, "server_error", self.code), DONE]
        return [DONE]

    @property
    def final_seq(self) -> int:
        """The id of the stream's last event: its stored ``[DONE]``, else the
        ``[DONE]`` of :meth:`closing_events` (numbered after the stored ones)."""
        return self.last_seq if self.done else self.last_seq + len(self.closing_events())


class QueueFull(Exception):
    """The queue holds `max_queue` waiting jobs: the new one was not accepted."""


class TenantQueueFull(QueueFull):
    """The job's tenant has its max_queued jobs waiting: the new one was not accepted."""


class Fenced(Exception):
    """This execution no longer owns the job; it must stop writing."""


class Diverged(Exception):
    """A replay computed an event other than the one the job's stream holds under
    that number (another kernel path, thread count or device): it was not
    written, and the job cannot continue its stream exactly."""

    def __init__(self, job_id: str, seq: int) -> None:
        super().__init__(f"job {job_id}: replayed event {seq} differs from the stored one")
        self.job_id = job_id
        self.seq = seq


@dataclass(frozen=True)
class Claim:
    job_id: str
    #: The fencing token of this execution: every write of it must carry it.
    exec_token: str
    #: The device that computed the job so far, when it is not this worker's
    #: (the continuation is then not bit-identical to an uninterrupted run).
    moved_from: str | None = None
    #: The key it runs at: its own, or that of the first waiting job that fit
    #: where a fair turn took it in that one's place (claim.lua).
    key: float | None = None


@dataclass(frozen=True)
class StepCall:
    """One job's step write (see :meth:`Store.step`)."""

    job_id: str
    exec_token: str
    worker: str
    tokens: int
    first_seq: int
    payloads: list[str]
    latency_ms: float | None = None


@dataclass(frozen=True)
class Step:
    flags: int
    #: Ordering key of the best waiting job (higher runs first), if any.
    head_key: float | None
    #: When the job's last stream reader left, or when its readers' last lease
    #: ends (ahead while one is held; None: a counted reader reads, or never read).
    detached_at: float | None = None
    #: Events this write added (a replay's events already stored are not).
    written: int = 0
    #: Jobs in the queue when its head was read (None: not read).
    queued: int | None = None


@dataclass(frozen=True)
class Reaped:
    worker: str
    job_id: str
    outcome: ReapOutcome
    #: The worker's process (a process serving several sequences has one
    #: worker name per sequence; its first one is the process's own name).
    proc: str = ""


class TransitionRefused(RuntimeError):
    """The job's state does not allow the transition asked for (nothing was written)."""

    def __init__(self, job_id: str, target: JobState) -> None:
        super().__init__(f"job {job_id}: its state does not allow {target.value}")
        self.job_id = job_id
        self.target = target


class JobEnded(TransitionRefused):
    """A cancel of a job that had already ended (``state``)."""

    def __init__(self, job_id: str, state: JobState) -> None:
        super().__init__(job_id, JobState.CANCELLED)
        self.state = state


class Cancelled(StrEnum):
    """What a cancel did."""

    #: It was waiting: it ended here, its stream closed.
    CANCELLED = "cancelled"
    #: It runs: its worker stops it within a step.
    CANCELLING = "cancelling"


class Parked(StrEnum):
    """What a park did."""

    PARKED = "parked"
    #: A cancel came while it was parking: it ended instead.
    CANCELLED = "cancelled"


class ReapOutcome(StrEnum):
    """What became of a dead worker's job."""

    REQUEUED = "requeued"
    #: It died with too many workers: it failed.
    FAILED = "failed"
    #: The worker held no job.
    NONE = ""


class Store:
    """parkq's job records in Redis, for the web process and the workers."""

    def __init__(
        self, client: redis.Redis, settings: Settings, model: ModelIdentity | None = None
    ) -> None:
        self.r = client
        #: The model this process serves or tokenizes for: stamped on the jobs
        #: it makes, announced with its heartbeats, required of the jobs it claims.
        self.model = model
        self.keys: Keys = settings.keys
        self.policy: Policy = settings.policy
        self.preempt_policy: PreemptPolicy = settings.preempt_policy
        self.settings = settings
        self.result_ttl = settings.result_ttl
        self.telemetry = Telemetry(client, self.keys)
        self.workers = WorkerRegistry(client, self.keys, model)
        self._next_wait_warning = 0.0
        self._short_until = 0.0
        #: The most queue entries a claim or a preemption check reads.
        self._scan_limit = min(settings.max_queue + QUEUE_PAGE, SCAN_LIMIT) if (
            settings.max_queue) else SCAN_LIMIT  # fmt: skip
        self._scripts = {
            name: client.register_script(lua_script(name))
            for name in (
                "enqueue",
                "claim",
                "fair_sweep",
                "step",
                "finish",
                "park",
                "cancel",
                "flag",
                "reap",
                "reader",
                "feed",
            )
        }

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)

    #: After a WAIT came back short (a replica down), writes are not waited for
    #: this long (each would wait the whole PARKQ_DURABLE_WAIT_MS in vain).
    SHORT_WAIT_SECONDS = 5.0

    def _waiting(self) -> bool:
        return bool(self.settings.wait_replicas) and time.monotonic() >= self._short_until

    def durable(self, pipeline: redis.client.Pipeline) -> bool:
        """End ``pipeline`` with a WAIT for PARKQ_DURABLE_REPLICAS (its writes, on
        its connection, held by that many replicas): whether one was added (its
        reply, the pipeline's last, goes to :meth:`acked`)."""
        if not self._waiting():
            return False
        pipeline.execute_command("WAIT", self.settings.wait_replicas, self.settings.durable_wait_ms)
        return True

    def acked(self, replicas: Any) -> None:
        """Log (at most once a minute) a WAIT that ended with fewer replicas than
        PARKQ_DURABLE_REPLICAS, or failed (a server that refuses WAIT)."""
        n, ms = self.settings.wait_replicas, self.settings.durable_wait_ms
        if isinstance(replicas, Exception):
            said = f"WAIT failed ({replicas}); writes are not waited for"
        elif int(replicas) < n:
            said = (f"{int(replicas)} of {n} replicas took a write within {ms} ms; a failover "
                    "now could lose it")  # fmt: skip
        else:
            return
        now = time.monotonic()
        self._short_until = now + self.SHORT_WAIT_SECONDS
        if now >= self._next_wait_warning:
            self._next_wait_warning = now + 60
            log.warning("Redis: %s", said)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def listen(self, job_ids: list[str]) -> redis.client.PubSub:
        """A subscription to the live events of ``job_ids`` (announced as
        ``<seq> <data>`` on each job's channel)."""
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(*[self.keys.channel(j) for j in job_ids])
        return pubsub

    # -- web side ---------------------------------------------------------

    def job_fields(
        self,
        job_id: str,
        kind: str,
        request: dict[str, Any],
        level: int,
        now: float,
        owner: str = "",
    ) -> dict[str, str]:
        """A new job's record, waiting since ``now``; ``owner`` is its creator's
        tenant ('' without API keys: web/tenants.py)."""
        return {
            "id": job_id,
            "kind": kind,
            "request": json.dumps(request, separators=(",", ":")),
            "priority": str(level),
            "score": repr(self.policy.score(level, now)),
            "state": JobState.QUEUED.value,
            "created_at": repr(now),
            "enqueued_at": repr(now),
            "seq": "0",
            "tokens": "0",
            "exec": "0",
            "preemptions": "0",
            # What its fair turn expects of it (scheduler/fairness.py).
            "prompt_n": str(len(request.get("prompt_ids", ()))),
            "max_out": str(int(request.get("max_tokens", 0) or 0)),
            **({"model_digest": self.model.digest} if self.model else {}),
            **({"owner": owner} if owner else {}),
        }

    def enqueue(
        self,
        job_id: str,
        kind: str,
        request: dict[str, Any],
        level: int,
        now: float,
        owner: str = "",
        extra: dict[str, str] | None = None,
        weight: float = 0.0,
        max_queued: int = 0,
        caps: bool = False,
    ) -> bool:
        """Store a new job and make it wait; False if the id is taken. With
        PARKQ_DURABLE_REPLICAS, returns once that many replicas hold it (or the
        wait is over: :meth:`durable`). ``extra``: more fields of its record
        (a response's own: web/responses_api.py). ``weight``: its tenant's, for
        its fair turn among the tenants at its level (0: none; first come, first
        served: scheduler/fairness.py). ``caps``: its tenant has max_running or
        max_queued (scheduler/tenancy.py), so the job is listed in the tenant's
        live set; :class:`TenantQueueFull` when ``max_queued`` (0: none) of the
        tenant's jobs wait."""
        fields = {**self.job_fields(job_id, kind, request, level, now, owner), **(extra or {})}
        score = fields["score"]
        flat = [x for kv in fields.items() for x in kv]
        k = self.keys
        keys = [k.job(job_id), k.queue, k.wake, k.fair, k.live_of(owner)]
        args = [job_id, score, repr(now), self.settings.max_queue,
                *self._fair_args(weight if owner else 0.0), max_queued if owner else 0,
                "1" if caps and owner else "0", *flat]  # fmt: skip
        if self._waiting():
            with self.r.pipeline(transaction=False) as p:
                self._scripts["enqueue"](keys=keys, args=args, client=p)
                self.durable(p)
                done_raw, acked = p.execute(raise_on_error=False)
            if isinstance(done_raw, Exception):
                raise done_raw
            self.acked(acked)
            done = int(done_raw)
        else:
            done = int(self._run("enqueue", keys, args))
        if done == -2:
            raise TenantQueueFull(job_id)
        if done < 0:
            raise QueueFull(job_id)
        return bool(done)

    def cancel(self, job_id: str, now: float) -> Cancelled | None:
        """Cancel a job: None if unknown, else what happened; :class:`JobEnded`
        if it had already ended."""
        k = self.keys
        result = self._run(
            "cancel",
            [k.job(job_id), k.queue, k.events(job_id)],
            [
                job_id,
                k.channel(job_id),
                repr(now),
                self.result_ttl,
                _states(JobState.QUEUED, JobState.PARKED),
                _states(JobState.RUNNING, JobState.PARKING),
                *CANCEL_EVENTS,
            ],
        )
        if result is None:
            return None
        outcome = as_text(result)
        if outcome.startswith("ended:"):
            raise JobEnded(job_id, JobState(outcome.removeprefix("ended:")))
        return Cancelled(outcome)

    def cancel_live(self, job_ids: list[str], now: float) -> dict[str, Cancelled]:
        """Cancel those of ``job_ids`` that have not ended; what happened to each."""
        out = {}
        for job_id in job_ids:
            try:
                if (outcome := self.cancel(job_id, now)) is not None:
                    out[job_id] = outcome
            except JobEnded:
                continue
        return out

    def sweep_fair_turns(self, budget: int) -> None:
        """Drop what of the tenants' fair turns no longer counts (fair_sweep.lua),
        at most ``budget`` entries of ended jobs per tenant's queue."""
        k = self.keys
        self._run("fair_sweep", [k.fair, k.queue], [k.job_prefix, k.base, budget])

    def _fair_args(self, weight: float) -> list[Any]:
        """The fair turn's arguments of enqueue.lua and feed.lua: the tenant's
        weight (0 when fair turns are off) and the output tokens a job of a
        tenant none of whose jobs finished is expected to take."""
        on = self.settings.fair_share and weight > 0
        return [repr(weight if on else 0.0), fairness.DEFAULT_OUTPUT]

    def feed_batch(self, batch_id: str, window: int, score: float, now: float,
                   owner: str = "", per_minute: int = 0, weight: float = 0.0,
                   caps: bool = False) -> int:  # fmt: skip
        """Queue a batch's pending lines (at ``score``) until ``window`` of them
        are live, each as far as its tenant ``owner``'s token bucket takes it
        (``per_minute``: its rate; 0: none) and at its fair turn (``weight``: the
        tenant's; 0: none), listed in the tenant's live set where it has
        ``caps``; how many were queued."""
        k = self.keys
        fed = self._run(
            "feed",
            [
                k.batch(batch_id),
                k.batch_pending(batch_id),
                k.batch_live(batch_id),
                k.queue,
                k.wake,
                k.bucket(owner),
                k.batches_waiting,
                k.fair,
                k.live_of(owner),
            ],
            [
                repr(now),
                k.job_prefix,
                window,
                repr(score),
                _states(*LIVE),
                k.pending_prefix,
                per_minute,
                *self._fair_args(weight if owner else 0.0),
                "1" if caps and owner else "0",
            ],
        )
        return int(fed)

    def reader(self, job_id: str, delta: int, now: float) -> None:
        """A counted reader of the job (no lease) attaches (+1) or leaves (-1); a
        -1 that never comes, or a +1 applied twice, leaves it read for good
        (:meth:`lease` has neither failure). parkq's own readers all hold leases
        now; the count is kept for web processes of an earlier release during
        a rolling upgrade."""
        k = self.keys
        self._run("reader", [k.job(job_id), k.readers(job_id)], ["", 0, repr(now), delta])

    def lease_seconds(self) -> float:
        """How long a stream reader's lease lasts past its last renewal: several
        renewals fit in one, whatever the keep-alive period."""
        return max(60.0, 4 * self.settings.keepalive_seconds)

    def lease(self, job_id: str, token: str, until: float, now: float) -> None:
        """Stream reader ``token`` reads the job until ``until`` (attach or renew),
        or (``until`` 0) has left. Idempotent: a call that failed or whose answer
        was lost may be repeated, and a lease given back that was never taken
        changes nothing; a lease never given back ends at ``until``."""
        k = self.keys
        self._run("reader", [k.job(job_id), k.readers(job_id)], [token, repr(until), repr(now), 0])

    def get(self, job_id: str) -> dict[str, str] | None:
        raw = self.r.hgetall(self.keys.job(job_id))
        if not raw:
            return None
        return {as_text(a): as_text(b) for a, b in raw.items()}

    def batch_of(self, job_id: str) -> str | None:
        """The id of the batch a job belongs to, if any."""
        value = self.r.hget(self.keys.job(job_id), "batch")
        return None if value is None else as_text(value)

    def queue_position(self, job_id: str) -> int | None:
        rank = self.r.zrank(self.keys.queue, job_id)
        return None if rank is None else int(rank)

    def ending(self, job_id: str) -> Ending | None:
        """How a job ended, or None while it is live (queued, running, parked).

        A record that has vanished reads as a failed job whose stream will not
        get its ``[DONE]``."""
        with self.r.pipeline(transaction=False) as p:
            p.hmget(self.keys.job(job_id), ["state", "error", "seq"])
            p.xrevrange(self.keys.events(job_id), max="+", min="-", count=1)
            (state, error, written), last = p.execute()
        if state is not None and JobState(as_text(state)) not in TERMINAL:
            return None
        seq, done = 0, False
        if last:
            eid, fields = last[0]
            seq = int(as_text(eid).split("-", 1)[0])
            done = as_text(fields[b"d"]) == DONE
        if state is None:
            return Ending(JobState.FAILED, seq, done, "The job's record is gone.", "job_lost")
        message = as_text(error) if error is not None else None
        if not last and written is not None and int(written) > 0:
            # Its events expired after the replay window: it wrote `written`, the last
            # its [DONE]; its result is what is left (GET /v1/jobs/<id>/result).
            return Ending(JobState(as_text(state)), int(written), True, message, "job_failed",
                          expired=True)  # fmt: skip
        return Ending(JobState(as_text(state)), seq, done, message, "job_failed")

    def events_after(
        self, job_id: str, seq: int, count: int | None = None
    ) -> list[tuple[int, str]]:
        """Events with sequence numbers above ``seq``, in order."""
        entries = self.r.xrange(self.keys.events(job_id), min=f"({seq}-0", max="+", count=count)
        return [(int(as_text(eid).split("-", 1)[0]), as_text(f[b"d"])) for eid, f in entries]

    # -- preemption -------------------------------------------------------

    def runners(self, now: float) -> tuple[list[Runner], int, list[str], list[str]]:
        """Preemptible live runners, the number of idle live workers (a worker
        process's free sequences each count), the runners' exec tokens and processes.

        Only workers that can run this store's jobs count (the same model, or
        one that announced none).
        """
        runners, idle, tokens, procs, _ = self._runners(now)
        return runners, idle, tokens, procs

    def _runners(
        self, now: float, listed: tuple[list[bytes], list[bytes]] | None = None
    ) -> tuple[list[Runner], int, list[str], list[str], set[str]]:
        """:meth:`runners`, and the names of every live worker (any model's).
        ``listed``: the live and the running workers, read already."""
        k = self.keys
        if listed is None:
            with self.r.pipeline(transaction=False) as p:
                p.zrangebyscore(k.workers, now, "+inf")
                p.zrange(k.running, 0, -1)
                listed = p.execute()
        alive_raw, running_raw = listed
        alive = [as_text(w) for w in alive_raw]
        running = {as_text(w) for w in running_raw}
        with self.r.pipeline(transaction=False) as p:
            for w in alive:
                p.hmget(
                    k.worker(w), "job", "exec", "since", "key", "pinned", "model_digest", "proc"
                )
            rows = p.execute()
        runners, tokens, procs = [], [], []
        peers = working = 0
        for w, (job, exec_, since, key, pinned, digest, proc) in zip(alive, rows, strict=True):
            theirs = None if digest is None else as_text(digest)
            if self.model is not None and theirs is not None and theirs != self.model.digest:
                continue  # serves another model: neither idle for us nor a victim
            peers += 1
            if w not in running or job is None or since is None or key is None:
                continue  # idle, or it finished or parked since the first read
            working += 1
            if pinned == b"1":
                continue  # a worker that never parks is busy but no candidate
            runners.append(Runner(w, as_text(job), float(key), float(since)))
            tokens.append(as_text(exec_))
            procs.append(w if proc is None else as_text(proc))
        # A worker that just went idle counts as idle: no one is preempted for a
        # job it is about to claim.
        return runners, peers - working, tokens, procs, set(alive)

    def maybe_preempt(self, now: float) -> str | None:
        """Flag the worker whose job the best waiting job should interrupt.

        Returns the flagged worker's name, or None. The flag is set only if
        that worker still runs the same execution (compare-and-set in Lua).
        A parked job that only its checkpoint holder may take for now (the
        affinity window, see claim.lua) can interrupt only that holder: parking
        anyone else would free an engine that could not take it. Such a job is
        passed over for the next waiting one, which anyone may take.
        """
        k = self.keys
        with self.r.pipeline(transaction=False) as p:
            p.zrange(k.queue, 0, PREEMPT_FIRST_PAGE - 1, withscores=True)
            p.zrangebyscore(k.workers, now, "+inf")
            p.zrange(k.running, 0, -1)
            head, alive_raw, running_raw = p.execute()
        if not head or not running_raw:
            return None  # nothing waits, or nothing runs
        runners, idle, tokens, procs, alive = self._runners(now, (alive_raw, running_raw))
        if not runners:
            return None  # no one to interrupt (an idle engine)
        mine = self.model.digest.encode() if self.model else None
        first = 0
        while head and first < QUEUE_PAGE * PREEMPT_PAGES:
            victim = self._victim(head, runners, idle, procs, alive, mine, now)
            if victim is NO_ONE:
                return None
            if isinstance(victim, Runner):
                token = tokens[runners.index(victim)]
                if self._run("flag", [self.keys.worker(victim.worker)], [victim.job_id, token]):
                    return victim.worker
                return None
            first += len(head)
            head = self.r.zrange(self.keys.queue, first, first + QUEUE_PAGE - 1, withscores=True)
        return None

    def _victim(
        self,
        head: list[tuple[bytes, float]],
        runners: list[Runner],
        idle: int,
        procs: list[str],
        alive: set[str],
        mine: bytes | None,
        now: float,
    ) -> Runner | str | None:
        """:meth:`maybe_preempt` over one page of the queue: the runner the first
        job this deployment may run should interrupt; NO_ONE when that job
        interrupts no one; None when no job of the page decides."""
        with self.r.pipeline(transaction=False) as p:
            for raw_id, _ in head:
                p.hmget(self.keys.job(as_text(raw_id)), "state", "ckpt_worker", "parked_at",
                        "model_digest", "run_seconds", "owner", "parks_others",
                        "max_running", "fair_tokens", "priority")  # fmt: skip
            records = p.execute()
        full: dict[tuple[bytes, int], bool] = {}  # (tenant, cap): at it (read once)

        def at_cap(owner: bytes | None, cap: bytes | None) -> bool:
            if not cap:
                return False
            key = (owner or b"", int(cap))
            if key not in full:
                full[key] = self._at_running_cap(as_text(key[0]), key[1])
            return full[key]

        for (_, score), record in zip(head, records, strict=True):
            state, holder, parked_at, digest, ran, owner, parks, cap, fair, level = record
            if state not in (b"queued", b"parked"):
                continue  # a stale entry: the job ended or runs
            if mine is not None and digest is not None and digest != mine:
                continue  # another model's: none of these runners can take it
            bound = self._left_to_holder(state, holder, parked_at, ran, alive, now)
            if bound:
                held_by = as_text(holder)
                only = [r for r, proc in zip(runners, procs, strict=True) if proc == held_by]
                if parks == b"batch":
                    only = self._parkable_by(owner or b"", only)
                if at_cap(owner, cap):
                    only = self._own(owner or b"", only)
                if not only:  # the holder is idle (it takes the job), busy unpreemptibly,
                    continue  # or busy with what this job's tenant may not park
                victim = choose_victim(self.preempt_policy, -float(score), only, 0, now)
                if victim is None:
                    continue
                return victim
            pool = runners
            if fair is not None:
                pool = self._not_handed_back(int(level or 0), owner or b"", runners, alive, now)
                if runners and not pool and not idle:
                    continue  # the claim would hand each runner its place back
            if parks == b"batch":  # its tenant leaves other tenants' interactive work be
                pool = self._parkable_by(owner or b"", pool)
            if at_cap(owner, cap):
                # Only its tenant's own running job may make room for it (another
                # tenant's parked would free a sequence it may not take); else it
                # is passed over, as the claim passes it over.
                own = self._own(owner or b"", pool)
                victim = choose_victim(self.preempt_policy, -float(score), own, 0, now)
                if victim is None:
                    continue
                return victim
            victim = choose_victim(self.preempt_policy, -float(score), pool, idle, now)
            if victim is None and fair is not None and not idle:
                victim = self._over_share(int(level or 0), runners, alive, now)
            return NO_ONE if victim is None else victim  # the best job anyone may take decides
        return None

    def _left_to_holder(
        self, state: bytes | None, holder: bytes | None, parked_at: bytes | None,
        ran: bytes | None, alive: set[str], now: float,
    ) -> bool:  # fmt: skip
        """Whether a waiting job (its record's state, ckpt_worker, parked_at and
        run_seconds) is a parked one left to its checkpoint's holder, a live
        process, for now (claim.lua's fits: the affinity window)."""
        return (
            state == b"parked"
            and holder is not None
            and as_text(holder) in alive
            and now - float(parked_at or 0) < max(self.settings.affinity_seconds, float(ran or 0))
        )

    def _over_share(
        self, level: int, runners: list[Runner], alive: set[str], now: float
    ) -> Runner | None:
        """The runner to park at ``level`` for the tenant whose fair turn there
        is the earliest (the one a claim would take: lib.lua), when its tenant
        runs fewer of the engine's sequences at that level, over its weight,
        than another tenant would after giving one up (scheduler/fairness.py):
        that tenant's runner of the lowest key past its minimum run time. Not
        one whose tenant's turn, once its job is back, would be no later than
        that tenant's: the claim would hand the sequence straight back (the
        parked job goes back at the place it ran in, first at an equal turn)."""
        first = self._first_turn(level, alive, now)
        if first is None:
            return None
        tenant, turn, weight, parks = first
        rows = self._shares(runners)
        held: dict[bytes, float] = {}
        for theirs, their_level, their_weight in rows:
            if their_level == level and their_weight:
                held[theirs] = held.get(theirs, 0.0) + 1 / their_weight
        mine = held.get(tenant, 0.0) + 1 / weight
        over = [
            (r, held[theirs], theirs)
            for r, (theirs, their_level, their_weight) in zip(runners, rows, strict=True)
            if their_level == level and their_weight and theirs != tenant
            and held[theirs] > mine + 1e-9 and self.preempt_policy.ripe(r.since, now)
            and (parks != b"batch" or level <= PRIORITY_LEVELS["batch"])
        ]  # fmt: skip
        after = self._turns_after(level, sorted({theirs for _, _, theirs in over}))
        over = [x for x in over if after[x[2]] > turn]
        if not over:
            return None
        return min(over, key=lambda x: (-x[1], x[0].key, x[0].worker))[0]

    def _first_turn(
        self, level: int, alive: set[str], now: float, but: bytes | None = None
    ) -> tuple[bytes, float, float, bytes | None] | None:
        """The tenant (other than ``but``) of the earliest fair turn at
        ``level`` whose first waiting job any sequence here may take now (this
        deployment's model, not a parked job left to its checkpoint's holder,
        its tenant not at its running cap: as the claim's fits), its turn, its
        weight and its parks_others; None when none is found among the
        4 x LOOK earliest turns."""
        k = self.keys
        mine = self.model.digest.encode() if self.model else None
        for raw, turn in self.r.zrange(k.turns(level), 0, 4 * fairness.LOOK - 1, withscores=True):
            if raw == but:
                continue
            tenant = as_text(raw)
            first = self.r.zrange(k.tenant_queue(level, tenant), 0, 0)
            if not first:
                continue
            got = self.r.hmget(k.job(as_text(first[0])), "state", "model_digest", "fair_w",
                               "parks_others", "ckpt_worker", "parked_at", "run_seconds",
                               "max_running")  # fmt: skip
            state, digest, weight, parks, holder, parked_at, ran, cap = got
            if state not in (b"queued", b"parked") or weight is None:
                continue  # ended (the claim drops it), or queued without a weight
            if mine is not None and digest is not None and digest != mine:
                continue
            bound = self._left_to_holder(state, holder, parked_at, ran, alive, now)
            if bound or (cap and self._at_running_cap(tenant, int(cap))):
                continue  # its holder takes it, or nobody may yet
            return raw, float(turn), float(weight), parks
        return None

    def _turns_after(self, level: int, tenants: list[bytes]) -> dict[bytes, float]:
        """Each of ``tenants``' turn at ``level`` once a job of its is back in
        the queue: its turn there if it has jobs waiting, else the later of the
        level's virtual time and its clock (lib.lua's fair_wait)."""
        k = self.keys
        with self.r.pipeline(transaction=False) as p:
            p.hget(k.fair, f"v|{level}")
            for t in tenants:
                p.zscore(k.turns(level), t)
                p.hget(k.fair, f"c|{level}|{as_text(t)}")
            got = p.execute()
        v = float(got[0] or 0)
        out = {}
        for i, t in enumerate(tenants):
            turn, clock = got[1 + 2 * i], got[2 + 2 * i]
            try:
                c = float(clock) if clock is not None else v
            except ValueError:
                c = v  # (release 0.2.0's form of a clock)
            out[t] = float(turn) if turn is not None else max(v, c)
        return out

    def _not_handed_back(
        self, level: int, owner: bytes, runners: list[Runner], alive: set[str], now: float
    ) -> list[Runner]:
        """Those of ``runners`` a waiting job of ``level`` and tenant ``owner``
        that takes fair turns may park for its key: not one of another tenant
        at that level whose turn, once its job is back, would come before
        every other tenant's whose first job fits (at an equal turn, unless
        that one is the waiting job's tenant): the claim would hand it the
        place straight back."""
        rows = self._shares(runners)
        here = {
            theirs for theirs, their_level, w in rows
            if their_level == level and w and theirs != owner
        }  # fmt: skip
        if not here:
            return runners
        turns = self._turns_after(level, sorted(here))
        back = set()
        for theirs in here:
            first = self._first_turn(level, alive, now, but=theirs)
            if (
                first is None
                or turns[theirs] < first[1]
                or (turns[theirs] == first[1] and first[0] != owner)
            ):
                back.add(theirs)
        return [r for r, row in zip(runners, rows, strict=True)
                if not (row[1] == level and row[2] and row[0] in back)]  # fmt: skip

    def _shares(self, runners: list[Runner]) -> list[tuple[bytes, int, float]]:
        """Each runner's job's tenant, level and fair weight (0: none)."""
        with self.r.pipeline(transaction=False) as p:
            for runner in runners:
                p.hmget(self.keys.job(runner.job_id), "owner", "priority", "fair_w")
            return [(o or b"", int(lv or 0), float(w or 0)) for o, lv, w in p.execute()]

    def _owners(self, runners: list[Runner]) -> list[tuple[bytes, int]]:
        """Each runner's job's tenant and priority level."""
        with self.r.pipeline(transaction=False) as p:
            for runner in runners:
                p.hmget(self.keys.job(runner.job_id), "owner", "priority")
            return [(theirs or b"", int(level or 0)) for theirs, level in p.execute()]

    def _own(self, owner: bytes, runners: list[Runner]) -> list[Runner]:
        """Those of ``runners`` whose job is tenant ``owner``'s."""
        rows = self._owners(runners)
        return [r for r, (theirs, _) in zip(runners, rows, strict=True) if theirs == owner]

    def _at_running_cap(self, owner: str, cap: int) -> bool:
        """Whether ``cap`` or more of tenant ``owner``'s jobs run (its live set;
        the claim passes its jobs over then: claim.lua)."""
        ids = [as_text(x) for x in self.r.smembers(self.keys.live_of(owner))]
        with self.r.pipeline(transaction=False) as p:
            for job_id in ids:
                p.hget(self.keys.job(job_id), "state")
            states = p.execute()
        return sum(st in (b"running", b"parking") for st in states) >= cap

    def _parkable_by(self, owner: bytes, runners: list[Runner]) -> list[Runner]:
        """Those of ``runners`` that a job of tenant ``owner`` whose policy parks
        only other tenants' batch work may park: its own tenant's, and others'
        at or below the batch level (scheduler/tenancy.py, parks_others)."""
        rows = self._owners(runners)
        return [
            r
            for r, (theirs, level) in zip(runners, rows, strict=True)
            if theirs == owner or level <= PRIORITY_LEVELS["batch"]
        ]

    # -- worker side ------------------------------------------------------

    def request_park(self, worker: str) -> None:
        """Raise a worker's own preempt flag (it is shutting down)."""
        self.r.hset(self.keys.worker(worker), "preempt", "1")

    def wait_for_work(self, timeout: float) -> None:
        """Block until a job is enqueued or parked, or ``timeout`` passes."""
        self.r.blpop([self.keys.wake], timeout=timeout)

    def claim(self, worker: str, now: float, proc: str | None = None) -> Claim | None:
        """Claim the best waiting job for ``worker`` (a sequence of process ``proc``)."""
        k = self.keys
        got = self._run(
            "claim",
            [k.queue, k.worker(worker), k.running, k.workers],
            [
                k.job_prefix,
                worker,
                repr(now),
                _states(*sources(JobState.RUNNING)),
                self.settings.affinity_seconds,
                QUEUE_PAGE,
                "0" if self.settings.preempt else "1",
                self.model.digest if self.model else "",
                proc or worker,
                self.model.device if self.model else "CPU",
                self._scan_limit,
                secrets.token_hex(4),
                fairness.LOOK,
            ],
        )
        if not got:
            return None
        job_id, exec_token = as_text(got[0]), as_text(got[1])
        moved = as_text(got[2]) if len(got) > 2 else ""
        key = float(as_text(got[3])) if len(got) > 3 else None
        return Claim(job_id, exec_token, moved or None, key)

    def step(
        self,
        job_id: str,
        exec_token: str,
        worker: str,
        tokens: int,
        first_seq: int,
        payloads: list[str],
        latency_ms: float | None = None,
    ) -> Step:
        """Write one step's events (numbered from ``first_seq``); read the flags.

        ``latency_ms`` (time since the previous token) goes to the inter-token
        latency histogram in the same call.
        """
        call = StepCall(job_id, exec_token, worker, tokens, first_seq, payloads, latency_ms)
        got = self._step_result(call, self._run("step", *self._step_args(call)))
        if isinstance(got, Fenced | Diverged | Lost):
            raise got
        return got

    def steps(self, calls: list[StepCall]) -> list[Step | Fenced | Diverged | Lost]:
        """:meth:`step` for several jobs in one round trip (a pipeline): each
        job's :class:`Step`, or :class:`Fenced` where its execution is stale,
        or :class:`Diverged` where its replay computed other events.
        Safe to repeat, like one step (events are numbered, writes fenced)."""
        script = self._scripts["step"]

        def run() -> list[Any]:
            # EVALSHA queued as is: a Script called on a pipeline would ask
            # SCRIPT EXISTS first, a second round trip every time.
            with self.r.pipeline(transaction=False) as p:
                for n, call in enumerate(calls):
                    keys, args = self._step_args(call, head=n == 0)  # one look at the queue
                    p.evalsha(script.sha, len(keys), *keys, *args)
                return list(p.execute())

        try:
            replies = run()
        except redis.exceptions.NoScriptError:  # a restarted Redis: none of them ran
            script.sha = self.r.script_load(script.script)
            replies = run()
        results = [self._step_result(c, got) for c, got in zip(calls, replies, strict=True)]
        # The queue head the first write read is every job's of this step (read
        # here when that write ended early: fenced, diverged, lost).
        head: float | None = None
        queued: int | None = None
        if not results:
            return []
        if isinstance(results[0], Step):
            head, queued = results[0].head_key, results[0].queued
        elif any(isinstance(r, Step) for r in results):
            with self.r.pipeline(transaction=False) as p:
                p.zrange(self.keys.queue, 0, 0, withscores=True)
                p.zcard(self.keys.queue)
                top, queued = p.execute()
            head = -float(top[0][1]) if top else None
        return [
            Step(r.flags, head, r.detached_at, r.written, queued)
            if isinstance(r, Step) and n
            else r
            for n, r in enumerate(results)
        ]

    def _step_args(self, call: StepCall, head: bool = True) -> tuple[list[str], list[Any]]:
        k, job_id = self.keys, call.job_id
        bucket = "" if call.latency_ms is None else bucket_of(call.latency_ms)
        keys = [k.job(job_id), k.events(job_id), k.worker(call.worker), k.queue, k.counters,
                k.histogram("inter_token_ms")]  # fmt: skip
        args = [call.exec_token, k.channel(job_id), call.tokens, call.first_seq, bucket,
                call.latency_ms or 0, "1" if head else "0", *call.payloads]  # fmt: skip
        return keys, args

    @staticmethod
    def _step_result(call: StepCall, got: Any) -> Step | Fenced | Diverged | Lost:
        if got == -1:
            return Fenced(call.job_id)
        if int(got[0]) == -3:
            return Diverged(call.job_id, int(got[1]))
        if int(got[0]) == -4:
            return Lost(call.job_id, int(got[1]))
        flags, head, detached = got[:3]
        return Step(
            int(flags),
            None if head is None else -float(head),
            None if detached is None else float(detached),
            int(got[3]) if len(got) > 3 else 0,
            int(got[4]) if len(got) > 4 and got[4] is not None else None,
        )

    def finish(
        self,
        job_id: str,
        exec_token: str,
        worker: str,
        state: JobState,
        fields: dict[str, str],
        first_seq: int,
        payloads: list[str],
        now: float,
    ) -> None:
        """Move a job to a terminal state with its last events."""
        k = self.keys
        flat = [x for kv in fields.items() for x in kv]
        hour = int(now // 3600) * 3600
        got = self._run(
            "finish",
            [
                k.job(job_id),
                k.events(job_id),
                k.worker(worker),
                k.running,
                k.counters,
                k.usage(hour),
                k.fair,
            ],
            [
                exec_token,
                k.channel(job_id),
                state.value,
                _states(*sources(state)),
                repr(now),
                self.result_ttl,
                worker,
                first_seq,
                len(fields),
                *flat,
                self.settings.usage_retention_seconds + 3600,
                *payloads,
            ],
        )
        if isinstance(got, list):
            if int(got[0]) == -4:
                raise Lost(job_id, int(got[1]))
            raise Diverged(job_id, int(got[1]))
        if got == -1:
            raise Fenced(job_id)
        if got == -2:
            raise TransitionRefused(job_id, state)

    def park(
        self,
        job_id: str,
        exec_token: str,
        worker: str,
        checkpoint: str,
        now: float,
        holder: str | None = None,
        keeps_kv: bool = True,
    ) -> Parked:
        """Requeue a running job with its checkpoint (or end it, cancelled meanwhile).
        ``holder``: the process whose memory keeps the job's KV (default ``worker``;
        none when ``keeps_kv`` is false)."""
        k = self.keys
        result = self._run(
            "park",
            [
                k.job(job_id),
                k.queue,
                k.worker(worker),
                k.running,
                k.wake,
                k.events(job_id),
                k.counters,
                k.usage(int(now // 3600) * 3600),
            ],
            [
                exec_token,
                repr(now),
                checkpoint,
                worker,
                k.channel(job_id),
                self.result_ttl,
                (holder or worker) if keeps_kv else "",
                self.settings.usage_retention_seconds + 3600,
                *CANCEL_EVENTS,
            ],
        )
        if result == -1:
            raise Fenced(job_id)
        if isinstance(result, list):
            raise Lost(job_id, int(result[1]))
        return Parked(as_text(result))

    def reap(
        self,
        now: float,
        me: str = "",
        only: list[str] | None = None,
        crash: bool = True,
        failure: str | None = None,
    ) -> list[Reaped]:
        """Requeue the jobs of workers whose heartbeat expired (never ``me``: a worker
        that can reap is alive, even if it stalled past its TTL); with ``only``,
        just those (marked expired by a live worker handing their jobs back).
        ``crash``: count it against the job's PARKQ_CRASH_LIMIT; ``failure``: the
        error a job that reached the limit ends with."""
        k = self.keys
        message = failure or "The job failed: its worker died too many times."
        code = "job_error" if failure else "worker_lost"
        payloads = [error_event(message, "server_error", code), DONE]
        flat = self._run(
            "reap",
            [k.workers, k.queue, k.running, k.wake],
            [
                repr(now),
                k.job_prefix,
                k.worker_prefix,
                k.events_prefix,
                k.channel_prefix,
                self.settings.crash_limit,
                self.result_ttl,
                me,
                "\n".join(only or []),
                "1" if crash else "0",
                *payloads,
            ],
        )
        items = [as_text(x) for x in flat]
        return [
            Reaped(worker, job_id, ReapOutcome(outcome), proc)
            for worker, job_id, outcome, proc in zip(*[iter(items)] * 4, strict=True)
        ]

    def job_states(self, job_ids: list[str]) -> dict[str, str | None]:
        with self.r.pipeline(transaction=False) as p:
            for job_id in job_ids:
                p.hget(self.keys.job(job_id), "state")
            states = p.execute()
        return {j: None if s is None else as_text(s) for j, s in zip(job_ids, states, strict=True)}
