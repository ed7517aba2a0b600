"""OpenAI-compatible routes and parkq's job routes."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context

from jobs.batches import BatchStore
from jobs.constraints import (
    GrammarError,
    grammar_for_json_object,
    grammar_for_json_schema,
    grammar_for_tool_calls,
)
from jobs.events import DONE
from jobs.generation import GenerationRequest
from jobs.identity import ModelIdentity
from jobs.prompts import chat_ids
from jobs.sampling import SamplingParams
from jobs.store import QueueFull
from scheduler.policy import priority_level
from scheduler.state import TERMINAL, JobState
from web import sse
from web.errors import (
    APIError,
    BadRequest,
    Conflict,
    ContextLengthExceeded,
    ModelMismatch,
    NotFound,
    TooManyRequests,
)
from web.responses import assemble
from web.runtime import Fleet, Runtime
from web.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
    parse,
)

__all__ = ["bp"]

bp = Blueprint("api", __name__)


def rt() -> Runtime:
    runtime: Runtime = current_app.extensions["parkq"]
    return runtime


def _body() -> Any:
    try:
        return json.loads(request.get_data(cache=False))
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("The request body is not valid JSON.") from None


# -- requests -> jobs --------------------------------------------------------


def _level(req: _Common) -> int:
    try:
        return priority_level(req.priority)
    except ValueError as exc:
        raise BadRequest(str(exc), param="priority") from None


def _limit(prompt_tokens: int, asked: int | None, default: int | None) -> int:
    n_ctx = rt().n_ctx
    room = n_ctx - prompt_tokens
    if asked is None:
        asked = room if default is None else min(default, room)
        if asked < 1:
            raise ContextLengthExceeded(
                f"The prompt is {prompt_tokens} tokens; the context holds {n_ctx}, "
                "leaving no room to generate.",
                param="messages",
            )
    if prompt_tokens + asked > n_ctx:
        raise ContextLengthExceeded(
            f"This model's context holds {n_ctx} tokens, but the request needs "
            f"{prompt_tokens + asked} ({prompt_tokens} in the prompt, {asked} to generate).",
            param="max_tokens",
        )
    return asked


def _sampling(req: _Common) -> SamplingParams:
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float]:
    n_vocab = rt().vocab.n_vocab
    for token in bias or {}:
        if int(token) >= n_vocab:
            raise BadRequest(
                f"logit_bias names token {token}; the vocabulary has {n_vocab}", param="logit_bias"
            )
    return {str(int(k)): float(v) for k, v in (bias or {}).items() if v}


def _grammar(req: _Common) -> str | None:
    """The grammar of the request's ``response_format`` (None: free text)."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    try:
        if rf.type == "json_object":
            return grammar_for_json_object()
        if rf.json_schema is None:
            raise GrammarError("json_schema requires a 'json_schema' object with a 'schema'")
        return grammar_for_json_schema(rf.json_schema.json_schema)
    except GrammarError as exc:
        raise BadRequest(f"Invalid response_format: {exc}", param="response_format") from None


def _functions(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool's function name and the JSON schema of its arguments."""
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(
                "each tool must be {'type': 'function', 'function': {'name': ...}}",
                param=f"tools.{i}",
            )
        parameters = function.get("parameters") if isinstance(function, dict) else None
        out[name] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return out


def _tool_grammar(req: ChatRequest) -> str | None:
    """The grammar that ``tool_choice`` asks for: None unless a call is required."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        if req.parallel_tool_calls is False:
            raise BadRequest(
                "parallel_tool_calls=false is supported with tool_choice 'required' or a "
                "named function",
                param="parallel_tool_calls",
            )
        return None
    if not req.tools:
        raise BadRequest("tool_choice needs tools", param="tool_choice")
    functions = _functions(req.tools)
    if not isinstance(choice, str):
        name = choice.function.name
        if name not in functions:
            raise BadRequest(
                f"tool_choice names '{name}', which is not in tools", param="tool_choice"
            )
        functions = {name: functions[name]}
    if req.response_format is not None and req.response_format.type != "text":
        raise BadRequest(
            "give response_format or a required tool call, not both", param="tool_choice"
        )
    try:
        return grammar_for_tool_calls(functions, several=req.parallel_tool_calls is not False)
    except GrammarError as exc:
        raise BadRequest(f"Invalid tools: {exc}", param="tools") from None


def _chat_job(req: ChatRequest) -> GenerationRequest:
    runtime = rt()
    messages = [m.as_template_input() for m in req.messages]
    tools = None if req.tool_choice == "none" else req.tools
    grammar = _tool_grammar(req) or _grammar(req)
    try:
        ids, template_stops = chat_ids(runtime.vocab, messages, tools)
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from None
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    return GenerationRequest(
        kind="chat",
        model=runtime.model_name,
        prompt_ids=ids,
        max_tokens=_limit(len(ids), req.token_limit, None),
        sampling=_sampling(req),
        stop=tuple(req.stop or []) + tuple(template_stops),
        logprobs=req.logprobs,
        top_logprobs=top,
        ignore_eos=req.ignore_eos,
        include_usage=req.include_usage,
        tools=bool(tools),
        created=int(time.time()),
        grammar=grammar,
    )


def _completion_job(req: CompletionRequest) -> GenerationRequest:
    runtime = rt()
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < runtime.vocab.n_vocab for t in ids):
            raise BadRequest("prompt token id out of the vocabulary", param="prompt")
        text = b"".join(runtime.vocab.token_bytes(t) for t in ids).decode(errors="replace")
    else:
        text = str(prompt[0] if isinstance(prompt, list) else prompt)
        ids = runtime.vocab.tokenize(text, special=False)
    if not ids:
        raise BadRequest("The prompt is empty.", param="prompt")
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported", param="echo")
    return GenerationRequest(
        kind="completion",
        model=runtime.model_name,
        prompt_ids=ids,
        max_tokens=_limit(
            len(ids), req.token_limit, runtime.settings.completions_default_max_tokens
        ),
        sampling=_sampling(req),
        stop=tuple(req.stop or []),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        ignore_eos=req.ignore_eos,
        include_usage=req.include_usage,
        created=int(time.time()),
        grammar=_grammar(req),
        echo=text if req.echo else None,
    )


def check_model(runtime: Runtime) -> None:
    """Refuse work when workers are up and none serves this server's model."""
    if runtime.identity is None or not runtime.fleet().mismatch:
        return
    fleet = runtime.fleet(fresh=True)  # never refuse on a stale read
    if not fleet.mismatch:
        return
    ours = runtime.identity
    theirs = sorted({m.describe(): m for m in fleet.others.values()}.items())
    served = "; ".join(f"{d}, {ours.difference(m)}" for d, m in theirs)
    raise ModelMismatch(
        f"This server tokenizes for {ours.describe()}, but the live workers serve "
        f"{served}. Start the web server and the workers with the same model "
        "(PARKQ_MODEL)."
    )


def _submit(prefix: str, gen: GenerationRequest, level: int, n: int = 1) -> str:
    """Queue the request's job (``n`` > 1: one job per choice, ``<id>_<i>``, choice
    ``i`` sampled with seed + i); returns the response's id."""
    runtime = rt()
    check_model(runtime)
    response_id = f"{prefix}-{secrets.token_hex(12)}"
    if n == 1:
        _enqueue(response_id, gen, level)
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
        except TooManyRequests:
            for job_id in queued:  # all choices or none
                runtime.store.cancel(job_id, time.time())
                runtime.rq.canceled(job_id)
            raise
    if runtime.settings.preempt:
        victim = runtime.store.maybe_preempt(time.time())
        if victim is not None:
            current_app.logger.info("job %s: preempting worker %s", response_id, victim)
    return response_id


def choice_id(response_id: str, i: int) -> str:
    """The job of choice ``i`` of a request with ``n`` > 1."""
    return f"{response_id}_{i}"


def _enqueue(job_id: str, gen: GenerationRequest, level: int) -> str:
    runtime = rt()
    runtime.rq.create(job_id, f"{gen.kind} {len(gen.prompt_ids)}+{gen.max_tokens} tokens")
    try:
        runtime.store.enqueue(job_id, gen.kind, gen.to_json(), level, time.time())
    except QueueFull:
        runtime.rq.delete(job_id)
        limit = runtime.settings.max_queue
        raise TooManyRequests(
            f"The queue is full ({limit} waiting jobs); retry later.", retry_after=2
        ) from None
    current_app.logger.info("job %s: queued (priority %d)", job_id, level)
    return job_id


def _jobs_of(response_id: str) -> list[str]:
    """The jobs of a response: itself, or its choices' (``n`` > 1); [] if none."""
    store = rt().store
    if store.get(response_id) is not None:
        return [response_id]
    first = store.get(choice_id(response_id, 0))
    if first is None:
        return []
    n = int(json.loads(first["request"]).get("choices", 1))
    return [choice_id(response_id, i) for i in range(n)]


# -- responses ----------------------------------------------------------------


def _stream(response_id: str, jobs: list[str], after: list[int]) -> Response:
    runtime = rt()
    sock = request.environ.get("gunicorn.socket")  # to notice a client that left

    def gone() -> bool:
        return sse.client_gone(sock)

    def generate() -> Iterator[bytes]:
        # A first comment sends the headers at once, even while the job waits.
        yield f": parkq job {response_id}\n\n".encode()
        keepalive = runtime.settings.keepalive_seconds
        if len(jobs) == 1 and response_id == jobs[0]:
            for item in sse.events(runtime.store, jobs[0], after[0], keepalive, gone):
                yield sse.KEEPALIVE if item is None else sse.frame(*item)
        else:
            yield from _choices_stream(jobs, after, gone)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": response_id}
    return Response(stream_with_context(generate()), mimetype="text/event-stream", headers=headers)


def _choices_stream(jobs: list[str], after: list[int], gone: Callable[[], bool]) -> Iterator[bytes]:
    """The events of a request's choices (``n`` > 1) as they come, each under the
    id ``s0,s1,...``: the last event of every choice so far, which a reconnect
    sends back as Last-Event-ID. An error ends every choice and is sent once;
    then the usage chunk (when asked for) and one [DONE]."""
    runtime = rt()
    last, ended, failed = list(after), set(), False
    items = sse.merged(runtime.store, jobs, after, runtime.settings.keepalive_seconds, gone)
    for item in items:
        if item is None:
            yield sse.KEEPALIVE
            continue
        i, seq, data = item
        last[i] = seq
        if data == DONE:
            ended.add(i)
            continue
        if data.startswith('{"error"'):
            if failed:
                continue
            failed = True
            for job_id in jobs:
                runtime.store.cancel(job_id, time.time())
        yield sse.frame(_event_id(last), data)
    if len(ended) < len(jobs):
        return  # the client left
    records = [runtime.store.get(job_id) or {} for job_id in jobs]
    gen = GenerationRequest.from_json(json.loads(records[0]["request"]))
    event_id = _event_id(last)
    if gen.include_usage and not failed:
        chunk: dict[str, Any] = {
            "id": gen.response_id,
            "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
            "created": gen.created,
            "model": gen.model,
            "choices": [],
            "usage": _usage(records),
        }
        yield sse.frame(event_id, json.dumps(chunk, separators=(",", ":")))
    yield sse.frame(event_id, DONE)


def _event_id(last: list[int]) -> str:
    return ",".join(map(str, last))


def _usage(records: list[dict[str, str]]) -> dict[str, int] | None:
    """One request's usage over its choices: the prompt counted once."""
    usages = [json.loads(r.get("usage") or "null") for r in records]
    if any(u is None for u in usages):
        return None
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _collect(job_id: str) -> list[dict[str, Any]]:
    runtime = rt()
    chunks: list[dict[str, Any]] = []
    for item in sse.events(runtime.store, job_id, 0, runtime.settings.keepalive_seconds):
        if item is None or item[1] == DONE:
            continue
        chunk = json.loads(item[1])
        if "error" in chunk:
            err = chunk["error"]
            exc = Conflict(err["message"], code=err["code"])
            if err.get("type") != "cancelled":
                exc = APIError(err["message"], code=err["code"])
            raise exc
        chunks.append(chunk)
    return chunks


def _aggregate(response_id: str, jobs: list[str], gen: GenerationRequest) -> dict[str, Any]:
    """The whole response: every choice's chunks assembled (an error in one
    ends the others and is the answer)."""
    store = rt().store
    choices: list[dict[str, Any]] = []
    for i, job_id in enumerate(jobs):
        try:
            chunks = _collect(job_id)
        except APIError:
            for other in jobs:
                store.cancel(other, time.time())
            raise
        record = store.get(job_id) or {}
        usage = json.loads(record.get("usage", "null"))
        choices.extend(assemble(response_id, gen, chunks, usage, i)["choices"])
    body = assemble(response_id, gen, [], None)
    records = [store.get(job_id) or {} for job_id in jobs]
    return {**body, "choices": choices, "usage": _usage(records)}


def _run(prefix: str, req: _Common, level: int, gen: GenerationRequest) -> Any:
    response_id = _submit(prefix, gen, level, req.n)
    jobs = [response_id] if req.n == 1 else [choice_id(response_id, i) for i in range(req.n)]
    if req.stream:
        return _stream(response_id, jobs, [0] * len(jobs))
    return jsonify(_aggregate(response_id, jobs, gen))


# -- routes -------------------------------------------------------------------


@bp.post("/v1/chat/completions")
def chat_completions() -> Any:
    req = parse(ChatRequest, _body())
    return _run("chatcmpl", req, _level(req), _chat_job(req))


@bp.post("/v1/completions")
def completions() -> Any:
    req = parse(CompletionRequest, _body())
    return _run("cmpl", req, _level(req), _completion_job(req))


@bp.get("/v1/models")
def models() -> Any:
    """This server's model, then any other model a live worker serves.

    parkq extensions on each entry: ``workers`` (live workers serving it),
    ``sha256`` (the model file's digest, when known) and ``accepts_requests``
    (whether this server tokenizes for it, so requests for it can be made here).
    """
    runtime = rt()
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
            }
        )
    return jsonify({"object": "list", "data": data})


@bp.post("/v1/tokenize")
def tokenize() -> Any:
    """parkq extension: token ids of a text, or of chat messages after the template."""
    req = parse(TokenizeRequest, _body())
    runtime = rt()
    if (req.text is None) == (req.messages is None):
        raise BadRequest("Give exactly one of 'text' and 'messages'.")
    if req.messages is not None:
        messages = [m.as_template_input() for m in req.messages]
        try:
            ids, _ = chat_ids(runtime.vocab, messages)
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages") from None
    else:
        ids = runtime.vocab.tokenize(req.text or "", add_bos=False, special=False)
    return jsonify({"tokens": ids, "count": len(ids), "context_length": runtime.n_ctx})


@bp.post("/v1/detokenize")
def detokenize() -> Any:
    """parkq extension: the text of token ids (invalid UTF-8 replaced)."""
    req = parse(DetokenizeRequest, _body())
    vocab = rt().vocab
    if any(t >= vocab.n_vocab for t in req.tokens):
        raise BadRequest("token id out of the vocabulary", param="tokens")
    text = b"".join(vocab.token_bytes(t) for t in req.tokens).decode("utf-8", errors="replace")
    return jsonify({"text": text})


@bp.get("/healthz")
def healthz() -> Any:
    runtime = rt()
    fleet = Fleet({}, {})
    try:
        runtime.store.r.ping()
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
        "queue_position": rt().store.queue_position(job_id),
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
    store = rt().store
    records = [store.get(j) or {} for j in jobs]
    if jobs == [job_id]:
        return jsonify(_status(job_id, records[0]))
    choices = [_status(j, r) for j, r in zip(jobs, records, strict=True)]
    body = {
        "id": job_id,
        "object": "job",
        "kind": records[0].get("kind"),
        "state": _overall([c["state"] for c in choices]),
        "priority": choices[0]["priority"],
        "tokens": sum(c["tokens"] for c in choices),
        "preemptions": sum(c["preemptions"] for c in choices),
        "usage": _usage(records),
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
    if min(after) < 0:
        raise BadRequest("Last-Event-ID must not be negative.")
    return _stream(job_id, jobs, after)


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> Any:
    """Cancel a job (for a request with ``n`` > 1, every choice)."""
    jobs = _jobs(job_id)
    results = [_cancel(j) for j in jobs]
    if all(r.startswith("ended:") for r in results):
        state = _overall([r.removeprefix("ended:") for r in results])
        raise Conflict(f"Job '{job_id}' has already ended ({state}).", code="job_ended")
    if "cancelling" in results:
        current_app.logger.info("job %s: cancel requested while running", job_id)
        return jsonify({"id": job_id, "object": "job", "state": "cancelling"}), 202
    return jsonify({"id": job_id, "object": "job", "state": "cancelled"})


def _cancel(job_id: str) -> str:
    """Cancel one job: "cancelled", "cancelling" (it runs) or "ended:<state>"."""
    runtime = rt()
    result = runtime.store.cancel(job_id, time.time())
    if result is None:
        raise NotFound(f"No job with id '{job_id}'.", param="job_id")
    if (batch := runtime.store.batch_of(job_id)) is not None:
        BatchStore(runtime.store).feed(batch)  # its place in the batch's window is free
    if result == "cancelled":
        runtime.store.count("jobs_cancelled")
        runtime.rq.canceled(job_id)
        current_app.logger.info("job %s: cancelled while waiting", job_id)
    return result
