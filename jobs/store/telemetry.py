"""Measurements every process writes into Redis and the views that read them:
counters, latency histograms, recent samples, the preemption log, and the
rows the metrics page and the dashboard show. Shared by all processes, so a
figure is the fleet's, not one process's."""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis

from scheduler.keys import Keys
from scheduler.state import lua_prelude

__all__ = ["BUCKETS_MS", "Telemetry", "as_text", "bucket_of", "lua_script"]

#: Upper bounds (ms) of the latency histograms' buckets; the last is +Inf. Up to
#: an hour: a batch job's first token or wait in the queue runs to minutes.
BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000,
              60000, 120000, 300000, 600000, 1800000, 3600000)  # fmt: skip


def bucket_of(value_ms: float) -> str:
    """The histogram field for one observation: its bucket's upper bound."""
    for bound in BUCKETS_MS:
        if value_ms <= bound:
            return str(bound)
    return "+Inf"


def as_text(value: Any) -> str:
    """A value read from Redis (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def lua_script(name: str) -> str:
    """A script of ``scheduler/lua``, after the shared helpers of ``lib.lua``."""
    lua = resources.files("scheduler").joinpath("lua")
    helpers = lua.joinpath("lib.lua").read_text()
    return lua_prelude() + helpers + lua.joinpath(f"{name}.lua").read_text()


class Telemetry:
    """Counters, histograms, samples and the preemption log in Redis."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys
        self._observe = client.register_script(lua_script("observe"))

    # -- writes -------------------------------------------------------------

    def count(self, counter: str, n: int = 1) -> None:
        self.r.hincrby(self.keys.counters, counter, n)

    def add_step_seconds(self, spent: dict[str, float]) -> None:
        """Add a worker's stepping seconds by part (jobs/worker/stepclock.py)."""
        with self.r.pipeline(transaction=False) as p:
            for part, seconds in spent.items():
                if seconds:
                    p.hincrbyfloat(self.keys.counters, f"step_seconds:{part}", seconds)
            p.execute()

    def add_counts(self, counts: dict[str, int]) -> None:
        """Add a worker's counts (jobs/worker/stepclock.py) to the counters."""
        with self.r.pipeline(transaction=False) as p:
            for what, n in counts.items():
                if n:
                    p.hincrby(self.keys.counters, what, n)
            p.execute()

    def observe(self, histogram: str, value_ms: float) -> None:
        """Add one observation to a histogram (the same Lua as a step's)."""
        key = self.keys.histogram(histogram)
        self._observe(keys=[key], args=[bucket_of(value_ms), repr(value_ms)])

    def observe_many(self, histogram: str, buckets: dict[str, int], total_ms: float) -> None:
        """Add ``buckets`` (bucket -> observations) to a histogram, their values
        summing to ``total_ms``: one round trip."""
        key = self.keys.histogram(histogram)
        # All or none (MULTI); a reply lost after it ran, then retried, counts twice:
        # a measurement, not a job's data.
        with self.r.pipeline() as p:
            for bucket, n in buckets.items():
                p.hincrby(key, bucket, n)
            p.hincrby(key, "count", sum(buckets.values()))
            p.hincrbyfloat(key, "sum", total_ms)
            p.execute()

    def record(self, **samples: float) -> None:
        """Keep recent measurements (the last 1,000 of each) for benchmarks and metrics."""
        with self.r.pipeline(transaction=False) as p:
            for name, value in samples.items():
                p.lpush(self.keys.samples(name), repr(value))
                p.ltrim(self.keys.samples(name), 0, 999)
            p.execute()

    def log_preemption(self, job_id: str, worker: str, tokens: int, park_ms: float) -> None:
        fields = {"job": job_id, "worker": worker, "tokens": tokens, "park_ms": round(park_ms, 2)}
        self.r.xadd(self.keys.preemptions, fields, maxlen=200, approximate=True)

    # -- reads --------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        raw = self.r.hgetall(self.keys.counters)
        return {as_text(k): float(v) for k, v in raw.items()}

    def histogram(self, name: str) -> dict[str, float]:
        """Bucket (upper bound, ``+Inf``), ``count`` and ``sum`` of a histogram."""
        raw = self.r.hgetall(self.keys.histogram(name))
        return {as_text(k): float(v) for k, v in raw.items()}

    def samples(self, name: str) -> list[float]:
        return [float(x) for x in self.r.lrange(self.keys.samples(name), 0, -1)]

    def recent_preemptions(self, count: int = 50) -> list[dict[str, Any]]:
        out = []
        for eid, fields in self.r.xrevrange(self.keys.preemptions, count=count):
            entry: dict[str, Any] = {as_text(k): as_text(v) for k, v in fields.items()}
            entry["at"] = int(as_text(eid).split("-")[0]) / 1000
            out.append(entry)
        return out

    def waiting(self, limit: int) -> list[str]:
        """The first ``limit`` waiting jobs (queued and parked), best first."""
        return [as_text(x) for x in self.r.zrange(self.keys.queue, 0, limit - 1)]

    def running_workers(self) -> list[str]:
        return [as_text(x) for x in self.r.zrange(self.keys.running, 0, -1)]

    def job_rows(self, job_ids: list[str], *fields: str) -> list[dict[str, str | None]]:
        """``fields`` of each job's record (None where absent)."""
        return self._rows([self.keys.job(j) for j in job_ids], fields)

    def worker_rows(self, workers: list[str], *fields: str) -> list[dict[str, str | None]]:
        """``fields`` of each worker's hash (None where absent)."""
        return self._rows([self.keys.worker(w) for w in workers], fields)

    def _rows(self, keys: list[str], fields: tuple[str, ...]) -> list[dict[str, str | None]]:
        with self.r.pipeline(transaction=False) as p:
            for key in keys:
                p.hmget(key, *fields)
            rows = p.execute()
        return [
            {f: None if v is None else as_text(v) for f, v in zip(fields, row, strict=True)}
            for row in rows
        ]
