"""Fair turns between tenants at one priority level, pure.

Start-time fair queueing (Goyal, Vin and Cheng, 1996) on the queue's static
keys (scheduler/policy.py). Each level has a virtual time ``V``, in tokens per
unit of weight: the virtual start of the last job claimed there. Each tenant
has a clock per level ``F``: the virtual finish of its last job there. A job
starts at ``max(V, F)`` (a tenant whose last job was cancelled before it
ran takes that job's start instead) and moves ``F`` on by ``tokens / weight``, ``tokens``
what it is expected to take. A tenant that ran alone moved ``V`` with it, so
it owes one turn, not all it ran.

The queue's keys are times, fixed when a job is queued: a job's key is now
plus the seconds ``V`` takes to reach its start at the speed it moved lately
(measured between claims while jobs waited, averaged over about
SPEED_CLAIMS claims from a first guess of DEFAULT_SPEED), at most
``most_seconds`` (half a level's worth) after now, never before now, and never
before its tenant's last job still waiting there. Keys placed at one speed and
read at another can misorder jobs queued at different times, so a claim then
compares the jobs after the first that fits at its level, up to LOOK entries
and ``reach_seconds`` (a quarter level) of key behind it, by their virtual
starts and takes the earliest, in the first one's place (its key, so that
nothing parks it for that one). It stops at a job of another level, or
without a turn (those keep their place), and takes the first itself once its
key time is ``reach_seconds`` past, before the later-keyed jobs of its level
(so turns hold a job back about three quarters of a level at most; a test
checks it for a cancelled flood, no test generates the space). The queue never needs rescoring; the
enqueue reads one hash and one job state more; the claim reads one hash per
entry compared (lib.lua's fair_start and fair_claimed, claim.lua).

What tests/unit/test_fairness.py checks against the Lua:
- a tenant's own jobs keep their order at a level while the earlier ones wait
  and none is parked back or passed over by a claim (a job is never put before
  its tenant's last one still waiting there, or cancelled);
- a tenant with nothing waiting starts at most one turn after ``V`` (its
  last job's), not behind another tenant's flood, nor behind for what it ran
  beside a backlog past half a level (``V`` moves on with jobs taken out of
  turn, at its measured speed);
- tenants that keep jobs waiting are claimed in proportion to their weights,
  in expected tokens (a job's prompt and the larger of its tenant's usual
  output and its tenant's usual share of max_tokens times its own, at most its
  max_tokens, all of it before any of the tenant's jobs finished; each
  finished job moves both averages, see ``OUTPUT_WEIGHT``);
- a tenant that used an idle engine is held back by one turn at most;
- no key is before its arrival, nor more than ``most_seconds`` after it
  (plus a millisecond per job of its tenant waiting ahead of it), so a job of
  a higher level that arrives less than half a level after another, of a
  lower level, runs first;
- tenants sending one request at a time do not starve another's backlog, a
  tenant that cancelled a flood waits three quarters of a level at most, a job
  taken in another's place is not parked for it, a waiting job of an equal
  turn parks the runner, and neither a burst of claims an instant apart nor
  a job taken out of turn sets the speed.

Known to fall short (helpers' reviews, reproduced on fakeredis; open in
issue 36):
- a key is put back half a level at most, so a tenant's backlog past that
  is keyed 1 ms apart at its arrival plus half a level; once it is older
  than that it runs in arrival order, and another tenant's request waits
  behind all of it (1,000 one-second jobs of one tenant: another's request
  sent 29 s after them ran at once, sent 31 s after them it waited 969 s;
  a weight-0.001 tenant's backlog took 83 of 100 claims beside a weight-1
  tenant's one request a second). Turns hold for what arrives within half a
  level of a backlog's start; past it, only a claim that compares each
  tenant's first waiting job (not the queue's next 16) would;
- keys are fixed when a job is queued, so jobs queued at different times
  and farther apart than the claim's reach are compared through the
  measured speed, as steady as the work is; the speed counts time in which
  only jobs no one could take waited;
- a tenant's job parked back, or passed over by a claim, can be passed by
  its tenant's newer job; cancelled jobs other than a tenant's last stay
  charged to it.
The one-minute benchmark (docs/benchmarks.md) measures the weights' share
with every tenant's work younger than half a level.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_OUTPUT",
    "DEFAULT_SPEED",
    "LOOK",
    "MIN_SPEED",
    "OUTPUT_WEIGHT",
    "SPEED_CLAIMS",
    "most_seconds",
    "reach_seconds",
]

#: Output tokens expected of a job of a tenant none of whose jobs finished yet.
DEFAULT_OUTPUT = 256
#: How fast a level's virtual time is taken to move (tokens per unit of weight
#: a second) until claims have measured it.
DEFAULT_SPEED = 50.0
#: The lowest speed measured.
MIN_SPEED = 5.0
#: How much of a tenant's usual output one finished job makes (lib.lua's fair_output).
OUTPUT_WEIGHT = 0.2
#: About how many claims the measured speed averages over (lib.lua's fair_claimed).
SPEED_CLAIMS = 10
#: How many queue entries after the first that fits a claim looks at for an
#: earlier fair turn (claim.lua).
LOOK = 16


def most_seconds(level_seconds: float) -> float:
    """The most seconds a fair turn puts a job's key back: half a level's worth."""
    return level_seconds / 2


def reach_seconds(level_seconds: float) -> float:
    """How far behind the first waiting job that fits a claim reaches for an
    earlier turn, in seconds of key: a quarter of a level's worth. A job is
    claimed no later than one of its level keyed this much after it."""
    return level_seconds / 4
