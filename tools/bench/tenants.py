"""What tenants' limits cost Redis: the enqueue and claim scripts with 10,000
queued jobs of 100 tenants, with fair turns and without, and the batch feed
script with and without a tenant's token rate.

    python -m tools.bench.tenants [--jobs 10000] [--tenants 100] [--claims 2000]
        [--feeds 2000] [--checks 2000] [--out FILE.json]

Starts one `redis-server` (loopback) and drives parkq's own scripts
(jobs/store/scheduling.py) with no engine:

- **enqueue and claim**: ``--jobs`` waiting jobs at one level (and
  ``--claims`` more), owned round robin by ``--tenants`` tenants, enqueued
  with fair turns (weight 1: scheduler/fairness.py) and again without
  (PARKQ_FAIR_SHARE off); ``--claims`` claims, each by a sequence of its own.
  With fair turns a job is listed in its tenant's queue where it is
  enqueued, and the claim compares the first waiting jobs of the tenants of
  the earliest turns (scheduler/fairness.py's LOOK).
- **feed**: a batch of ``--feeds`` lines fed one at a time (each fed line then
  marked ended, as a worker would end it), once with no token rate and once
  with one that never runs dry: the rate's own cost per fed line.

- **preemption check**: the check each submission makes
  (``Store.maybe_preempt``), ``--checks`` times, with the ``--jobs`` waiting
  jobs behind a running one (they decide that no one is interrupted) and on
  an idle engine: the client's time and Redis commands per check.

Redis time per call is INFO commandstats' (``evalsha``, microseconds per call,
reset before each part); the client's round trip is beside it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from jobs.store.batches import BatchStore
from jobs.store.scheduling import Store
from scheduler.settings import load_settings
from tools.bench import command_line, machine, scratch_redis, write_results


def _redis_us(r: redis.Redis) -> float:
    """Redis's own microseconds per script call since the last reset."""
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return round(float(stats.get("usec_per_call", 0.0)), 2)


def claim_cost(url: str, jobs: int, tenants: int, claims: int, fair: bool) -> dict[str, Any]:
    settings = load_settings(redis_url=url, key_prefix="claims", queue_name="claims",
                             max_queue=10**7, fair_share=fair)  # fmt: skip
    r = redis.Redis.from_url(url)
    store = Store(r, settings)
    request = {"prompt_ids": [1] * 10, "max_tokens": 64}
    # Enough that the queue holds ``jobs`` or more through every claim.
    r.config_resetstat()
    for i in range(jobs + claims):
        store.enqueue(f"j-{i}", "completion", request, 0, time.time(),
                      owner=f"tenant-{i % tenants}", weight=1.0)  # fmt: skip
    enqueue_us = _redis_us(r)
    r.config_resetstat()
    walls = []
    for c in range(claims):
        t0 = time.perf_counter()
        got = store.claim(f"seq-{c}", time.time(), "proc")
        walls.append(time.perf_counter() - t0)
        assert got is not None
    us = _redis_us(r)
    r.delete(*r.keys("{claims}*") or ["none"])
    walls.sort()
    return {
        "fair_share": fair,
        "queued_at_least": jobs,
        "tenants": tenants,
        "claims": claims,
        "redis_us_per_enqueue": enqueue_us,
        "redis_us_per_claim": us,
        "client_ms_p50": round(1000 * walls[len(walls) // 2], 3),
        "client_ms_p99": round(1000 * walls[int(len(walls) * 0.99)], 3),
    }


def preempt_cost(url: str, jobs: int, tenants: int, checks: int, busy: bool) -> dict[str, Any]:
    """The preemption check a submission makes (Store.maybe_preempt) with
    ``jobs`` waiting jobs of one level behind it: on an engine whose one
    sequence runs the first of them (``busy``: the waiting jobs then decide
    that no one is interrupted) or on an idle engine."""
    prefix = "busy" if busy else "idle"
    settings = load_settings(redis_url=url, key_prefix=prefix, queue_name=prefix,
                             max_queue=10**7)  # fmt: skip
    r = redis.Redis.from_url(url)
    store = Store(r, settings)
    request = {"prompt_ids": [1] * 10, "max_tokens": 64}
    for i in range(jobs + 1):
        store.enqueue(f"j-{i}", "completion", request, 0, time.time(),
                      owner=f"tenant-{i % tenants}", weight=1.0)  # fmt: skip
    store.workers.heartbeat("seq-0", now=time.time(), ttl=3600, proc="proc")
    if busy:
        assert store.claim("seq-0", time.time(), "proc") is not None
    r.config_resetstat()
    walls = []
    for _ in range(checks):
        t0 = time.perf_counter()
        assert store.maybe_preempt(time.time()) is None
        walls.append(time.perf_counter() - t0)
    stats = r.info("commandstats")
    commands = sum(int(v["calls"]) for k, v in stats.items() if "resetstat" not in k)
    r.delete(*r.keys("{" + prefix + "}*") or ["none"])
    walls.sort()
    return {
        "engine": "busy" if busy else "idle",
        "waiting": jobs,
        "checks": checks,
        "redis_commands_per_check": round(commands / checks, 1),
        "client_ms_p50": round(1000 * walls[len(walls) // 2], 3),
        "client_ms_p99": round(1000 * walls[int(len(walls) * 0.99)], 3),
    }


def feed_cost(url: str, lines: int, rate: int) -> dict[str, Any]:
    prefix = f"feed{rate}"
    settings = load_settings(redis_url=url, key_prefix=prefix, queue_name=prefix,
                             max_queue=10**7)  # fmt: skip
    r = redis.Redis.from_url(url)
    store = Store(r, settings)
    batches = BatchStore(store)
    record = {"id": "batch_x", "invalid": "0", "errors": "[]", "status": "in_progress",
              "owner": "tenant-1", "window": "1"}  # fmt: skip
    if rate:
        record["tokens_per_minute"] = str(rate)
    request = {"prompt_ids": [1] * 10, "max_tokens": 5}
    batches.create_batch(record, [(f"l-{i}", f"c-{i}", "completion", request, {})
                                  for i in range(lines)], [], time.time())  # fmt: skip
    r.hset(store.keys.batch("batch_x"), mapping=record)
    r.config_resetstat()
    fed = 0
    t0 = time.perf_counter()
    for i in range(lines):
        fed += batches.feed("batch_x")
        r.hset(store.keys.job(f"l-{i}"), "state", "finished")  # its line ended
    wall = time.perf_counter() - t0
    us = _redis_us(r)
    r.delete(*r.keys("{" + prefix + "}*") or ["none"])
    return {
        "lines": lines,
        "fed": fed,
        "tokens_per_minute": rate or None,
        "redis_us_per_feed": us,
        "client_ms_per_feed": round(1000 * wall / lines, 3),
    }


def main() -> None:
    ap = command_line(__doc__, "tenants", model="none (Redis only)")
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--claims", type=int, default=2000)
    ap.add_argument("--feeds", type=int, default=2000)
    ap.add_argument("--checks", type=int, default=2000)
    args = ap.parse_args()
    with scratch_redis("tenants") as url:
        version = redis.Redis.from_url(url).info("server")["redis_version"]
        claim = [claim_cost(url, args.jobs, args.tenants, args.claims, fair)
                 for fair in (True, False, True, False)]  # fmt: skip
        for row in claim:
            print(json.dumps(row), flush=True)
        feeds = [feed_cost(url, args.feeds, rate) for rate in (0, 10**9)]
        for row in feeds:
            print(json.dumps(row), flush=True)
        checks = [preempt_cost(url, args.jobs, args.tenants, args.checks, busy)
                  for busy in (True, False)]  # fmt: skip
        for row in checks:
            print(json.dumps(row), flush=True)
    results = {
        "machine": machine(),
        "redis": version,
        "date": time.strftime("%Y-%m-%d"),
        "claim": claim,
        "feed": feeds,
        "preempt_check": checks,
    }
    write_results(args.out, results)


if __name__ == "__main__":
    main()
