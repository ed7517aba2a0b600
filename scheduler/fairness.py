"""Fair turns between tenants at one priority level, pure.

A waiting job's key is ``level * level_seconds - start`` (scheduler/policy.py),
where ``start`` is its *fair start*: when its tenant's earlier jobs at that
level are due to have had their share of the engine. For the tenant's clock
``c`` at the level, a job arriving at ``now`` expected to take ``tokens``
starts at ``max(now, c)`` and moves the clock to ``start + tokens / (weight *
rate)``, ``rate`` being the engine's measured tokens per second. A tenant with
nothing waiting at the level (the job that last moved its clock is no longer
queued or parked) starts at ``now``, whatever its clock says: what it was
charged for has run, or was cancelled. This is a virtual clock (start-time fair
queueing): the key stays static (the queue never needs rescoring), so the
claim costs what it did, and the enqueue reads one hash and one job state more.

Invariants (tests/unit/test_fairness.py checks them against the Lua):
- a tenant's own jobs keep their order at a level (its clock only moves on
  while it has jobs waiting there);
- a tenant with nothing waiting starts at ``now``: a job of a tenant that
  sends one request is ranked as before, however many jobs another tenant sent;
- two tenants that keep jobs waiting are served in proportion to their weights,
  in expected tokens (a job's prompt plus the tenant's usual output, at most its
  max_tokens: each finished job moves the usual output, see ``OUTPUT_WEIGHT``);
- levels still order as before, and the starvation bound holds from a job's
  fair start (at most its arrival plus its tenant's earlier waiting work at the
  level over the tenant's share of the engine) instead of its arrival.

What it does not do: jobs already waiting keep their start when the measured
rate or the usual output changes, and a job cancelled among a tenant's waiting
ones leaves the later ones where they were.
"""

from __future__ import annotations

__all__ = ["DEFAULT_OUTPUT", "DEFAULT_RATE", "MIN_RATE", "OUTPUT_WEIGHT", "next_rate"]

#: Output tokens expected of a job of a tenant none of whose jobs finished yet.
DEFAULT_OUTPUT = 256
#: Engine tokens per second assumed until the janitor has measured one: low, so
#: that a tenant's flood is spread out rather than left in front (a rate above
#: the real one would rank a flood's later jobs before a newcomer's).
DEFAULT_RATE = 50.0
#: The lowest rate the janitor writes (a busy minute of long prompts counts
#: few output tokens).
MIN_RATE = 5.0
#: How much of a tenant's usual output one finished job makes (lib.lua's fair_output).
OUTPUT_WEIGHT = 0.2
#: How much of the measured rate one sweep's sample makes (about the last ten
#: sweeps count).
RATE_WEIGHT = 0.1


def next_rate(rate: float | None, tokens: float, seconds: float) -> float | None:
    """The engine's rate after a sweep during which jobs ran throughout and
    ``tokens`` were generated in ``seconds``; ``rate``: the rate before (None:
    none yet). The rate counts output tokens (they are written as they come);
    a job's expected tokens count its prompt too, so a rate in output tokens
    spreads a flood a little more than it takes (the safe side: see
    DEFAULT_RATE)."""
    if seconds <= 0 or tokens < 0:
        return rate
    sample = tokens / seconds
    if rate is None:
        return sample if sample > 0 else None
    return (1 - RATE_WEIGHT) * rate + RATE_WEIGHT * sample
