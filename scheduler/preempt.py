"""When a waiting job interrupts a running one, and which one, pure.

Keys are the time-independent ordering keys of :mod:`scheduler.policy`
(higher runs first). A runner is described by its key and ``since``, the time
it started or last resumed; the caller passes ``now``.

Invariants:
- a waiting job preempts only a runner whose key it beats by more than
  ``margin`` (hysteresis: two jobs of near-equal keys never ping-pong);
- a runner keeps the engine for at least ``min_run_seconds`` after it starts
  or resumes (every job makes progress between preemptions);
- with several runners, the victim is the one with the lowest key among those
  past their minimum run time; no victim while a worker is idle.
- waiting is bounded: a key never changes while it waits, and a job that
  arrives ``d`` seconds later than it has key lower by ``aging_rate * d``, so
  after at most ``level_gap * level_seconds + margin / aging_rate`` seconds no
  newly arriving job can preempt it or run before it. (With tenants' fair
  turns the bound holds for the place: a job may give its place to another
  tenant's job of its level and take that one's, scheduler/fairness.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PreemptPolicy", "Runner", "choose_victim", "starvation_bound"]


@dataclass(frozen=True)
class PreemptPolicy:
    #: A waiting key must beat the runner's key by more than this.
    margin: float = 1.0
    #: Seconds a runner keeps the engine after it starts or resumes.
    min_run_seconds: float = 0.1

    def beats(self, waiting_key: float, runner_key: float) -> bool:
        return waiting_key > runner_key + self.margin

    def ripe(self, since: float, now: float) -> bool:
        """Has a runner that started or resumed at ``since`` had its minimum run time?"""
        return now - since >= self.min_run_seconds

    def should_preempt(self, waiting_key: float, runner: Runner, now: float) -> bool:
        return self.beats(waiting_key, runner.key) and self.ripe(runner.since, now)


@dataclass(frozen=True)
class Runner:
    worker: str
    job_id: str
    key: float
    since: float


def choose_victim(
    policy: PreemptPolicy,
    waiting_key: float,
    runners: Sequence[Runner],
    idle_workers: int,
    now: float,
) -> Runner | None:
    """The runner that a job with ``waiting_key`` should interrupt now, if any."""
    if idle_workers > 0:
        return None
    candidates = [r for r in runners if policy.should_preempt(waiting_key, r, now)]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.key, r.worker))


def starvation_bound(
    level_gap: int, level_seconds: float, aging_rate: float, margin: float
) -> float:
    """Seconds after which no newly arriving job of at most ``level_gap`` levels
    higher can preempt or overtake a waiting job (the waiting time is then
    bounded by the work already ahead of it)."""
    return level_gap * level_seconds + margin / aging_rate
