"""What a Redis call failed with, told apart: Redis's passing state (the
worker waits it out, the job is not at fault) or something else.

The worker's loop waits out any Redis error (TRANSIENT); a job is charged a
crash only for an error reply that is not one of a Redis that cannot serve for
a while (PASSING) and that outlasted the write retries.
"""

from __future__ import annotations

import redis

__all__ = ["MOVED_PRIMARY", "PASSING", "TRANSIENT", "error_code", "passes"]

#: What the worker's loop waits out, with back-off, whatever it is: a
#: connection that failed or timed out (a restart, a failover, LOADING), and
#: any error reply. Redis and Valkey refuse commands for many reasons that
#: pass (PASSING) and new ones come with new versions, so the loop lists none:
#: it never exits for one (tests/integration/test_redis_replies.py).
TRANSIENT: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ResponseError,
)
#: The codes of the error replies of a Redis that cannot serve for a while:
#: maxmemory (OOM), a demoted or stale replica (READONLY, MASTERDOWN,
#: UNBLOCKED), min-replicas-to-write (NOREPLICAS), a failing disk (MISCONF),
#: a long script (BUSY), loading (LOADING), a restarted server (NOSCRIPT),
#: TRYAGAIN, CLUSTERDOWN. A job that fails on one is requeued without counting
#: against its crash limit; on any other reply (ERR, WRONGTYPE, NOPERM, one
#: no version sends yet) that outlasts the write retries, it counts, so a job
#: whose own data Redis always refuses ends failed instead of running forever.
PASSING = frozenset({"OOM", "READONLY", "MASTERDOWN", "UNBLOCKED", "NOREPLICAS", "MISCONF",
                     "BUSY", "LOADING", "NOSCRIPT", "TRYAGAIN", "CLUSTERDOWN"})  # fmt: skip
#: The codes of what a server answers once it is no longer the primary (or
#: while it is becoming a replica): connect anew, to whatever is the primary.
MOVED_PRIMARY = frozenset({"READONLY", "MASTERDOWN", "UNBLOCKED"})


def error_code(exc: BaseException) -> str:
    """The code of a Redis error reply (``NOREPLICAS``, ``READONLY``, ``ERR``),
    as redis-py parsed it; "" for anything else."""
    if not isinstance(exc, redis.ResponseError):
        return ""
    code = getattr(exc, "status_code", None)
    if code:
        return str(code)
    word = str(exc).split(" ", 1)[0]  # (a redis-py without status_code)
    return word if word.isupper() else ""


def passes(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis's passing state, not the job's doing."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return True
    return error_code(exc) in PASSING
