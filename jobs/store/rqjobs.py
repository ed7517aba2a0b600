"""RQ's view of parkq jobs: job records, registries and worker registration.

parkq orders and claims jobs itself (a priority sorted set, Lua), but every
request is also an RQ job, JSON-serialized, whose status follows the parkq
state, so ``rq info`` and rq-dashboard show queues, executing, finished and
failed jobs, and the workers. This is the only module that imports ``rq``.

Invariant: the view is read-only for parkq. Its writes are best-effort (a
failed one is logged, never raised into the worker), and nothing in it can
make parkq refuse or lose a job: a job whose RQ record is gone (deleted in
rq-dashboard, or expired) still runs; only a record that names another
function than parkq's refuses it.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

__all__ = ["GENERATE", "PARKQ_FUNCTIONS", "RQBridge", "generate"]

log = logging.getLogger(__name__)


def generate(job_id: str) -> None:
    """The function every parkq RQ job names; a parkq worker runs it in its own loop."""
    raise RuntimeError("parkq jobs run only in a parkq worker (`parkq worker`)")


#: The function every parkq RQ record names. A stored name, not the module's
#: path: it stays the name of where ``generate`` first lived, so workers of the
#: previous version take the jobs this one queues in a rolling upgrade, and
#: the reverse.
GENERATE = "jobs.rqjobs.generate"
#: Names that are parkq's function: the stored one, and where it lives now.
PARKQ_FUNCTIONS = frozenset({GENERATE, f"{generate.__module__}.{generate.__qualname__}"})

F = TypeVar("F", bound=Callable[..., None])


def _view_write(method: F) -> F:
    """A write to the RQ view: logged and dropped when it fails, never raised."""

    @functools.wraps(method)
    def wrapper(self: RQBridge, job_id: str, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, job_id, *args, **kwargs)
        except (redis.RedisError, NoSuchJobError, ValueError) as exc:
            log.warning("job %s: RQ view not updated (%s: %s)", job_id, type(exc).__name__, exc)

    return wrapper  # type: ignore[return-value]


class RQBridge:
    """Mirrors parkq job states into RQ's records."""

    def __init__(self, client: redis.Redis, queue_name: str, result_ttl: int) -> None:
        self.r = client
        self.queue = Queue(queue_name, connection=client, serializer=JSONSerializer)
        self.result_ttl = result_ttl
        self.worker: SimpleWorker | None = None
        self._executions: dict[str, Execution] = {}

    # -- web side --------------------------------------------------------

    def create(self, job_id: str, description: str) -> None:
        job = Job.create(
            GENERATE,
            args=(job_id,),
            id=job_id,
            connection=self.r,
            serializer=JSONSerializer,
            origin=self.queue.name,
            timeout=-1,
            result_ttl=self.result_ttl,
            description=description,
            status=JobStatus.QUEUED,
        )
        with self.r.pipeline() as p:
            job.save(pipeline=p)
            p.sadd(Queue.redis_queues_keys, self.queue.key)
            p.rpush(self.queue.key, job_id)
            p.execute()

    def delete(self, job_id: str) -> None:
        """Forget a job that was never accepted."""
        with self.r.pipeline() as p:
            p.lrem(self.queue.key, 0, job_id)
            p.delete(Job.key_for(job_id))
            p.execute()

    @_view_write
    def forget(self, job_id: str) -> None:
        """Drop an ended job's RQ record and its entries in RQ's queue and
        registries (a deleted response); a job already gone is no error."""
        with self.r.pipeline() as p:
            p.lrem(self.queue.key, 0, job_id)
            for registry in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry):
                p.zrem(registry(queue=self.queue).key, job_id)
            p.delete(Job.key_for(job_id))
            p.execute()

    def fetch(self, job_id: str) -> Job | None:
        """The RQ record, or None when there is none (Redis errors are raised)."""
        try:
            return Job.fetch(job_id, connection=self.r, serializer=JSONSerializer)
        except (NoSuchJobError, ValueError, TypeError):
            return None  # gone, or not a record this serializer reads

    @_view_write
    def canceled(self, job_id: str) -> None:
        job = self.fetch(job_id)
        if job is None:
            return
        with self.r.pipeline() as p:
            p.lrem(self.queue.key, 0, job_id)
            self._end_execution(job, p)
            job.set_status(JobStatus.CANCELED, pipeline=p)
            CanceledJobRegistry(queue=self.queue).add(job, self.result_ttl, pipeline=p)
            p.execute()

    # -- worker side -----------------------------------------------------

    def register_worker(self, name: str) -> None:
        """Show this worker to RQ. A stale record of the same name (a worker
        that died without signing off) is replaced: the caller has checked that
        no live parkq worker uses the name."""
        self.worker = SimpleWorker(
            [self.queue], connection=self.r, name=name, serializer=JSONSerializer
        )
        self._restore_client_name()
        self.worker.hostname = socket.gethostname()
        try:
            self.worker.register_birth()
        except ValueError:
            self.forget_worker(name)
            self.worker.register_birth()
        self.worker.set_state("idle")

    def forget_worker(self, name: str) -> None:
        """Remove the RQ record of a dead worker."""
        SimpleWorker(
            [self.queue], connection=self.r, name=name, serializer=JSONSerializer
        ).register_death()
        self._restore_client_name()

    def _restore_client_name(self) -> None:
        """RQ's worker renames the connection it is given (CLIENT SETNAME, to learn
        its address); parkq's workers are known alive by their connections' names,
        so put this process's name back. The pool hands out its last-used
        connection first: the one RQ renamed."""
        kwargs = getattr(self.r.connection_pool, "connection_kwargs", {})
        name = kwargs.get("client_name")
        if name:
            self.r.client_setname(name)

    def unregister_worker(self) -> None:
        if self.worker is not None:
            self.worker.register_death()

    def heartbeat(self, ttl: int) -> None:
        """Keep this worker in RQ's view; shown again if it was taken out (a worker
        frozen past its TTL is reaped, and forgotten in RQ, while it sleeps)."""
        if self.worker is None:
            return
        if not self.r.sismember(SimpleWorker.redis_workers_keys, self.worker.key):
            self.register_worker(self.worker.name)
        self.worker.heartbeat(ttl)

    def allowed(self, job_id: str) -> bool:
        """A job runs unless its RQ record names another function than parkq's.

        A missing record (deleted in rq-dashboard, expired) never stops a job;
        a Redis error is raised, so that the caller retries rather than refuses.
        """
        job = self.fetch(job_id)
        return job is None or job.func_name in PARKQ_FUNCTIONS

    @_view_write
    def started(self, job_id: str, ttl: int) -> None:
        job = self.fetch(job_id)
        if job is None or self.worker is None:
            self.r.lrem(self.queue.key, 0, job_id)  # off the RQ queue, record or not
            return
        with self.r.pipeline() as p:
            p.lrem(self.queue.key, 0, job_id)
            job.prepare_for_execution(self.worker.name, pipeline=p)
            self._executions[job_id] = Execution.create(
                job, ttl, pipeline=p, worker_name=self.worker.name
            )
            self.worker.set_state("busy", pipeline=p)
            p.execute()

    @_view_write
    def requeued(self, job_id: str) -> None:
        """The job waits again (parked, or its worker died)."""
        job = self.fetch(job_id)
        if job is None:
            return
        with self.r.pipeline() as p:
            self._end_execution(job, p)
            job.set_status(JobStatus.QUEUED, pipeline=p)
            p.rpush(self.queue.key, job_id)
            if self.worker is not None:
                self.worker.set_state("idle", pipeline=p)
            p.execute()

    @_view_write
    def ended(self, job_id: str, status: str, error: str = "") -> None:
        job = self.fetch(job_id)
        if job is None:
            self.r.lrem(self.queue.key, 0, job_id)
            return
        with self.r.pipeline() as p:
            p.lrem(self.queue.key, 0, job_id)  # a job ends off the RQ queue, always
            self._end_execution(job, p)
            if status == "finished":
                job.set_status(JobStatus.FINISHED, pipeline=p)
                FinishedJobRegistry(queue=self.queue).add(job, self.result_ttl, pipeline=p)
            elif status == "failed":
                job.set_status(JobStatus.FAILED, pipeline=p)
                FailedJobRegistry(queue=self.queue).add(
                    job, self.result_ttl, pipeline=p, exc_string=error
                )
            else:
                job.set_status(JobStatus.CANCELED, pipeline=p)
                CanceledJobRegistry(queue=self.queue).add(job, self.result_ttl, pipeline=p)
            p.expire(job.key, self.result_ttl)
            if self.worker is not None:
                if status == "finished":
                    self.worker.increment_successful_job_count(pipeline=p)
                elif status == "failed":
                    self.worker.increment_failed_job_count(pipeline=p)
                self.worker.set_state("idle", pipeline=p)
            p.execute()

    def _end_execution(self, job: Job, p: Any) -> None:
        execution = self._executions.pop(job.id, None)
        if execution is not None:
            execution.delete(job, pipeline=p)
