"""Fair turns between tenants at one priority level, pure.

A waiting job's key is ``level * level_seconds - start`` (scheduler/policy.py),
where ``start`` is its *fair start*: when its tenant's earlier jobs at that
level are due to have had their share of the engine. For the tenant's clock
``c`` at the level, a job arriving at ``now`` expected to take ``tokens``
starts at ``max(now, c)`` and moves the clock to ``start + tokens / (weight *
rate)``. A tenant with nothing waiting at the level (the job that last moved
its clock is no longer queued or parked) starts at ``now``, whatever its clock
says: what it was charged for has run, or was cancelled. This is a virtual
clock (start-time fair queueing): the key stays static (the queue never needs
rescoring), so the claim costs what it did, and the enqueue reads one hash
and one job state more.

``rate`` is half what one busy sequence generates (tokens per second, measured
by the janitor: SAFETY). The turns follow the weights while the clocks of the
tenants that keep jobs waiting run ahead of real time, that is while each one's
share of the engine is at least ``weight * rate``: up to about twice as many
such tenants of weight 1 as the engine has sequences. With more, their clocks
fall behind and their jobs run in order of arrival among them (a newcomer
still starts at ``now``, ahead of none of their overdue jobs). A rate below
the real one costs nothing within a level; it moves a backlogged tenant's
later jobs behind other levels' sooner.

Invariants (tests/unit/test_fairness.py checks them against the Lua):
- a tenant's own jobs keep their order at a level (its clock only moves on
  while it has jobs waiting there);
- a tenant with nothing waiting starts at ``now``: a job of a tenant that
  sends one request is ranked as before, however many jobs another tenant sent;
- two tenants that keep jobs waiting are served in proportion to their weights,
  in expected tokens: a job's prompt and the larger of its tenant's usual output
  and its tenant's usual share of max_tokens times its own, at most its
  max_tokens (all of it before any of the tenant's jobs finished; each
  finished job moves both averages, see ``OUTPUT_WEIGHT``). A size expected
  too large, like a rate too low, spaces the tenant's own jobs further and
  costs nothing within the level;
- levels still order as before, and the starvation bound holds from a job's
  fair start (at most its arrival plus its tenant's earlier waiting work at the
  level over the tenant's share of the engine) instead of its arrival.

What it does not do: jobs already waiting keep their start when the measured
rate or the usual output changes, and a job cancelled among a tenant's waiting
ones leaves the later ones where they were.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_OUTPUT",
    "DEFAULT_RATE",
    "MIN_RATE",
    "OUTPUT_WEIGHT",
    "SAFETY",
    "next_rate",
]

#: Output tokens expected of a job of a tenant none of whose jobs finished yet.
DEFAULT_OUTPUT = 256
#: Engine tokens per second turns are taken at until the janitor has measured
#: the engine: low, as every rate used here is meant to be (see SAFETY).
DEFAULT_RATE = 50.0
#: Turns are taken at this share of the measured rate per busy sequence (see
#: the module's docstring).
SAFETY = 0.5
#: The lowest rate the janitor writes.
MIN_RATE = 5.0
#: How much of a tenant's usual output one finished job makes (lib.lua's fair_output).
OUTPUT_WEIGHT = 0.2
#: How much of the measured rate one sweep's sample makes (about the last ten
#: sweeps count).
RATE_WEIGHT = 0.1


def next_rate(
    rate: float | None, tokens: float, seconds: float, sequences: float = 1.0
) -> float | None:
    """The measured rate per busy sequence after a sweep during which
    ``sequences`` sequences (on average) ran throughout and jobs that ended
    counted ``tokens`` (their prompt and output) in ``seconds``; ``rate``: the
    measure before (None: none yet). Counted as jobs end, a job's tokens come
    in at once: a sweep with none counts too, and the average over about ten
    sweeps smooths them out."""
    if seconds <= 0 or tokens < 0:
        return rate
    sample = tokens / seconds / max(1.0, sequences)
    if rate is None:
        return sample if sample > 0 else None
    return (1 - RATE_WEIGHT) * rate + RATE_WEIGHT * sample
