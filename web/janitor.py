"""The janitor of `parkq web`: what keeps Redis bounded when nobody reads.

Every PARKQ_JANITOR_SECONDS one web process (whichever holds the Redis lock)
sweeps:

- the jobs that ended since its last sweep (Keys.ended): a finished job's
  result, the non-streamed response body (text, tool calls, logprobs,
  finish reason), is kept in its record for PARKQ_RESULT_TTL, and its
  per-token events expire PARKQ_REPLAY_SECONDS later (a reconnect with
  Last-Event-ID replays them until then; GET /v1/jobs/<id>/result answers
  after);
- every batch still open, as a read of it would: its next lines are queued,
  and once all have ended its output and error files are written, so a batch
  nobody reads still releases its lines (their events go after the replay
  window too).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from flask import Flask

from jobs.store.batches import BatchStore
from jobs.store.scheduling import Store
from jobs.store.telemetry import as_text
from scheduler.state import JobState
from web.responses import result_of

__all__ = ["Janitor", "compact_ended"]

log = logging.getLogger(__name__)

#: Ended jobs read from the list at a time; a sweep goes on until the list is
#: empty or SWEEP_SECONDS have passed.
SWEEP = 500
SWEEP_SECONDS = 2.0
#: Sets a job's kept result only while its record exists (never a bare record
#: that would outlive its TTL).
_SET_RESULT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HSET', KEYS[1], 'result', ARGV[1])
end
return 0
"""
#: How many entries of jobs no longer waiting a sweep drops from each tenant's
#: queue of fair turns (the claim drops them too: lib.lua's fair_first).
FAIR_BUDGET = 100
#: The longest wait between two sweeps after failed ones.
BACKOFF_SECONDS = 30.0
#: Batches are looked at every this many sweeps (each look reads every line's state).
BATCH_EVERY = 6
#: Batch states whose lines may still run or whose files are not written yet.
OPEN_BATCH = ("validating", "in_progress", "cancelling", "finalizing")


@dataclass
class Swept:
    compacted: int = 0
    batches: int = 0


def compact_ended(store: Store, replay_seconds: int, seconds: float = SWEEP_SECONDS) -> int:
    """Keep the results of the finished jobs that ended, then let their events
    expire after ``replay_seconds``, until none is left or ``seconds`` have
    passed; how many were done. A job's events expire only once its result is
    written (they are its only copy until then): a job whose result Redis
    refuses to take (maxmemory: OOM, any error reply) stays listed, events
    untouched, for the next sweep, and the others go on (their expiry frees
    memory even while Redis refuses writes); each is tried once a sweep. A
    job whose result cannot be made (its own data) is logged and its events
    expire all the same. Redis gone (a connection error) ends the sweep."""
    k = store.keys
    done, kept, end = 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        ids = [as_text(raw) for raw in store.r.zrange(k.ended, kept, kept + SWEEP - 1)]
        if not ids:
            break
        for job_id in ids:
            if _compact(store, job_id, replay_seconds):
                store.r.zrem(k.ended, job_id)
                done += 1
            else:
                kept += 1  # (left listed: the next page starts past it)
        if len(ids) < SWEEP:
            break
    return done


def _compact(store: Store, job_id: str, replay_seconds: int) -> bool:
    """Keep one ended job's result and shorten its events' life; False when
    Redis refused the result (the job stays listed, its events as they were)."""
    k = store.keys
    try:
        _keep_result(store, job_id)
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # Redis gone: the sweep ends
    except redis.RedisError as exc:
        log.warning("job %s: its result was not kept (%s); tried again later", job_id, exc)
        return False
    except Exception:
        log.exception("job %s: could not keep its result", job_id)
    ttl = int(store.r.ttl(k.events(job_id)))
    if ttl == -1 or ttl > replay_seconds:
        store.r.expire(k.events(job_id), replay_seconds)
    return True


def _keep_result(store: Store, job_id: str) -> None:
    """Write a finished job's response body into its record (once)."""
    k = store.keys
    state, kept = store.r.hmget(k.job(job_id), ["state", "result"])
    if state is None or kept is not None:
        return
    ended = JobState(as_text(state))
    # A response keeps what it wrote when it was cancelled or failed too: its
    # partial output stays readable (web/responses_api.py).
    partial = ended in (JobState.CANCELLED, JobState.FAILED) and bool(
        store.r.hexists(k.job(job_id), "response")
    )
    if ended is not JobState.FINISHED and not partial:
        return
    record = store.get(job_id)
    body = None if record is None else result_of(store, job_id, record)
    if body is not None:
        store.r.eval(_SET_RESULT, 1, k.job(job_id), json.dumps(body, separators=(",", ":")))


class Janitor:
    """The sweeping thread of one `parkq web` process."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        runtime = app.extensions["parkq"]
        self.store: Store = runtime.store
        self.settings = runtime.settings
        self._sweeps = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="parkq-janitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        every, failures = self.settings.janitor_seconds, 0
        while True:
            # After failed sweeps, longer waits (up to BACKOFF_SECONDS, or the
            # period when it is longer): a Redis refusing writes is not hammered.
            time.sleep(min(every * 2**failures, max(every, BACKOFF_SECONDS)))
            try:
                self.sweep()
                failures = 0
            except redis.RedisError as exc:  # down, failing over, refusing: later
                failures = min(failures + 1, 16)
                log.warning("the janitor's sweep stopped: Redis: %s", exc)
            except Exception:  # a bug: the next sweep tries again
                failures = min(failures + 1, 16)
                log.exception("the janitor's sweep failed")

    def sweep(self) -> Swept | None:
        """One sweep, if no other process is sweeping; what it did."""
        lock_ms = max(1000, int(self.settings.janitor_seconds * 1000))
        if not self.store.r.set(self.store.keys.janitor_lock, os.getpid(), nx=True, px=lock_ms):
            return None
        swept = Swept(compact_ended(self.store, self.settings.replay_seconds))
        self._feed_waiting()
        self._fair()
        self._sweeps += 1
        if self._sweeps % BATCH_EVERY == 1:
            swept.batches = self._batches()
            BatchStore(self.store).prune_indexes()
        return swept

    def _feed_waiting(self) -> None:
        """Feed the batches whose next line waited for its tenant's token rate and
        fits now (each sweep: a batch with no line running has nobody else to)."""
        k = self.store.keys
        due = self.store.r.zrangebyscore(k.batches_waiting, "-inf", time.time(), 0, 100)
        batches = BatchStore(self.store)
        for raw in due:
            batch_id = as_text(raw)
            self.store.r.zrem(k.batches_waiting, batch_id)  # fed again below, or noted again
            batches.feed(batch_id)

    def _fair(self) -> None:
        """Drop the fair clocks that no longer matter (scheduler/fairness.py)."""
        self.store.sweep_fair_turns(FAIR_BUDGET)
        self.store.r.unlink(self.store.keys.fair_earlier)  # (a development build's)

    def _batches(self) -> int:
        """Bring every open batch up to date as a read would; how many were open."""
        from web.batches import _batch_object

        batches = BatchStore(self.store)
        seen = 0
        ids = [as_text(raw) for raw in self.store.r.zrange(self.store.keys.batches, 0, -1)]
        statuses: list[Any] = []
        for start in range(0, len(ids), 1000):
            with self.store.r.pipeline(transaction=False) as p:
                for batch_id in ids[start : start + 1000]:
                    p.hget(self.store.keys.batch(batch_id), "status")
                statuses.extend(p.execute())
        # The all-tenant index loses the ids whose record has expired: it stays
        # as long as PARKQ_BATCH_RETENTION_SECONDS of batches, not all of them.
        gone = [batch_id for batch_id, status in zip(ids, statuses, strict=True) if status is None]
        for start in range(0, len(gone), 1000):
            self.store.r.zrem(self.store.keys.batches, *gone[start : start + 1000])
        with self.app.app_context():
            for batch_id, status in zip(ids, statuses, strict=True):
                if status is None or as_text(status) not in OPEN_BATCH:
                    continue
                seen += 1
                try:
                    _batch_object(batches, batch_id)
                except Exception:
                    log.exception("batch %s: the janitor could not bring it up to date", batch_id)
        return seen


def start_janitor(app: Flask) -> Any:
    janitor = Janitor(app)
    janitor.start()
    return janitor
