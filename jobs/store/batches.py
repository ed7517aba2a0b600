"""Files and batches (the OpenAI Batch API) in Redis.

A batch's valid lines become jobs, but not all at once: each line's job
record waits in a pending hash, and :meth:`BatchStore.feed` moves up to
``batch_window`` of them into the queue at a time (one Lua script, so two
callers never overfill it). A batch of 50,000 lines therefore neither fills
the queue nor, as its lines age, gets ahead of interactive requests. Whoever
ends one of its jobs (the worker, a cancel, the reaper) or reads the batch
feeds it again; feeding is idempotent.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from jobs.store.scheduling import Store
from jobs.store.telemetry import as_text
from scheduler.policy import PRIORITY_LEVELS
from scheduler.state import LIVE, JobState

__all__ = ["BATCH_LEVEL", "BatchStore", "Counts", "Item", "new_id"]

BATCH_LEVEL = PRIORITY_LEVELS["batch"]

#: States of a job that still holds a place in its batch's window.


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Item:
    """One valid line of a batch: its ``custom_id`` and its job id."""

    custom_id: str
    job: str


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    failed: int
    #: Lines whose job has not ended (pending in the batch, queued or running).
    open: int


class BatchStore:
    """Files, batches and their lines, next to the jobs of ``store``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.r: redis.Redis = store.r
        self.keys = store.keys
        self.settings = store.settings

    # -- files ------------------------------------------------------------

    def create_file(
        self,
        filename: str,
        purpose: str,
        content: bytes,
        now: float,
        expires_at: int | None = None,
        owner: str = "",
    ) -> dict[str, Any]:
        """Store a file; one with ``expires_at`` is deleted then. ``owner``: the
        tenant that may see it ('' without API keys)."""
        file_id = new_id("file")
        meta: dict[str, Any] = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(now),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        if expires_at is not None:
            meta["expires_at"] = expires_at
        if owner:
            meta["owner"] = owner
        k = self.keys
        # One connection, no MULTI (a WAIT inside one returns at once): the content
        # and its expiry first, the record and the indexes last, so a write cut
        # short leaves no file anyone can see.
        with self.r.pipeline(transaction=False) as p:
            p.set(k.file_content(file_id), content)
            if expires_at is not None:
                p.expireat(k.file_content(file_id), expires_at)
            p.hset(k.file(file_id), mapping={key: str(v) for key, v in meta.items()})
            if expires_at is not None:
                p.expireat(k.file(file_id), expires_at)
            p.zadd(k.files, {file_id: now})
            if owner:
                p.zadd(k.files_of(owner), {file_id: now})
            waited = self.store.durable(p)
            replies = p.execute(raise_on_error=False)
        self._check(replies, waited)
        return self.file_object(meta)

    def write_file(
        self,
        filename: str,
        purpose: str,
        chunks: Iterator[bytes],
        now: float,
        expires_at: int,
        pending_seconds: int = 3600,
        owner: str = "",
    ) -> dict[str, Any] | None:
        """A file written piece by piece (a large batch's output, never whole in
        memory); None when ``chunks`` holds nothing. Until its record is written
        its content expires after ``pending_seconds`` (a writer that dies leaves
        nothing behind for good)."""
        file_id = new_id("file")
        k = self.keys
        size = 0
        try:
            for chunk in chunks:
                with self.r.pipeline() as p:
                    p.append(k.file_content(file_id), chunk)
                    p.expire(k.file_content(file_id), pending_seconds)
                    p.execute()
                size += len(chunk)
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                self.r.delete(k.file_content(file_id))  # no partial file left behind
            raise
        if size == 0:
            return None
        meta: dict[str, Any] = {
            "id": file_id, "object": "file", "bytes": size, "created_at": int(now),
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": expires_at, **({"owner": owner} if owner else {}),
        }  # fmt: skip
        with self.r.pipeline() as p:
            p.hset(k.file(file_id), mapping={key: str(v) for key, v in meta.items()})
            p.zadd(k.files, {file_id: now})
            if owner:
                p.zadd(k.files_of(owner), {file_id: now})
            p.expireat(k.file_content(file_id), expires_at)
            p.expireat(k.file(file_id), expires_at)
            p.execute()
        return self.file_object(meta)

    def _check(self, replies: list[Any], waited: bool) -> None:
        """Raise the first failed write of a pipeline; a WAIT at its end (``waited``)
        only logs (:meth:`Store.acked`)."""
        writes = replies[:-1] if waited else replies
        for reply in writes:
            if isinstance(reply, Exception):
                raise reply
        if waited:
            self.store.acked(replies[-1])

    @staticmethod
    def file_object(meta: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": meta["id"],
            "object": "file",
            "bytes": int(meta["bytes"]),
            "created_at": int(meta["created_at"]),
            "filename": meta["filename"],
            "purpose": meta["purpose"],
            "status": meta.get("status", "processed"),
            "expires_at": int(meta["expires_at"]) if meta.get("expires_at") else None,
            "status_details": None,
        }

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        record = self.file_record(file_id)
        return None if record is None else self.file_object(record)

    def file_record(self, file_id: str) -> dict[str, str] | None:
        """A file's stored record (its ``owner`` too); None if there is none."""
        raw = self.r.hgetall(self.keys.file(file_id))
        if not raw:
            return None
        return {as_text(a): as_text(b) for a, b in raw.items()}

    def file_content(self, file_id: str) -> bytes | None:
        data = self.r.get(self.keys.file_content(file_id))
        return None if data is None else bytes(data)

    def list_files(
        self, purpose: str | None = None, owner: str | None = None
    ) -> list[dict[str, Any]]:
        """The newest 10,000 files (of tenant ``owner``; None: of everyone)."""
        index = self.keys.files if owner is None else self.keys.files_of(owner)
        ids = [as_text(x) for x in self.r.zrevrange(index, 0, 9999)]
        found = {i: self.get_file(i) for i in ids}
        gone = [i for i, f in found.items() if f is None]
        if gone:  # expired files: forget their ids too
            self.r.zrem(index, *gone)
        files = [f for f in found.values() if f is not None]
        return [f for f in files if purpose is None or f["purpose"] == purpose]

    def uploaded_bytes(self, owner: str = "") -> int:
        """Bytes of the uploaded files of tenant ``owner`` still kept (not batches'
        outputs; '': every file, the one tenant without API keys). Summed from the
        records that exist, so a deleted or expired file is never counted; forgets
        the ids of those from the index it read."""
        index = self.keys.files_of(owner) if owner else self.keys.files
        ids = [as_text(x) for x in self.r.zrange(index, 0, -1)]
        rows: list[Any] = []
        for start in range(0, len(ids), 1000):
            with self.r.pipeline(transaction=False) as p:
                for file_id in ids[start : start + 1000]:
                    p.hmget(self.keys.file(file_id), ["bytes", "purpose"])
                rows.extend(p.execute())
        gone = [i for i, (size, _) in zip(ids, rows, strict=True) if size is None]
        if gone:
            self.r.zrem(index, *gone)
        return sum(
            int(size)
            for size, purpose in rows
            if size is not None and purpose is not None and as_text(purpose) == "batch"
        )

    def delete_file(self, file_id: str) -> bool:
        k = self.keys
        owner = self.r.hget(k.file(file_id), "owner")
        with self.r.pipeline() as p:
            p.delete(k.file(file_id), k.file_content(file_id))
            p.zrem(k.files, file_id)
            if owner:
                p.zrem(k.files_of(as_text(owner)), file_id)
            deleted = p.execute()[0]
        return bool(deleted)

    def prune_indexes(self) -> int:
        """Drop from every tenant's file and batch index the ids whose records are
        gone (expired, deleted); how many. The all-tenant indexes are pruned as
        they are read."""
        k = self.keys
        dropped = 0
        for pattern, record in ((k.files_of("*"), k.file), (k.batches_of("*"), k.batch)):
            for index in self.r.scan_iter(match=pattern, count=1000):
                ids = [as_text(x) for x in self.r.zrange(index, 0, -1)]
                for start in range(0, len(ids), 1000):
                    chunk = ids[start : start + 1000]
                    with self.r.pipeline(transaction=False) as p:
                        for item in chunk:
                            p.exists(record(item))
                        there = p.execute()
                    gone = [i for i, n in zip(chunk, there, strict=True) if not n]
                    if gone:
                        dropped += int(self.r.zrem(index, *gone))
        return dropped

    # -- batches ------------------------------------------------------------

    def create_batch(
        self,
        record: dict[str, str],
        lines: list[tuple[str, str, str, dict[str, Any], dict[str, str]]],
        invalid: list[dict[str, Any]],
        now: float,
    ) -> None:
        """Store a batch: ``lines`` are (job id, custom_id, kind, request, extra record
        fields) of its valid lines (each becomes a pending job), ``invalid`` the
        error-file lines of the others."""
        k = self.keys
        batch_id = record["id"]
        with self.r.pipeline(transaction=False) as p:
            for start in range(0, len(lines), 1000):
                items, pending = [], []
                level = int(record.get("level", BATCH_LEVEL))
                for job_id, custom_id, kind, request, extra in lines[start : start + 1000]:
                    fields = self.store.job_fields(job_id, kind, request, level, now,
                                                   record.get("owner", ""))  # fmt: skip
                    cost = len(request.get("prompt_ids", ())) + int(request.get("max_tokens", 0))
                    fields.update(extra, batch=batch_id, custom_id=custom_id, cost=str(cost))
                    if record.get("max_running"):  # its tenant's (claim.lua reads it)
                        fields["max_running"] = record["max_running"]
                    p.hset(k.pending(job_id), mapping=fields)
                    items.append(json.dumps({"custom_id": custom_id, "job": job_id}))
                    pending.append(job_id)
                p.rpush(k.batch_items(batch_id), *items)
                p.rpush(k.batch_pending(batch_id), *pending)
                p.execute()
            if invalid:
                p.rpush(k.batch_invalid(batch_id), *(json.dumps(x) for x in invalid))
            p.hset(k.batch(batch_id), mapping=record)
            p.zadd(k.batches, {batch_id: now})
            if record.get("owner"):
                p.zadd(k.batches_of(record["owner"]), {batch_id: now})
            waited = self.store.durable(p)
            replies = p.execute(raise_on_error=False)
        self._check(replies, waited)

    def create_record(self, record: dict[str, str], now: float) -> None:
        """Store a batch's record alone (it is validated next; its lines come later).
        A record with an ``owner`` is listed in its tenant's index too."""
        with self.r.pipeline(transaction=False) as p:
            p.hset(self.keys.batch(record["id"]), mapping=record)
            p.zadd(self.keys.batches, {record["id"]: now})
            if record.get("owner"):
                p.zadd(self.keys.batches_of(record["owner"]), {record["id"]: now})
            waited = self.store.durable(p)
            replies = p.execute(raise_on_error=False)
        self._check(replies, waited)

    def transition(self, batch_id: str, expected: str, fields: dict[str, str]) -> bool:
        """Write ``fields`` only if the batch's status is still ``expected`` (atomic)."""
        key = self.keys.batch(batch_id)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(key)
                    if as_text(p.hget(key, "status") or b"") != expected:
                        p.unwatch()
                        return False
                    p.multi()
                    p.hset(key, mapping=fields)
                    p.execute()
                    return True
                except redis.WatchError:
                    continue

    def get(self, batch_id: str) -> dict[str, str] | None:
        raw = self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        return {as_text(a): as_text(b) for a, b in raw.items()}

    def update(self, batch_id: str, fields: dict[str, str]) -> None:
        self.r.hset(self.keys.batch(batch_id), mapping=fields)

    def end(self, batch_id: str, fields: dict[str, str], also: Callable[[Pipeline], Any]) -> bool:
        """Write a batch's final ``fields`` and whatever ``also`` adds (its webhook
        event) in one transaction, neither without the other, unless it has ended
        already (a finalizer whose lock lapsed meanwhile): whether this ended it."""
        key = self.keys.batch(batch_id)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(key)
                    if p.hexists(key, "total"):
                        p.unwatch()
                        return False
                    p.multi()
                    p.hset(key, mapping=fields)
                    also(p)
                    p.execute()
                    return True
                except redis.WatchError:
                    continue

    def list_ids(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> tuple[list[str], bool]:
        """Batch ids, newest first, after the id ``after``; and whether more follow
        (of tenant ``owner``; None: of everyone)."""
        index = self.keys.batches if owner is None else self.keys.batches_of(owner)
        start = 0
        if after is not None:
            rank = self.r.zrevrank(index, after)
            if rank is None:
                return [], False
            start = int(rank) + 1
        ids = [as_text(x) for x in self.r.zrevrange(index, start, start + limit)]
        gone = [i for i, there in zip(ids, self._exist(ids), strict=True) if not there]
        if gone:  # past their retention: forget them here, and list the next ones
            self.r.zrem(index, *gone)
            return self.list_ids(after, limit, owner)
        return ids[:limit], len(ids) > limit

    def _exist(self, batch_ids: list[str]) -> list[bool]:
        with self.r.pipeline(transaction=False) as p:
            for batch_id in batch_ids:
                p.exists(self.keys.batch(batch_id))
            return [bool(n) for n in p.execute()]

    def retain(self, batch_id: str) -> None:
        """The batch has ended: keep its record for the retention period, then let it go."""
        k, ttl = self.keys, self.settings.batch_retention_seconds
        with self.r.pipeline(transaction=False) as p:
            for key in (k.batch(batch_id), k.batch_items(batch_id), k.batch_invalid(batch_id),
                        k.batch_live(batch_id), k.batch_pending(batch_id)):  # fmt: skip
                p.expire(key, ttl)
            p.execute()

    def feed(self, batch_id: str, now: float | None = None) -> int:
        """Top the batch's window up from its pending lines (at the level and
        token rate its tenant had when it was created); how many were queued."""
        now = time.time() if now is None else now
        owner, level, rate, window, weight, capped = self.r.hmget(
            self.keys.batch(batch_id), "owner", "level", "tokens_per_minute", "window", "weight",
            "max_running",
        )  # fmt: skip
        score = self.store.policy.score(int(level) if level else BATCH_LEVEL, now)
        size = int(window) if window else self.settings.batch_window  # its tenant's weight
        fed = self.store.feed_batch(batch_id, size, score, now, as_text(owner or b""),
                                    int(rate or 0), float(weight or 1.0), bool(capped))  # fmt: skip
        return int(fed)

    def items(self, batch_id: str) -> Iterator[Item]:
        key = self.keys.batch_items(batch_id)
        n = int(self.r.llen(key))
        for start in range(0, n, 1000):
            for raw in self.r.lrange(key, start, start + 999):
                d = json.loads(raw)
                yield Item(d["custom_id"], d["job"])

    def invalid_lines(self, batch_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(self.keys.batch_invalid(batch_id), 0, -1)]

    def states(self, items: list[Item]) -> list[str | None]:
        """Each item's job state (None: still pending in the batch, or expired)."""
        out: list[str | None] = []
        for start in range(0, len(items), 1000):
            with self.r.pipeline(transaction=False) as p:
                for item in items[start : start + 1000]:
                    p.hget(self.keys.job(item.job), "state")
                out.extend(None if s is None else as_text(s) for s in p.execute())
        return out

    def counts(self, batch_id: str, invalid: int) -> tuple[Counts, list[Item], list[str | None]]:
        items = list(self.items(batch_id))
        states = self.states(items)
        pending = int(self.r.llen(self.keys.batch_pending(batch_id)))
        completed = sum(1 for s in states if s == JobState.FINISHED)
        failed = sum(1 for s in states if s == JobState.FAILED) + invalid
        live = sum(1 for s in states if s in LIVE)
        counts = Counts(len(items) + invalid, completed, failed, live + pending)
        return counts, items, states

    def drop_pending(self, batch_id: str) -> list[str]:
        """Remove the lines not yet queued (a cancelled batch); their job ids."""
        k = self.keys
        ids = [as_text(x) for x in self.r.lrange(k.batch_pending(batch_id), 0, -1)]
        with self.r.pipeline() as p:
            p.delete(k.batch_pending(batch_id))
            for start in range(0, len(ids), 1000):
                p.delete(*(k.pending(i) for i in ids[start : start + 1000]))
            p.execute()
        return ids

    def forget_lines(self, batch_id: str) -> list[str]:
        """Remove every line stored for a batch still validating (none was fed):
        its items, invalid lines and pending lines; the pending lines' job ids."""
        ids = self.drop_pending(batch_id)
        self.r.delete(self.keys.batch_items(batch_id), self.keys.batch_invalid(batch_id))
        return ids

    def live_jobs(self, batch_id: str) -> list[str]:
        return [as_text(x) for x in self.r.smembers(self.keys.batch_live(batch_id))]

    def release_results(self, items: list[Item]) -> None:
        """The batch's output is written: its jobs' records now expire like any job's,
        and their per-token events after the replay window (the output file holds
        their results)."""
        events_ttl = min(self.settings.replay_seconds, self.store.result_ttl)
        for start in range(0, len(items), 1000):
            with self.r.pipeline(transaction=False) as p:
                for item in items[start : start + 1000]:
                    p.expire(self.keys.job(item.job), self.store.result_ttl)
                    p.expire(self.keys.events(item.job), events_ttl)
                p.execute()

    def lock(self, batch_id: str, seconds: int = 300) -> bool:
        return bool(self.r.set(self.keys.batch_lock(batch_id), "1", nx=True, ex=seconds))

    def renew_lock(self, batch_id: str, seconds: int = 300) -> None:
        """Keep holding the batch's lock (a long finalization)."""
        self.r.expire(self.keys.batch_lock(batch_id), seconds)

    def unlock(self, batch_id: str) -> None:
        self.r.delete(self.keys.batch_lock(batch_id))

    def lock_validation(self, batch_id: str, seconds: int) -> bool:
        """Taken by the one thread validating the batch's input; it expires if that
        thread's process dies, and a later read of the batch starts another."""
        key = self.keys.batch_validation_lock(batch_id)
        return bool(self.r.set(key, "1", nx=True, ex=seconds))

    def unlock_validation(self, batch_id: str) -> None:
        self.r.delete(self.keys.batch_validation_lock(batch_id))
