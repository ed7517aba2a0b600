"""Fair turns between tenants at one priority level, pure.

Start-time fair queueing (Goyal, Vin and Cheng, 1996) over each tenant's own
queue. A job's key is its own (scheduler/policy.py: its level and arrival):
it orders the levels, ages jobs and decides preemption as without tenants.
Among the jobs of one level, turns decide which runs:

- each tenant's waiting jobs at a level are its own queue, in key order (a
  parked job keeps its place at the front of it);
- each level has a virtual time ``V`` (tokens per unit of weight: the turn of
  the last job claimed there) and each tenant a clock there ``C`` (the turn
  its last claimed job ended at: its turn plus what the job is expected to
  take, ``tokens / weight``);
- a tenant with jobs waiting has a turn: ``max(V, C)``, set when it comes to
  wait and after each claim of its;
- a claim finds the first waiting job that fits (key order), and where it
  takes a fair turn takes instead the first waiting job of the tenant of the
  earliest turn at that level whose first job fits (among the LOOK earliest;
  an equal turn goes to the first job), in the first one's place: at its
  key, so no waiting job parks it for that one.

Expected tokens: a job's prompt and the larger of its tenant's usual output
and its tenant's usual share of max_tokens times its own, at most its
max_tokens (each finished job moves both averages by ``OUTPUT_WEIGHT``;
DEFAULT_OUTPUT before any). A tenant is charged when its job is first
claimed: a cancelled job that never ran costs nothing, one parked and
claimed again is not charged twice.

Parks. A waiting job parks a runner whose key it beats (levels, age) as
without tenants. At its own level, the tenant of the earliest turn parks a
runner of another tenant past its minimum run time when that tenant runs
more of the engine's sequences there, over its weight, than it would itself
after taking one (``held / weight > (mine + 1) / my_weight``): a tenant's
flood that holds every sequence gives one up for another tenant's request
at once; a park that would only swap two tenants' places is not made.

What tests/unit/test_fairness.py checks against the Lua (Hypothesis over
arrivals, claims and cancels of three tenants at three levels):
- a job of a higher level that arrived less than the levels' difference
  (in level_seconds) after another runs first;
- a tenant's jobs at a level keep their order; none is lost; nothing stays
  listed once the queue is empty;
- while two tenants both have jobs waiting at a level, the expected tokens
  over weight claimed for one never lead the other's by more than their
  largest jobs' (the bound of start-time fair queueing);
and by examples: a flood, however old, holds another tenant's request back
one turn at most; weights 2:1 take turns 2:1; a cancelled flood is not
charged; a tenant that ran alone owes one turn, not all it ran; which
runner a tenant under its share parks, and that the claim then hands it
the sequence.

Known to fall short:
- the turns are fair in expected tokens, corrected only through the
  averages (a job that ends early or late moves its tenant's next ones,
  not its own charge);
- a waiting job that fits no sequence here (another model's, its tenant at
  its running cap) keeps its tenant's turn: a claim passes that tenant over
  and the level's virtual time moves on without it, so it gets one turn,
  not all it missed, when it fits again;
- within a level a job's wait is bounded by its tenant's turns, not by its
  key: a tenant of weight 0.001 beside a busy one of weight 1 waits for
  1,000 of the other's turns per job, as its weight says.
"""

from __future__ import annotations

__all__ = ["DEFAULT_OUTPUT", "LOOK", "OUTPUT_WEIGHT"]

#: Output tokens expected of a job of a tenant none of whose jobs finished yet.
DEFAULT_OUTPUT = 256
#: How much of a tenant's usual output one finished job makes (lib.lua's fair_output).
OUTPUT_WEIGHT = 0.2
#: How many of a level's earliest turns a claim looks at for a tenant whose
#: first waiting job fits (claim.lua), and a park for the tenant it parks for.
LOOK = 16
