"""Every Redis key name parkq uses, and nothing else.

All keys of one deployment share one prefix (``{prefix}``, written as a hash
tag). Redis Cluster is not supported (see the README): RQ's keys have no tag
and some scripts read keys they are not passed. RQ's own bookkeeping keys
(``rq:job:*``, ``rq:queue:*``, registries, workers) keep RQ's names so that
``rq info`` and rq-dashboard see them; no Lua script touches those.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True)
class Keys:
    """Key names for one deployment, all under ``{prefix}:``."""

    prefix: str = "parkq"

    @property
    def base(self) -> str:
        return "{" + self.prefix + "}"

    @property
    def queue(self) -> str:
        """Sorted set of waiting job ids, lowest score runs first. Bound: PARKQ_MAX_QUEUE."""
        return f"{self.base}:queue"

    @property
    def wake(self) -> str:
        """List that idle workers block on; one entry per enqueue. Bound: trimmed to 64."""
        return f"{self.base}:wake"

    @property
    def workers(self) -> str:
        """Sorted set of worker names scored by heartbeat expiry (unix time). Bound:
        one entry per live worker (the reaper removes dead ones)."""
        return f"{self.base}:workers"

    @property
    def running(self) -> str:
        """Sorted set of busy worker names scored by their running job's key. Bound:
        one entry per busy worker."""
        return f"{self.base}:running"

    @property
    def worker_prefix(self) -> str:
        return f"{self.base}:worker:"

    @property
    def events_prefix(self) -> str:
        return f"{self.base}:events:"

    @property
    def channel_prefix(self) -> str:
        return f"{self.base}:live:"

    @property
    def retired_jobs_index(self) -> str:
        """A sorted set earlier versions wrote and nothing read; deleted by every
        worker at start (Store.drop_retired_keys)."""
        return f"{self.base}:jobs"

    @property
    def job_prefix(self) -> str:
        return f"{self.base}:job:"

    def job(self, job_id: str) -> str:
        """Hash holding one job's request, state and counters. Bound: PARKQ_RESULT_TTL
        after it ends (a batch line's: once its batch's output file is written)."""
        return f"{self.job_prefix}{job_id}"

    def events(self, job_id: str) -> str:
        """Stream of one job's SSE events; entry ids are ``<seq>-0``. Bound: as the job's."""
        return f"{self.events_prefix}{job_id}"

    def readers(self, job_id: str) -> str:
        """Sorted set of the leases of one job's stream readers (a token per open
        stream) scored by when each ends. Bound: expires when its last lease ends."""
        return f"{self.base}:readers:{job_id}"

    def channel(self, job_id: str) -> str:
        """Pub/sub channel announcing one job's new events live."""
        return f"{self.channel_prefix}{job_id}"

    @property
    def preemptions(self) -> str:
        """Capped stream of recent parks (job, worker, tokens), for the dashboard."""
        return f"{self.base}:preemptions"

    @property
    def ended(self) -> str:
        """Sorted set of ended jobs (not a batch's) by end time, until `parkq web`'s
        janitor compacts them (their result kept, their events left to expire after
        PARKQ_REPLAY_SECONDS). Bound: drained every PARKQ_JANITOR_SECONDS by the
        janitor of a running `parkq web` (a deployment runs one to take requests);
        while none runs, the ids of the jobs that end meanwhile wait here."""
        return f"{self.base}:ended"

    @property
    def store_id(self) -> str:
        """String: this deployment's store id, a random token the first process to
        connect writes once (SET NX). With Sentinel a process uses a server only if
        it holds the id the process has already seen (jobs/store/connect.py): a
        primary that restarted empty is not taken for the store. Bound: one key."""
        return f"{self.base}:store"

    def bucket(self, tenant: str) -> str:
        """Hash of one tenant's token bucket (``tokens``, ``at``): its
        tokens_per_minute (scheduler/tenancy.py). Bound: one per tenant with a
        rate, expiring once it would be full again."""
        return f"{self.base}:bucket:{tenant}"

    def live_of(self, tenant: str) -> str:
        """Set of the ids of one tenant's jobs that may still be waiting or
        running, kept only for a tenant with max_running or max_queued
        (scheduler/tenancy.py): the scripts that count them drop the ids of
        jobs that have ended. Bound: the tenant's live jobs, and the ended ones
        since the last count."""
        return f"{self.base}:live:{tenant}"

    @property
    def batches_waiting(self) -> str:
        """Sorted set of batch ids whose next line waits for its tenant's token
        rate, scored by when it will fit (the janitor feeds them then). Bound:
        one entry per such batch; removed when fed."""
        return f"{self.base}:batches:waiting"

    def usage(self, hour: int) -> str:
        """Hash of one hour's usage (``hour``: its first second), fields
        ``<tenant>|<what>``: prompt and completion tokens and requests of finished
        jobs, tokens set aside by parks. Bound: expires PARKQ_USAGE_RETENTION_SECONDS
        after its hour."""
        return f"{self.base}:usage:{hour}"

    @property
    def fair(self) -> str:
        """Hash of the tenants' fair turns (scheduler/fairness.py): each level's
        virtual time (``v|<level>``), each tenant's clock per level
        (``c|<level>|<tenant>``), its usual output tokens and share of
        max_tokens (``s|<tenant>``, ``f|<tenant>``). Bound: a clock is dropped
        by the janitor once it no longer counts (its tenant waits for nothing
        there and the level's virtual time passed it); the others are one per
        level or tenant. (Release 0.2.0 also kept ``g|`` and ``g_at|`` fields
        here, and ``c|`` in another form; the janitor drops them. An earlier
        form, never released, kept its fields in ``<base>:fair``: the janitor
        deletes that key, :attr:`fair_earlier`.)"""
        return f"{self.base}:turns"

    def turns(self, level: int | str) -> str:
        """Sorted set of the tenants with jobs waiting at ``level`` that take
        fair turns, scored by their turn (lib.lua's fair_wait). Bound: one
        entry per such tenant; a tenant is removed when nothing of it waits
        there (at its claim or cancel, or when a claim or the janitor finds
        its queue empty)."""
        return f"{self.base}:heads:{level}"

    def tenant_queue(self, level: int | str, tenant: str) -> str:
        """Sorted set of tenant ``tenant``'s jobs waiting at ``level`` that take
        fair turns, by their queue scores. Bound: its waiting jobs, and those
        that ended waiting by a way other than a claim or a cancel until a claim
        or the janitor reaches them."""
        return f"{self.base}:tq:{level}:{tenant}"

    @property
    def fair_earlier(self) -> str:
        """Where a development build before 0.2.0 kept fair turns in other units."""
        return f"{self.base}:fair"

    @property
    def webhooks_due(self) -> str:
        """Sorted set of webhook event ids scored by their next delivery attempt (a
        sender claims one by moving its score past its lease). Bound: an event
        leaves when its endpoint answers 2xx or after PARKQ_WEBHOOK_RETRY_SECONDS."""
        return f"{self.base}:webhooks"

    def webhook(self, event_id: str) -> str:
        """Hash of one webhook event: its JSON body, type, attempts, last error.
        Bound: deleted with its id in :attr:`webhooks_due`."""
        return f"{self.base}:webhook:{event_id}"

    @property
    def janitor_lock(self) -> str:
        """String held by the `parkq web` process whose janitor is sweeping. Bound: expires."""
        return f"{self.base}:janitor"

    @property
    def counters(self) -> str:
        """Hash of monotonic counters (tokens, preemptions, jobs by final state)."""
        return f"{self.base}:counters"

    def histogram(self, name: str) -> str:
        """Hash of one histogram: a count per bucket, plus `sum` and `count`."""
        return f"{self.base}:hist:{name}"

    def samples(self, name: str) -> str:
        """Capped list of recent measurements (park_ms, resume_ms, checkpoint_bytes)."""
        return f"{self.base}:samples:{name}"

    def worker(self, name: str) -> str:
        """Hash of one worker: its job, execution token, since, key, preempt flag, and what
        it announces (model, memory). Bound: deleted when the worker is reaped."""
        return f"{self.worker_prefix}{name}"

    def client_name(self, worker: str) -> str:
        """Not a key: the CLIENT SETNAME of a worker's Redis connections. When none
        of them is left in CLIENT LIST, the worker's process is gone."""
        return f"parkq-worker:{self.prefix}:{worker}".replace(" ", "_")

    @property
    def client_name_prefix(self) -> str:
        return f"parkq-worker:{self.prefix}:".replace(" ", "_")

    @property
    def files(self) -> str:
        """Sorted set of uploaded and generated file ids scored by creation time. Bound:
        a batch's output and error files expire with the batch's retention, uploaded
        files PARKQ_FILE_TTL_SECONDS after their upload (or when deleted), and the
        ids of expired ones are dropped when the files are listed or counted."""
        return f"{self.base}:files"

    def file(self, file_id: str) -> str:
        """Hash of one file's metadata (the OpenAI file object's fields)."""
        return f"{self.base}:file:{file_id}"

    def file_content(self, file_id: str) -> str:
        """String holding one file's bytes."""
        return f"{self.base}:file:{file_id}:content"

    def files_of(self, tenant: str) -> str:
        """Sorted set of one tenant's file ids (see :attr:`files`; lists of a
        tenant read it). Bound: as :attr:`files`; the janitor drops the ids of
        files that are gone."""
        return f"{self.base}:files:of:{tenant}"

    def batches_of(self, tenant: str) -> str:
        """Sorted set of one tenant's batch ids (see :attr:`batches`). Bound: as
        :attr:`batches`; the janitor drops the ids of batches that are gone."""
        return f"{self.base}:batches:of:{tenant}"

    def login_failures(self, address: str) -> str:
        """Counter of a client address's failed dashboard sign-ins. Bound: expires a
        minute after the first."""
        return f"{self.base}:login:{address}"

    @property
    def batches(self) -> str:
        """Sorted set of batch ids scored by creation time. Bound: an ended batch's
        record and lists expire PARKQ_BATCH_RETENTION_SECONDS after it ends; listing
        drops ids whose record is gone."""
        return f"{self.base}:batches"

    def batch(self, batch_id: str) -> str:
        """Hash of one batch: the OpenAI batch object's fields and its counts."""
        return f"{self.base}:batch:{batch_id}"

    def batch_items(self, batch_id: str) -> str:
        """List of a batch's valid lines in input order: ``{"custom_id", "job"}`` JSON."""
        return f"{self.base}:batch:{batch_id}:items"

    def batch_pending(self, batch_id: str) -> str:
        """List of the job ids of a batch's lines not yet in the queue, in order."""
        return f"{self.base}:batch:{batch_id}:pending"

    @property
    def pending_prefix(self) -> str:
        return f"{self.base}:pending:"

    def pending(self, job_id: str) -> str:
        """Hash of a batch line's job record before it is queued (renamed to its job key)."""
        return f"{self.pending_prefix}{job_id}"

    def batch_live(self, batch_id: str) -> str:
        """Set of a batch's job ids in the queue or running (at most the window)."""
        return f"{self.base}:batch:{batch_id}:live"

    def batch_invalid(self, batch_id: str) -> str:
        """List of error-file lines for a batch's invalid input lines."""
        return f"{self.base}:batch:{batch_id}:invalid"

    def batch_lock(self, batch_id: str) -> str:
        """Held while one web process writes a batch's output files."""
        return f"{self.base}:batch:{batch_id}:lock"

    def batch_validation_lock(self, batch_id: str) -> str:
        """Held (with a TTL) while one web thread validates a batch's input file."""
        return f"{self.base}:batch:{batch_id}:validating"
