"""The worker process: claim the best job, run it on the engine, repeat.

One process per GPU, no fork (llama.cpp's thread pool does not survive one),
the model loaded once. Liveness is a heartbeat in Redis (parkq's and RQ's),
kept up while a job generates.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import redis

from jobs.engine import Engine, EngineError
from jobs.events import DONE, error_event
from jobs.generation import Generation, GenerationRequest
from jobs.rqjobs import RQBridge
from jobs.runner import Outcome, drive
from jobs.store import Claim, Fenced, Store
from scheduler.settings import Settings
from scheduler.state import JobState

__all__ = ["Worker", "default_worker_name"]

log = logging.getLogger(__name__)


def default_worker_name() -> str:
    return f"{socket.gethostname()}.{os.getpid()}"


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        client: redis.Redis,
        name: str | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.store = Store(client, settings)
        self.rq = RQBridge(client, settings.queue_name, settings.result_ttl)
        self.name = name or settings.worker_name or default_worker_name()
        self.stopping = threading.Event()
        self._next_beat = 0.0

    # -- lifecycle --------------------------------------------------------

    def run(self) -> None:
        """Work until :meth:`stop` is called."""
        self.rq.register_worker(self.name)
        log.info("worker %s ready (n_ctx=%d)", self.name, self.engine.n_ctx)
        try:
            while not self.stopping.is_set():
                self.beat(force=False)
                claim = self.store.claim(self.name, time.time())
                if claim is None:
                    self.store.wait_for_work(timeout=min(1.0, self.settings.heartbeat_seconds))
                    continue
                self.execute(claim)
        finally:
            try:
                self.store.remove_worker(self.name)
                self.rq.unregister_worker()
            except redis.ConnectionError:
                log.warning("worker %s: Redis gone; could not sign off", self.name)
            log.info("worker %s stopped", self.name)

    def stop(self) -> None:
        self.stopping.set()

    def beat(self, force: bool = True) -> None:
        now = time.time()
        if force or now >= self._next_beat:
            self._next_beat = now + self.settings.heartbeat_seconds
            self.store.heartbeat(self.name, now, self.settings.worker_ttl)
            self.rq.heartbeat(int(self.settings.worker_ttl) + 60)

    # -- one job ----------------------------------------------------------

    def execute(self, claim: Claim) -> None:
        job_id, token = claim.job_id, claim.exec_token
        record = self.store.get(job_id)
        if record is None:
            return
        if not self.rq.allowed(job_id):
            log.warning("job %s: refused, not a parkq job", job_id)
            self._fail(claim, "refused: not a parkq job", "invalid_job")
            return
        request = GenerationRequest.from_json(json.loads(record["request"]))
        gen = Generation(job_id, request, self.engine.token_bytes, self.engine.is_eog)
        log.info(
            "job %s: running on %s (%d prompt tokens)", job_id, self.name, len(request.prompt_ids)
        )
        self.rq.started(job_id, int(self.settings.worker_ttl) + 60)

        def emit(payloads: list[str], tokens: int) -> int:
            self.beat(force=False)
            return self.store.step(job_id, token, self.name, tokens, payloads)

        try:
            outcome = drive(self.engine, gen, emit, self.settings.n_batch)
        except Fenced:
            log.warning("job %s: execution %s was superseded; dropping it", job_id, token)
            return
        except (EngineError, ValueError) as exc:
            log.exception("job %s: engine error", job_id)
            self._fail(claim, f"engine error: {exc}", "engine_error")
            return
        self._end(claim, gen, outcome)

    def _end(self, claim: Claim, gen: Generation, outcome: Outcome) -> None:
        job_id = claim.job_id
        if outcome.state == "cancelled":
            payloads = [error_event("The job was cancelled.", "cancelled", "job_cancelled"), DONE]
            fields = {"finish_reason": "cancelled", "tokens": str(len(gen.generated))}
            state = JobState.CANCELLED
        else:
            fields = {
                "finish_reason": gen.finish_reason or "",
                "usage": json.dumps(gen.usage),
                "tokens": str(len(gen.generated)),
            }
            payloads = outcome.payloads
            state = JobState.FINISHED
        try:
            self.store.finish(job_id, claim.exec_token, self.name, state, fields, payloads)
        except Fenced:
            log.warning(
                "job %s: execution %s was superseded; dropping it", job_id, claim.exec_token
            )
            return
        self.rq.ended(job_id, state.value if state != JobState.CANCELLED else "canceled")
        log.info(
            "job %s: %s (%s, %d tokens)",
            job_id,
            state.value,
            fields["finish_reason"],
            len(gen.generated),
        )

    def _fail(self, claim: Claim, message: str, code: str) -> None:
        payloads = [error_event(message, "server_error", code), DONE]
        try:
            self.store.finish(
                claim.job_id,
                claim.exec_token,
                self.name,
                JobState.FAILED,
                {"error": message},
                payloads,
            )
        except Fenced:
            return
        self.rq.ended(claim.job_id, "failed", error=message)
