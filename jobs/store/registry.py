"""Who is alive: worker heartbeats (each with the model it serves and its
memory figures), the connections that prove a process still runs, and the
marks that let the reaper requeue the jobs of the dead."""

from __future__ import annotations

import redis

from jobs.store.identity import ModelIdentity
from jobs.store.telemetry import as_text
from scheduler.keys import Keys

__all__ = ["WorkerRegistry"]


class WorkerRegistry:
    """The workers' liveness in Redis (a sorted set of names by the time their
    heartbeat expires, and a hash per worker)."""

    def __init__(self, client: redis.Redis, keys: Keys, model: ModelIdentity | None) -> None:
        self.r = client
        self.keys = keys
        #: The model this process serves, announced with its heartbeats.
        self.model = model

    def alive(self, now: float) -> list[str]:
        return [as_text(n) for n in self.r.zrangebyscore(self.keys.workers, now, "+inf")]

    def models(self, now: float) -> dict[str, ModelIdentity | None]:
        """The live worker processes and the model each announced (None: announced
        none). A process's other sequences are not counted again."""
        alive = self.alive(now)
        with self.r.pipeline(transaction=False) as p:
            for w in alive:
                p.hgetall(self.keys.worker(w))
            rows = p.execute()
        out = {}
        for w, row in zip(alive, rows, strict=True):
            fields = {as_text(a): as_text(b) for a, b in row.items()}
            if fields.get("proc", w) == w:
                out[w] = ModelIdentity.from_fields(fields)
        return out

    def heartbeat(
        self,
        worker: str,
        now: float,
        ttl: float,
        checkpoint_bytes: int = 0,
        rss_bytes: int = 0,
        proc: str | None = None,
    ) -> None:
        """Announce ``worker`` alive until ``now + ttl``; ``proc``: its process's
        name, when the process serves several sequences."""
        fields: dict[str, str | int] = {
            "proc": proc or worker,
            "checkpoint_bytes": checkpoint_bytes,
            "rss_bytes": rss_bytes,
            "named": "1" if self.named_connection() else "0",
        }
        if self.model is not None:
            fields.update(self.model.fields())
        with self.r.pipeline(transaction=False) as p:
            p.zadd(self.keys.workers, {worker: now + ttl})
            p.hset(self.keys.worker(worker), mapping=fields)
            p.execute()

    def slot_jobs(self, workers: list[str]) -> list[str | None]:
        """The job each of ``workers`` is recorded as running (None: none)."""
        with self.r.pipeline(transaction=False) as p:
            for worker in workers:
                p.hget(self.keys.worker(worker), "job")
            return [None if job is None else as_text(job) for job in p.execute()]

    def named_connection(self) -> bool:
        """Whether this store's connections carry CLIENT SETNAME (see Keys.client_name)."""
        kwargs = getattr(self.r.connection_pool, "connection_kwargs", {})
        name = kwargs.get("client_name")
        return isinstance(name, str) and name.startswith(self.keys.client_name_prefix)

    def disconnected(self, now: float, me: str) -> list[str] | None:
        """Live workers (by heartbeat) that announced named connections and have none
        open now: their process has died. None when CLIENT LIST is not allowed."""
        try:
            names = {c.get("name", "") for c in self.r.client_list()}
        except redis.ResponseError:
            return None  # e.g. a managed Redis without CLIENT: the TTL alone decides
        alive = [w for w in self.alive(now) if w != me]
        with self.r.pipeline(transaction=False) as p:
            for w in alive:
                p.hmget(self.keys.worker(w), "named", "proc")
            rows = p.execute()
        gone = []
        for w, (flag, proc) in zip(alive, rows, strict=True):
            process = w if proc is None else as_text(proc)
            if process == me or flag is None or as_text(flag) != "1":
                continue
            if self.keys.client_name(process) not in names:
                gone.append(w)
        return gone

    def drop_retired_keys(self) -> None:
        """Delete keys that earlier versions wrote and this one no longer uses."""
        self.r.delete(self.keys.retired_jobs_index)

    def expire_all(self) -> int:
        """Mark every known worker's heartbeat expired (they are known to be gone, as
        after a restart of the whole stack); the next reap requeues their jobs."""
        workers = self.r.zrange(self.keys.workers, 0, -1)
        if workers:
            self.r.zadd(self.keys.workers, dict.fromkeys(workers, 0))
        return len(workers)

    def retire(self, worker: str) -> bool:
        """Mark ``worker``'s liveness as expired, so the next :meth:`Store.reap` requeues
        its jobs; whether it was registered."""
        return bool(self.r.zadd(self.keys.workers, {worker: 0}, xx=True, ch=True))

    def remove(self, worker: str) -> None:
        with self.r.pipeline() as p:
            p.zrem(self.keys.workers, worker)
            p.zrem(self.keys.running, worker)
            p.delete(self.keys.worker(worker))
            p.execute()
