"""The job state machine: every legal transition, in one table.

Invariants:
- a job is in exactly one state at a time;
- the terminal states (finished, failed, cancelled) have no way out;
- every state change anywhere in parkq (Lua scripts included) is one of the
  transitions below: the Lua scripts name states only through the constants
  :func:`lua_prelude` generates from this module (``S.running``), receive
  their allowed source states from :func:`sources`, and move a job with the
  generated ``move``, which refuses what this table forbids; so this table
  stays the single source of truth.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "LIVE",
    "TERMINAL",
    "IllegalTransition",
    "JobState",
    "can_transition",
    "check_transition",
    "lua_prelude",
    "sources",
]


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PARKING = "parking"
    PARKED = "parked"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: frozenset[JobState] = frozenset({JobState.FINISHED, JobState.FAILED, JobState.CANCELLED})
#: The states of a job that has not ended.
LIVE: tuple[JobState, ...] = tuple(s for s in JobState if s not in TERMINAL)

_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # A waiting job is claimed by a worker, or cancelled before it runs.
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    # A running job ends, is asked to park, or goes back to the queue when its
    # worker died before it could park (requeue by the reaper).
    JobState.RUNNING: frozenset(
        {
            JobState.FINISHED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.PARKING,
            JobState.QUEUED,
        }
    ),
    # Parking drains tokens and checkpoints, then the job waits as parked; a job
    # whose last token came before it could park simply finishes.
    JobState.PARKING: frozenset(
        {JobState.PARKED, JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED}
    ),
    # A parked job waits in the queue like any other and resumes when claimed.
    JobState.PARKED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A state change that the table does not allow."""

    def __init__(self, source: JobState, target: JobState) -> None:
        super().__init__(f"illegal job transition {source.value} -> {target.value}")
        self.source = source
        self.target = target


def can_transition(source: JobState, target: JobState) -> bool:
    return target in _TRANSITIONS[source]


def check_transition(source: JobState, target: JobState) -> JobState:
    """Return ``target`` if ``source -> target`` is legal, else raise."""
    if not can_transition(source, target):
        raise IllegalTransition(source, target)
    return target


def sources(target: JobState) -> tuple[JobState, ...]:
    """Every state from which ``target`` can be reached, in a stable order."""
    return tuple(s for s in JobState if target in _TRANSITIONS[s])


_MOVE_LUA = """
-- Set a job's state to `target` if the transition table allows it from the
-- state the job is in (a job without a state is new); whether it did.
local function move(job, target)
  local from = redis.call('HGET', job, 'state')
  if from and not MAY[from][target] then return false end
  redis.call('HSET', job, 'state', target)
  return true
end
"""


def lua_prelude() -> str:
    """The states and the transition table as Lua, put before every script."""
    names = ", ".join(f"{s.name.lower()} = '{s.value}'" for s in JobState)
    rows = ", ".join(
        s.value + " = {" + ", ".join(f"{t.value} = true" for t in _TRANSITIONS[s]) + "}"
        for s in JobState
    )
    return (
        "-- Generated from scheduler/state.py: the job states and their transitions.\n"
        f"local S = {{{names}}}\nlocal MAY = {{{rows}}}\n{_MOVE_LUA}\n"
    )
