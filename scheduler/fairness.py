"""Fair turns between tenants at one priority level, pure.

Start-time fair queueing (Goyal, Vin and Cheng, 1996) on the queue's static
keys (scheduler/policy.py). Each level has a virtual time ``V``: the virtual
start of the last job claimed there. Each tenant has a clock per level ``F``:
the virtual finish of its last job there. A job of a tenant whose last job
there still waits starts at ``max(V, F)``; of a tenant with nothing waiting
there, at ``V``. It moves ``F`` on by ``tokens / (weight * rate)``: ``tokens``
what it is expected to take, ``rate`` the engine's rate in such tokens (those
of the jobs claimed per second while others waited, measured where they are
claimed, over about RATE_SECONDS), so that virtual time keeps up with real
time. ``V`` is never taken as behind now (a job is never put forward of its
arrival), and starts again at now when it runs ahead by more than
``most_seconds`` (half a level's worth). A job's key is that of a job of its
level arriving at its start, at most ``most_seconds`` after now, and never
before its tenant's last job still waiting there.
The queue never needs rescoring, the claim moves ``V`` and counts the tokens,
and the enqueue reads one hash and one job state more (lib.lua's fair_start
and fair_claimed).

What tests/unit/test_fairness.py checks against the Lua:
- a tenant's own jobs keep their order at a level while the earlier ones wait
  and none is parked back or passed over by a claim (a job is never put before
  its tenant's last one still waiting there, or cancelled);
- a tenant with nothing waiting starts at ``V``, not behind another tenant's
  flood;
- tenants that keep jobs waiting are claimed in proportion to their weights,
  in expected tokens (a job's prompt and the larger of its tenant's usual
  output and its tenant's usual share of max_tokens times its own, at most its
  max_tokens, all of it before any of the tenant's jobs finished; each
  finished job moves both averages, see ``OUTPUT_WEIGHT``);
- a tenant that used an idle engine is not held back by what it ran;
- no key is more than ``most_seconds`` from its arrival (plus a millisecond
  per job of its tenant waiting ahead of it).

Known to fall short (helpers' reviews, reproduced on fakeredis; open in
issue 36): keys are fixed when a job is queued, so the turns of jobs queued at
different times are compared through the measured rate, as exact as it is
(measured high, turns flatten toward arrival order; measured low, ``V``
starts again at now and the turns of the jobs waiting then are lost); a
tenant's job parked back, or passed over by a claim, can be passed by its
tenant's newer job; with few jobs waiting per tenant the weights are met
only roughly (1.6 for 2:1 in a simulation of one claim a second), and with
work waiting past half a level the turns flatten toward arrival order; the
time-decayed rate reads high when claims are far apart. The one-minute
benchmark (docs/benchmarks.md) measured 2.00-2.01 for weights 2:1.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_OUTPUT",
    "DEFAULT_RATE",
    "MIN_RATE",
    "OUTPUT_WEIGHT",
    "RATE_SECONDS",
    "most_seconds",
]

#: Output tokens expected of a job of a tenant none of whose jobs finished yet.
DEFAULT_OUTPUT = 256
#: Tokens per second turns are taken at until claims have measured the engine.
DEFAULT_RATE = 50.0
#: The lowest rate measured.
MIN_RATE = 5.0
#: How much of a tenant's usual output one finished job makes (lib.lua's fair_output).
OUTPUT_WEIGHT = 0.2
#: The time constant, in seconds, of the measured rate (lib.lua's fair_claimed).
RATE_SECONDS = 5.0


def most_seconds(level_seconds: float) -> float:
    """The most seconds a fair turn puts a job back: half a level's worth."""
    return level_seconds / 2
