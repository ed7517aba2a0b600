"""A tenant's token rate (``tokens_per_minute``, scheduler/tenancy.py): a token
bucket in Redis holding a minute's worth, refilled continuously.

A request is admitted with its prompt and its most output tokens (``max_tokens``,
or what the context leaves), as OpenAI counts them against a rate. It may take
the bucket below zero when the bucket was full: a request larger than a
minute's worth still runs, and the tenant then waits for the bucket to refill.
Past the limit: 429 with ``Retry-After``, the seconds until the request fits.
Batch lines are not refused: a batch's next line waits in the batch until its
tenant's bucket has room (jobs/store/batches.py).
"""

from __future__ import annotations

import math

from jobs.store.scheduling import Store
from jobs.store.telemetry import lua_script
from web.errors import TooManyRequests

__all__ = ["TAKE", "admit", "take"]

#: The bucket's script (scheduler/lua/take.lua, with lib.lua's take_tokens).
TAKE = lua_script("take")


def take(store: Store, tenant: str, per_minute: int, cost: int, now: float) -> float:
    """Take ``cost`` tokens from ``tenant``'s bucket: 0.0 if taken, else the
    seconds until they would fit (nothing taken)."""
    wait = store.r.eval(TAKE, 1, store.keys.bucket(tenant), repr(now), per_minute, cost)
    return float(wait)


def admit(store: Store, tenant: str, per_minute: int | None, cost: int, now: float) -> None:
    """Take a request's tokens, or refuse it: 429 with the seconds to wait."""
    if not per_minute:
        return
    wait = take(store, tenant, per_minute, cost, now)
    if wait > 0:
        raise TooManyRequests(
            f"This key's tenant may be admitted {per_minute} tokens per minute (prompt and "
            f"most output tokens); this request counts {cost}. Try again in "
            f"{math.ceil(wait)} s.",
            retry_after=max(1, math.ceil(wait)),
            code="tokens_per_minute_exceeded",
        )
