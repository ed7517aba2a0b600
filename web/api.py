"""OpenAI-compatible routes and parkq's job routes."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from jobs.engine.request import GenerationRequest
from jobs.store.batches import BatchStore
from jobs.store.identity import ModelIdentity
from jobs.store.scheduling import Cancelled, Ending, JobEnded, QueueFull, TenantQueueFull
from scheduler.policy import tier_of
from scheduler.state import TERMINAL, JobState
from web import limits
from web.errors import (
    BadRequest,
    Conflict,
    Gone,
    NotFound,
    TooManyRequests,
)
from web.intake import chat_job, check_model, completion_job, priority, prompt_ids, read_body
from web.responses import (
    ClientGone,
    aggregate,
    assemble,
    result_of,
    stamp_of,
    stream,
    usage_of,
)
from web.runtime import Fleet, current
from web.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    parse,
)
from web.tenants import caller, sees

__all__ = ["bp"]

bp = Blueprint("api", __name__)


def submit(
    prefix: str,
    gen: GenerationRequest,
    level: int,
    n: int = 1,
    response_id: str | None = None,
    extra: dict[str, str] | None = None,
) -> str:
    """Queue the request's job (``n`` > 1: one job per choice, ``<id>_<i>``, choice
    ``i`` sampled with seed + i); returns the response's id (``response_id``
    where given; ``extra``: more fields of the job's record)."""
    runtime = current()
    check_model(runtime)
    response_id = response_id or f"{prefix}-{secrets.token_hex(12)}"
    # The tenant's token rate: its prompt and most output tokens, per choice.
    who = caller()
    most = who.policy.max_queued
    if most and n > most:  # (each choice waits as a job: it could never be taken)
        raise BadRequest(
            f"n is {n}, more than the {most} jobs this key's tenant may have waiting "
            "(max_queued in PARKQ_KEYS_FILE).",
            param="n",
        )
    rate = who.policy.tokens_per_minute
    cost = (len(gen.prompt_ids) + gen.max_tokens) * n
    limits.admit(runtime.store, who.tenant, rate, cost, time.time())
    try:
        _submit(response_id, gen, level, n, extra)
    except Exception:
        if rate:  # not queued: its tokens go back
            limits.take(runtime.store, who.tenant, rate, -cost, time.time())
        raise
    if runtime.settings.preempt:
        victim = runtime.store.maybe_preempt(time.time())
        if victim is not None:
            current_app.logger.info("job %s: preempting worker %s", response_id, victim)
    return response_id


def _submit(
    response_id: str, gen: GenerationRequest, level: int, n: int, extra: dict[str, str] | None
) -> None:
    runtime = current()
    if n == 1:
        _enqueue(response_id, gen, level, extra)
    else:
        queued: list[str] = []
        try:
            for i in range(n):
                choice = replace(
                    gen,
                    choice=i,
                    choices=n,
                    response_id=response_id,
                    sampling=replace(gen.sampling, seed=gen.sampling.seed + i),
                )
                queued.append(_enqueue(choice_id(response_id, i), choice, level))
        except Exception:  # the queue full, Redis failing: all choices or none
            runtime.store.cancel_live(queued, time.time())
            for job_id in queued:
                runtime.rq.canceled(job_id)
            raise


def choice_id(response_id: str, i: int) -> str:
    """The job of choice ``i`` of a request with ``n`` > 1."""
    return f"{response_id}_{i}"


def _enqueue(
    job_id: str, gen: GenerationRequest, level: int, extra: dict[str, str] | None = None
) -> str:
    """Queue one job (once the replicas hold it: PARKQ_DURABLE_REPLICAS)."""
    runtime = current()
    who = caller()
    runtime.rq.create(job_id, f"{gen.kind} {len(gen.prompt_ids)}+{gen.max_tokens} tokens")
    try:
        policy = who.policy
        if policy.parks_others != "all":  # (maybe_preempt reads it)
            extra = {**(extra or {}), "parks_others": policy.parks_others}
        if policy.max_running:  # (claim.lua reads it)
            extra = {**(extra or {}), "max_running": str(policy.max_running)}
        runtime.store.enqueue(
            job_id, gen.kind, gen.to_json(), level, time.time(), who.tenant, extra,
            weight=policy.weight, max_queued=policy.max_queued or 0,
            caps=bool(policy.max_running or policy.max_queued),
        )  # fmt: skip
    except TenantQueueFull:
        runtime.rq.delete(job_id)
        raise TooManyRequests(
            f"This key's tenant has {who.policy.max_queued} jobs waiting, its most "
            "(max_queued in PARKQ_KEYS_FILE); retry when one has started.",
            retry_after=2,
            code="queued_jobs_exceeded",
        ) from None
    except QueueFull:
        runtime.rq.delete(job_id)
        limit = runtime.settings.max_queue
        raise TooManyRequests(
            f"The queue is full ({limit} waiting jobs); retry later.", retry_after=2
        ) from None
    if who.label:
        runtime.store.telemetry.count(f"requests_by_key:{who.label}")
        current_app.logger.info("job %s: queued (priority %d) for %s", job_id, level, who.label)
    else:
        current_app.logger.info("job %s: queued (priority %d)", job_id, level)
    return job_id


def _jobs_of(response_id: str) -> list[str]:
    """The jobs of a response: itself, or its choices' (``n`` > 1); [] if none,
    or if they are another tenant's (web/tenants.py)."""
    store = current().store
    owner, state = store.r.hmget(store.keys.job(response_id), ["owner", "state"])
    if state is not None:
        return [response_id] if sees(owner) else []
    first, owner = store.r.hmget(store.keys.job(choice_id(response_id, 0)), ["request", "owner"])
    if first is None or not sees(owner):
        return []
    n = int(json.loads(first).get("choices", 1))
    return [choice_id(response_id, i) for i in range(n)]


def _run(prefix: str, req: _Common, level: int, gen: GenerationRequest) -> Any:
    # A slot first (503 past PARKQ_MAX_STREAMS): no job is queued for a request
    # the server has no room to answer.
    release = current().slots.take()
    try:
        response_id = submit(prefix, gen, level, req.n)
    except BaseException:
        release()
        raise
    jobs = [response_id] if req.n == 1 else [choice_id(response_id, i) for i in range(req.n)]
    if req.stream:
        try:
            resp = stream(response_id, jobs, [0] * len(jobs))
        except BaseException:
            release()
            raise
        resp.call_on_close(release)  # the stream ended, or its client left
        return resp
    try:
        return jsonify(aggregate(response_id, jobs, gen))
    except ClientGone:
        # Nobody is left to read an answer (499: the client closed the request).
        return Response(status=499)
    finally:
        release()


# -- routes -------------------------------------------------------------------


@bp.post("/v1/chat/completions")
def chat_completions() -> Any:
    req = parse(ChatRequest, read_body())
    level = priority(req)
    return _run("chatcmpl", req, level, replace(chat_job(req), service_tier=tier_of(level)))


@bp.post("/v1/completions")
def completions() -> Any:
    req = parse(CompletionRequest, read_body())
    level = priority(req)
    return _run("cmpl", req, level, replace(completion_job(req), service_tier=tier_of(level)))


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str) -> Any:
    """One model of :func:`models` by its id (``client.models.retrieve``)."""
    for entry in _models():
        if entry["id"] == model_id:
            return jsonify(entry)
    raise NotFound(f"The model '{model_id}' does not exist.", param="model",
                   code="model_not_found")  # fmt: skip


@bp.get("/v1/models")
def models() -> Any:
    """This server's model, then any other model a live worker serves.

    parkq extensions on each entry: ``workers`` (live workers serving it),
    ``sha256`` (the model file's digest, when known), ``accepts_requests``
    (whether this server tokenizes for it, so requests for it can be made here)
    and ``exactness`` (what each distinct worker setup's batching checks
    certified, in words).
    """
    return jsonify({"object": "list", "data": _models()})


def _models() -> list[dict[str, Any]]:
    runtime = current()
    fleet = runtime.fleet(fresh=True)
    own = runtime.identity
    data = [
        {
            "id": runtime.model_name,
            "object": "model",
            "created": runtime.started,
            "owned_by": "parkq",
            "context_length": runtime.n_ctx,
            "workers": len(fleet.matching),
            "sha256": own.digest if own else None,
            "accepts_requests": True,
            "exactness": sorted({m.exactness for m in fleet.matching.values() if m}),
        }
    ]
    served: dict[str, list[ModelIdentity]] = {}
    for model in fleet.others.values():
        served.setdefault(model.digest, []).append(model)
    for digest, same in sorted(served.items(), key=lambda kv: kv[1][0].name):
        data.append(
            {
                "id": same[0].name,
                "object": "model",
                "created": runtime.started,
                "owned_by": "parkq",
                "context_length": min(m.n_ctx for m in same),
                "workers": len(same),
                "sha256": digest,
                "accepts_requests": False,
                "exactness": sorted({m.exactness for m in same}),
            }
        )
    return data


@bp.post("/v1/tokenize")
def tokenize() -> Any:
    """parkq extension: token ids of a text, or of chat messages after the template."""
    req = parse(TokenizeRequest, read_body())
    runtime = current()
    if (req.text is None) == (req.messages is None):
        raise BadRequest("Give exactly one of 'text' and 'messages'.")
    if req.messages is not None:
        ids, _ = prompt_ids(runtime.vocab, [m.as_template_input() for m in req.messages])
    else:
        ids = runtime.vocab.tokenize(req.text or "", add_bos=False, special=False)
    return jsonify({"tokens": ids, "count": len(ids), "context_length": runtime.n_ctx})


@bp.post("/v1/detokenize")
def detokenize() -> Any:
    """parkq extension: the text of token ids (invalid UTF-8 replaced)."""
    req = parse(DetokenizeRequest, read_body())
    vocab = current().vocab
    if any(t >= vocab.n_vocab for t in req.tokens):
        raise BadRequest("token id out of the vocabulary", param="tokens")
    text = b"".join(vocab.token_bytes(t) for t in req.tokens).decode("utf-8", errors="replace")
    return jsonify({"text": text})


@bp.get("/livez")
def livez() -> Any:
    """The process answers (a liveness probe: nothing else is asked, so Redis
    down or no worker up does not get a healthy web process restarted)."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
@bp.get("/healthz")
def healthz() -> Any:
    """Ready to serve (a readiness probe): Redis answers and a live worker
    serves this server's model; 503 otherwise."""
    runtime = current()
    fleet = Fleet({}, {})
    try:
        runtime.store.ping()
        fleet = runtime.fleet(fresh=True)
        redis_ok = True
    except Exception:
        redis_ok = False
    ok = redis_ok and bool(fleet.matching)
    status = "ok" if ok else "model_mismatch" if fleet.mismatch else "unavailable"
    body: dict[str, Any] = {
        "status": status,
        "redis": redis_ok,
        "workers": len(fleet.matching),
        "model": runtime.model_name,
    }
    if fleet.others:
        body["other_models"] = sorted({m.describe() for m in fleet.others.values()})
    return jsonify(body), 200 if ok else 503


def _jobs(job_id: str) -> list[str]:
    jobs = _jobs_of(job_id)
    if not jobs:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    return jobs


def _float(record: dict[str, str], key: str) -> float | None:
    value = record.get(key)
    return float(value) if value else None


def _status(job_id: str, record: dict[str, str]) -> dict[str, Any]:
    return {
        "id": job_id,
        "object": "job",
        "kind": record.get("kind"),
        "state": record.get("state"),
        "priority": int(record.get("priority", 0)),
        "queue_position": current().store.queue_position(job_id),
        "tokens": int(record.get("tokens", 0)),
        "events": int(record.get("seq", 0)),
        "preemptions": int(record.get("preemptions", 0)),
        "worker": record.get("worker"),
        "created_at": _float(record, "created_at"),
        "started_at": _float(record, "started_at"),
        "finished_at": _float(record, "finished_at"),
        "finish_reason": record.get("finish_reason"),
        "usage": json.loads(record["usage"]) if record.get("usage") else None,
        "error": record.get("error"),
    }


def _overall(states: list[str]) -> str:
    """The state of a request from its choices' states."""
    if all(JobState(s) in TERMINAL for s in states):
        for state in (JobState.FAILED, JobState.CANCELLED):
            if state in states:
                return state.value
        return JobState.FINISHED.value
    for state in (JobState.RUNNING, JobState.PARKING, JobState.PARKED):
        if state in states:
            return state.value
    return JobState.RUNNING.value if JobState.FINISHED in states else JobState.QUEUED.value


@bp.get("/v1/jobs/<job_id>")
def job_status(job_id: str) -> Any:
    """A job's state; for a request with ``n`` > 1, its choices' jobs in ``choices``."""
    jobs = _jobs(job_id)
    store = current().store
    records = [store.get(j) or {} for j in jobs]
    if jobs == [job_id]:
        return jsonify(_status(job_id, records[0]))
    gone = [i for i, record in enumerate(records) if not record.get("state")]
    if gone:
        ttl = current().settings.result_ttl
        raise Gone(
            f"The record of choice {gone[0]} of job '{job_id}' has expired (a job's record is "
            f"kept {ttl} s after it ends): the job's state is no longer known."
        )
    choices = [_status(j, r) for j, r in zip(jobs, records, strict=True)]
    body = {
        "id": job_id,
        "object": "job",
        "kind": records[0].get("kind"),
        "state": _overall([c["state"] for c in choices]),
        "priority": choices[0]["priority"],
        "tokens": sum(c["tokens"] for c in choices),
        "preemptions": sum(c["preemptions"] for c in choices),
        "usage": usage_of(records),
        "choices": choices,
    }
    return jsonify(body)


@bp.get("/v1/jobs/<job_id>/events")
def job_events(job_id: str) -> Any:
    """A job's events after Last-Event-ID; for a request with ``n`` > 1 the id is
    the stream's own ``s0,s1,...``."""
    jobs = _jobs(job_id)
    raw = request.headers.get("Last-Event-ID") or request.args.get("last_event_id") or "0"
    try:
        after = [int(part) for part in raw.split(",")]
    except ValueError:
        raise BadRequest("Last-Event-ID must be an event id (an integer).") from None
    if len(jobs) > 1 and after == [0]:
        after = [0] * len(jobs)
    if len(after) != len(jobs):
        raise BadRequest(
            f"Last-Event-ID must be an event id of this stream: {len(jobs)} integers, "
            "comma-separated (one per choice)."
        )
    if min(after) < 0 or max(after) >= 2**63:
        raise BadRequest("Last-Event-ID must be an event id: from 0 to 2^63 - 1.")
    store = current().store
    ends = [store.ending(j) for j in jobs]
    if all(e is not None and a >= e.final_seq for e, a in zip(ends, after, strict=True)):
        # The client has every event up to the [DONE]: nothing to send. 204 also
        # tells a browser's EventSource to stop reconnecting.
        return Response(status=204)
    pairs = list(zip(ends, after, strict=True))
    if any(e is not None and e.expired and a < e.final_seq for e, a in pairs):
        raise Gone(expired_message(job_id, ends))
    release = current().slots.take()
    try:
        resp = stream(job_id, jobs, after)
    except BaseException:
        release()
        raise
    resp.call_on_close(release)
    return resp


def expired_message(job_id: str, ends: list[Ending | None]) -> str:
    """What a client that lacks events gone past the replay window is told."""
    seconds = current().settings.replay_seconds
    head = (f"The events of job '{job_id}' after that id have expired (they are kept "
            f"{seconds} s after the job ends)")  # fmt: skip
    if any(e is not None and e.state is not JobState.FINISHED for e in ends):
        return f"{head}; it ended without a result: GET /v1/jobs/{job_id} has its state."
    if current().store.batch_of(job_id) is not None:
        return f"{head}; its result is in its batch's output file."
    return f"{head}; GET /v1/jobs/{job_id}/result has its result."


@bp.get("/v1/jobs/<job_id>/result")
def job_result(job_id: str) -> Any:
    """An ended job's whole response, as a non-streamed request would have had it
    (for a request with ``n`` > 1, every choice); kept PARKQ_RESULT_TTL."""
    jobs = _jobs(job_id)
    store = current().store
    records = [store.get(j) or {} for j in jobs]
    for record in records:
        if not record:
            raise Gone(f"The result of job '{job_id}' has expired.")
        state = JobState(record["state"])
        if state not in TERMINAL:
            raise Conflict(f"Job '{job_id}' has not ended yet ({state.value}).", code="job_running")
        if state is JobState.CANCELLED:
            raise Conflict(f"Job '{job_id}' was cancelled: it has no result.", code="job_cancelled")
        if state is JobState.FAILED:
            reason = record.get("error") or "no reason recorded"
            raise Conflict(f"Job '{job_id}' failed ({reason}): it has no result.",
                           code="job_failed")  # fmt: skip
    choices: list[dict[str, Any]] = []
    for i, (j, record) in enumerate(zip(jobs, records, strict=True)):
        body = result_of(store, j, record)
        if body is None:
            where = "its batch's output file" if record.get("batch") else "nowhere now"
            raise Gone(f"The events of job '{job_id}' have expired; its result is in {where}.")
        choices.extend({**c, "index": i} for c in body["choices"])
    gen = GenerationRequest.from_json(json.loads(records[0]["request"]))
    base = assemble(job_id, gen, [], None)
    return jsonify({**base, **stamp_of(jobs[0]), "choices": choices, "usage": usage_of(records)})


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> Any:
    """Cancel a job (for a request with ``n`` > 1, every choice)."""
    outcomes: list[Cancelled] = []
    ended: list[str] = []
    for j in _jobs(job_id):
        try:
            outcomes.append(_cancel(j))
        except JobEnded as exc:
            ended.append(exc.state.value)
    if not outcomes:
        state = _overall(ended)
        raise Conflict(f"Job '{job_id}' has already ended ({state}).", code="job_ended")
    if Cancelled.CANCELLING in outcomes:
        current_app.logger.info("job %s: cancel requested while running", job_id)
        return jsonify({"id": job_id, "object": "job", "state": "cancelling"}), 202
    return jsonify({"id": job_id, "object": "job", "state": "cancelled"})


def _cancel(job_id: str) -> Cancelled:
    """Cancel one job (:class:`JobEnded` if it has ended)."""
    runtime = current()
    result = runtime.store.cancel(job_id, time.time())
    if result is None:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    if (batch := runtime.store.batch_of(job_id)) is not None:
        BatchStore(runtime.store).feed(batch)  # its place in the batch's window is free
    if result is Cancelled.CANCELLED:
        runtime.store.telemetry.count("jobs_cancelled")
        runtime.rq.canceled(job_id)
        current_app.logger.info("job %s: cancelled while waiting", job_id)
    return result
