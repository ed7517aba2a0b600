"""One claimed job on a worker, as values: the :class:`Job` read at its claim,
and the :class:`StepWriter` that writes its steps' events and reads back the
control flags (cancel, park) that steer its generation.

The worker runs a job as claim -> plan -> drive -> apply: it reads the job
(:class:`Job`), plans where its KV comes from (a :class:`jobs.runner.Start`),
drives its generation (each step's events through a :class:`StepWriter`),
and applies the outcome (finished, cancelled or parked).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jobs.generation import Generation, GenerationRequest
from jobs.store import Claim
from scheduler.policy import PRIORITY_LEVELS, priority_label
from scheduler.settings import Settings

__all__ = ["Job", "StepWriter", "Write"]


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
