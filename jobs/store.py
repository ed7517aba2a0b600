"""The Redis side of scheduling: enqueue, claim, per-step writes, finish, cancel.

Every multi-key change is one Lua script (``scheduler/lua``), so a job is never
half enqueued, half claimed or half cancelled. Key names come from
:class:`scheduler.keys.Keys` only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from jobs.events import DONE, error_event
from scheduler.keys import Keys
from scheduler.policy import Policy
from scheduler.settings import Settings
from scheduler.state import JobState, sources

__all__ = ["Claim", "Fenced", "Store"]


def _script(name: str) -> str:
    return resources.files("scheduler").joinpath("lua", f"{name}.lua").read_text()


def _states(*states: JobState) -> str:
    return ",".join(s.value for s in states)


class Fenced(Exception):
    """This execution no longer owns the job; it must stop writing."""


@dataclass(frozen=True)
class Claim:
    job_id: str
    exec_token: str
    previous_state: JobState


class Store:
    """parkq's job records in Redis, for the web process and the workers."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.keys: Keys = settings.keys
        self.policy: Policy = settings.policy
        self.result_ttl = settings.result_ttl
        self._enqueue = client.register_script(_script("enqueue"))
        self._claim = client.register_script(_script("claim"))
        self._step = client.register_script(_script("step"))
        self._finish = client.register_script(_script("finish"))
        self._cancel = client.register_script(_script("cancel"))

    # -- web side ---------------------------------------------------------

    def enqueue(
        self, job_id: str, kind: str, request: dict[str, Any], level: int, now: float
    ) -> bool:
        """Store a new job and make it wait; False if the id is taken."""
        fields: dict[str, str] = {
            "id": job_id,
            "kind": kind,
            "request": json.dumps(request, separators=(",", ":")),
            "priority": str(level),
            "state": JobState.QUEUED.value,
            "created_at": repr(now),
            "enqueued_at": repr(now),
            "seq": "0",
            "tokens": "0",
            "exec": "0",
            "preemptions": "0",
        }
        flat = [x for kv in fields.items() for x in kv]
        k = self.keys
        done = self._enqueue(
            keys=[k.job(job_id), k.queue, k.wake, k.jobs],
            args=[job_id, repr(self.policy.score(level, now)), repr(now), *flat],
        )
        return bool(done)

    def cancel(self, job_id: str, now: float) -> str | None:
        """Cancel a job. Returns None if unknown, else what happened."""
        k = self.keys
        payloads = [error_event("The job was cancelled.", "cancelled", "job_cancelled"), DONE]
        result = self._cancel(
            keys=[k.job(job_id), k.queue, k.events(job_id)],
            args=[
                job_id,
                k.channel(job_id),
                repr(now),
                self.result_ttl,
                _states(JobState.QUEUED, JobState.PARKED),
                _states(JobState.RUNNING, JobState.PARKING),
                *payloads,
            ],
        )
        return None if result is None else _text(result)

    def get(self, job_id: str) -> dict[str, str] | None:
        raw = self.r.hgetall(self.keys.job(job_id))
        if not raw:
            return None
        return {_text(a): _text(b) for a, b in raw.items()}

    def queue_position(self, job_id: str) -> int | None:
        rank = self.r.zrank(self.keys.queue, job_id)
        return None if rank is None else int(rank)

    def events_after(
        self, job_id: str, seq: int, count: int | None = None
    ) -> list[tuple[int, str]]:
        """Events with sequence numbers above ``seq``, in order."""
        entries = self.r.xrange(self.keys.events(job_id), min=f"({seq}-0", max="+", count=count)
        return [(int(_text(eid).split("-", 1)[0]), _text(f[b"d"])) for eid, f in entries]

    def workers_alive(self, now: float) -> list[str]:
        return [_text(n) for n in self.r.zrangebyscore(self.keys.workers, now, "+inf")]

    # -- worker side ------------------------------------------------------

    def heartbeat(self, worker: str, now: float, ttl: float) -> None:
        self.r.zadd(self.keys.workers, {worker: now + ttl})

    def remove_worker(self, worker: str) -> None:
        with self.r.pipeline() as p:
            p.zrem(self.keys.workers, worker)
            p.delete(self.keys.worker(worker))
            p.execute()

    def wait_for_work(self, timeout: float) -> None:
        """Block until a job is enqueued or ``timeout`` passes."""
        self.r.blpop([self.keys.wake], timeout=timeout)

    def claim(self, worker: str, now: float) -> Claim | None:
        k = self.keys
        got = self._claim(
            keys=[k.queue, k.worker(worker)],
            args=[
                k.job_prefix,
                worker,
                repr(now),
                _states(*sources(JobState.RUNNING)),
            ],
        )
        if not got:
            return None
        job_id, token, previous = (_text(x) for x in got)
        return Claim(job_id, token, JobState(previous))

    def step(
        self, job_id: str, exec_token: str, worker: str, tokens: int, payloads: list[str]
    ) -> int:
        """Write one step's events; return the control flags (1 cancel, 2 preempt)."""
        k = self.keys
        flags = int(
            self._step(
                keys=[k.job(job_id), k.events(job_id), k.worker(worker)],
                args=[exec_token, k.channel(job_id), tokens, *payloads],
            )
        )
        if flags < 0:
            raise Fenced(job_id)
        return flags

    def finish(
        self,
        job_id: str,
        exec_token: str,
        worker: str,
        state: JobState,
        fields: dict[str, str],
        payloads: list[str],
        now: float | None = None,
    ) -> None:
        """Move a job to a terminal state with its last events."""
        k = self.keys
        flat = [x for kv in fields.items() for x in kv]
        result = int(
            self._finish(
                keys=[k.job(job_id), k.events(job_id), k.worker(worker)],
                args=[
                    exec_token,
                    k.channel(job_id),
                    state.value,
                    _states(*sources(state)),
                    repr(time.time() if now is None else now),
                    self.result_ttl,
                    len(fields),
                    *flat,
                    *payloads,
                ],
            )
        )
        if result == -1:
            raise Fenced(job_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
