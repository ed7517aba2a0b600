"""Priorities and ordering, pure.

Effective priority of a waiting job at time ``now``::

    effective = P * level_seconds * aging_rate + aging_rate * (now - enqueued_at)

The ``aging_rate * now`` term is common to every job, so ordering by the
stored key ``P * level_seconds * aging_rate - aging_rate * enqueued_at`` is the
same ordering at every instant: the queue never needs rescoring. Redis sorted
sets pop the lowest score first, so the stored score is the negated key.

Invariants:
- a higher priority level is worth ``level_seconds`` of waiting: a job of
  level ``P`` that arrived ``d`` seconds later than a job of level ``P - 1``
  runs first exactly when ``d < level_seconds``;
- between equal levels the older job runs first (FIFO);
- a parked job goes back at the key it ran at, and so keeps the age it earned.

With tenants' fair turns (scheduler/fairness.py) a claim may give a job's
place to another job of its level; the two swap places, so the keys each
level holds, and so every other level's waits, are as described here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PRIORITY_LEVELS",
    "SERVICE_TIERS",
    "Policy",
    "priority_label",
    "priority_level",
    "tier_of",
]

#: Named priorities accepted by the API, as levels.
PRIORITY_LEVELS: dict[str, int] = {"batch": 0, "interactive": 10}

#: OpenAI's ``service_tier`` values as levels: ``priority`` one step above
#: interactive (as far above it as interactive is above batch), ``default`` and
#: ``auto`` interactive, ``flex`` batch. parkq's own ``priority`` wins when both
#: are given.
SERVICE_TIERS: dict[str, int] = {"priority": 20, "default": 10, "auto": 10, "flex": 0}

#: Integer priorities must lie in this range.
MIN_LEVEL = -1000
MAX_LEVEL = 1000


def priority_level(value: str | int) -> int:
    """Map an API ``priority`` value to a level; raise ``ValueError`` if invalid."""
    if isinstance(value, bool):
        raise ValueError("priority must be 'interactive', 'batch' or an integer")
    if isinstance(value, int):
        if not MIN_LEVEL <= value <= MAX_LEVEL:
            raise ValueError(f"integer priority must be between {MIN_LEVEL} and {MAX_LEVEL}")
        return value
    try:
        return PRIORITY_LEVELS[value]
    except KeyError:
        raise ValueError("priority must be 'interactive', 'batch' or an integer") from None


def tier_of(level: int) -> str:
    """The ``service_tier`` a job of ``level`` is served at (what a response
    echoes): ``priority`` from its level up, ``flex`` at the batch level and
    below, ``default`` between."""
    if level >= SERVICE_TIERS["priority"]:
        return "priority"
    return "default" if level > SERVICE_TIERS["flex"] else "flex"


def priority_label(level: int) -> str:
    """A metrics label for a level: its name, or 'other' for custom integers."""
    for name, value in PRIORITY_LEVELS.items():
        if value == level:
            return name
    return "other"


@dataclass(frozen=True)
class Policy:
    """The tunable numbers of the scheduling policy."""

    #: Seconds of waiting that one priority level is worth.
    level_seconds: float = 60.0
    #: Effective-priority units gained per second of waiting.
    aging_rate: float = 1.0

    def key(self, level: int, enqueued_at: float) -> float:
        """Time-independent ordering key: higher runs first."""
        return self.aging_rate * (level * self.level_seconds - enqueued_at)

    def score(self, level: int, enqueued_at: float) -> float:
        """Redis sorted-set score: lower runs first."""
        return -self.key(level, enqueued_at)

    def effective(self, level: int, enqueued_at: float, now: float) -> float:
        """Effective priority at ``now``, as the policy defines it. Nothing orders
        by it: :meth:`key` is static and orders the same at every instant, which
        tests/unit/test_policy.py checks against this definition."""
        return self.key(level, enqueued_at) + self.aging_rate * now
