"""OpenAI's Responses API: ``/v1/responses`` on parkq's jobs.

A response is a chat job (it queues, runs, parks and resumes as any job does)
whose record also holds the response's own fields (``response``: what the
request asked for, its input items and its conversation). ``background``
responses are answered at once and run to their end whether anyone reads
them; ``GET /v1/responses/{id}?stream=true&starting_after=N`` replays their
events after N and follows them live. The events are made from the job's
events as they are read (web/response_events.py), so they are the same at
every reading.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context

from jobs.engine.request import GenerationRequest
from jobs.store.events import DONE, error_event
from jobs.store.scheduling import Cancelled, JobEnded
from scheduler.policy import tier_of
from scheduler.state import TERMINAL, JobState
from web import sse
from web.api import submit
from web.errors import BadRequest, Conflict, Gone, NotFound
from web.intake import chat_job, priority, read_body
from web.response_events import (
    Translator,
    chunks_of_result,
    input_messages,
    output_messages,
)
from web.responses import EXPIRED, ClientGone, result_of, stamp_of
from web.runtime import current
from web.schemas import ChatRequest, ResponsesRequest, parse
from web.tenants import sees

__all__ = ["bp"]

bp = Blueprint("responses_api", __name__)

#: How long a cancel or a delete waits for a running response's worker to stop it.
STOP_WAIT_SECONDS = 10.0


# -- create ------------------------------------------------------------------------


@bp.post("/v1/responses")
def create() -> Any:
    body = read_body()
    req = parse(ResponsesRequest, body)
    if req.background and not req.store:
        raise BadRequest("A background response is stored: store=false cannot be used with "
                         "background=true.", param="store")  # fmt: skip
    previous: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = _conversation_after(req.previous_response_id)
    response_id = f"resp_{secrets.token_hex(24)}"
    gen, level, extra = response_job(req, body, response_id, previous)
    base = json.loads(extra["response"])["base"]
    if req.background and not req.stream:
        submit("resp", gen, level, response_id=response_id, extra=extra)
        return jsonify(Translator(base, queued=True).response())
    release = current().slots.take()  # a stream, or a request that waits
    try:
        submit("resp", gen, level, response_id=response_id, extra=extra)
        if req.stream:
            resp = _stream(response_id, base, req.background, -1)
            resp.call_on_close(release)
            release = _nothing
            return resp
        try:
            return jsonify(_wait(response_id, base))
        except ClientGone:
            return Response(status=499)
    finally:
        release()


def _nothing() -> None:
    pass


def response_job(
    req: ResponsesRequest, body: dict[str, Any], response_id: str, previous: list[dict[str, Any]]
) -> tuple[GenerationRequest, int, dict[str, str]]:
    """The job of response ``response_id`` (continuing the ``previous`` messages),
    its priority level, and the record fields that keep the response's own data."""
    items = _input_items(req)
    conversation = previous + input_messages(items)
    chat = _chat_request(req, body, conversation)
    level = priority(chat)
    try:
        gen = chat_job(chat)
    except BadRequest as exc:  # named as the Responses API names its fields
        exc.param = _param(exc.param)
        raise
    tier = tier_of(level)
    gen = replace(gen, background=req.background, service_tier=tier, include_usage=True)
    base = _base(response_id, req, gen.created, gen.model, tier)
    kept = {"base": base, "input": _with_ids(response_id, items), "conversation": conversation}
    return gen, level, {"response": json.dumps(kept, separators=(",", ":"))}


def batch_line_job(body: dict[str, Any], job_id: str) -> tuple[GenerationRequest, dict[str, str]]:
    """A ``/v1/responses`` batch line's job (``body``: the line's body, its
    priority and stream already set) and the record fields it keeps; raises
    :class:`BadRequest` as a request would. The response's id is the job's."""
    req = parse(ResponsesRequest, body)
    if req.previous_response_id is not None:
        raise BadRequest("A batch line cannot continue a response: previous_response_id is "
                         "not supported in a batch.", param="previous_response_id")  # fmt: skip
    if req.background:
        raise BadRequest("A batch line runs in the batch: background is not supported in a "
                         "batch.", param="background")  # fmt: skip
    gen, _, extra = response_job(req, body, batch_response_id(job_id), [])
    return gen, extra


def batch_response_id(job_id: str) -> str:
    """The response id of a batch line's job (``batchreq_<hex>`` -> ``resp_<hex>``)."""
    return "resp_" + job_id.split("_", 1)[1]


def batch_result(job_id: str, record: dict[str, str]) -> dict[str, Any]:
    """A finished batch line's response object, as the Responses API returns it."""
    kept = json.loads(record["response"])
    t = Translator(kept["base"], queued=False)
    t.start()
    for _, data in current().store.events_after(job_id, 0):
        t.feed(data)
    return {**t.response(), **_fingerprint(job_id)}


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump() for item in req.input]


def _chat_request(
    req: ResponsesRequest, body: dict[str, Any], messages: list[dict[str, Any]]
) -> ChatRequest:
    """The chat request the response's job runs: ``instructions`` as the system
    message (not carried over by ``previous_response_id``), the sampling
    fields, the tools and ``text.format`` in their chat shapes."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": system + messages,
        "stream_options": {"include_usage": True},
    }
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "seed", "service_tier", "parallel_tool_calls", "user",
                 "ignore_eos"):  # fmt: skip
        value = getattr(req, name)
        if value is not None:
            chat[name] = value
    if "priority" in body:  # parkq's own field wins over service_tier, as on chat
        chat["priority"] = req.priority
    if req.tools is not None:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            choice if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )  # fmt: skip
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema or {},
                            "strict": fmt.strict},
        }  # fmt: skip
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    try:
        return parse(ChatRequest, chat)
    except BadRequest as exc:  # a field the response request passed on
        exc.param = _param(exc.param)
        raise


def _param(chat_param: str | None) -> str | None:
    """A chat field's name as the Responses API names it."""
    if chat_param is None:
        return None
    head = chat_param.split(".", 1)[0]
    names = {"messages": "input", "max_completion_tokens": "max_output_tokens",
             "max_tokens": "max_output_tokens", "response_format": "text.format"}  # fmt: skip
    return names.get(head, chat_param)


def _base(
    response_id: str, req: ResponsesRequest, created: int, model: str, tier: str
) -> dict[str, Any]:
    """The fields of the response object that do not change."""
    fmt = req.text.format if req.text is not None else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None:
        text_format = fmt.model_dump(by_alias=True, exclude_none=True)
    choice: Any = "auto"
    if isinstance(req.tool_choice, str):
        choice = req.tool_choice
    elif req.tool_choice is not None:
        choice = req.tool_choice.model_dump()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "background": req.background,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": tier,
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format},
        "tool_choice": choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }


def _with_ids(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as ``input_items`` lists them: each with an id of its own."""
    hex_ = response_id.removeprefix("resp_")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        item_id = f"in_{hex_}_{i}"
        if item["type"] == "message":
            content = item["content"]
            kind = "output_text" if item["role"] == "assistant" else "input_text"
            parts = ([{"type": kind, "text": content}] if isinstance(content, str)
                     else [{"type": p["type"], "text": p["text"]} for p in content])  # fmt: skip
            out.append({"id": item_id, "type": "message", "role": item["role"],
                        "content": parts, "status": "completed"})  # fmt: skip
        else:
            out.append({"id": item_id, **item, "status": "completed"})
    return out


def _conversation_after(previous_id: str) -> list[dict[str, Any]]:
    """The chat messages a response continuing ``previous_id`` starts from: that
    response's conversation (without its instructions) and its output."""
    record, kept = _response(previous_id, param="previous_response_id")
    state = JobState(record["state"])
    if state is not JobState.FINISHED:
        what = "has not ended" if state not in TERMINAL else f"ended {state.value}"
        raise BadRequest(f"The previous response '{previous_id}' {what}: only a completed or "
                         "incomplete response can be continued.",
                         param="previous_response_id")  # fmt: skip
    output = _translated(previous_id, record, kept).output
    conversation: list[dict[str, Any]] = kept["conversation"]
    return conversation + output_messages(output)


# -- reading ---------------------------------------------------------------------


def _response(response_id: str, param: str = "response_id") -> tuple[dict[str, str], Any]:
    """A response's job record and its own fields; 404 unless it exists, is a
    response and is the caller's."""
    record = current().store.get(response_id)
    if not record or "response" not in record or not sees(record.get("owner")):
        raise NotFound(f"No response with id '{response_id}'.", param=param)
    return record, json.loads(record["response"])


def _translated(response_id: str, record: dict[str, str], kept: Any) -> Translator:
    """Every event of the response so far through a :class:`Translator`: the
    job's stored events, or (once they expired) its kept result."""
    t = Translator(kept["base"], queued=bool(kept["base"]["background"]))
    t.start()
    events = [data for _, data in current().store.events_after(response_id, 0)]
    if not events and JobState(record["state"]) in TERMINAL:
        events = _kept_events(response_id, record)
    for data in events:
        t.feed(data)
    return t


def _kept_events(response_id: str, record: dict[str, str]) -> list[str]:
    """What stands in for an ended response's expired events: its kept result
    (the janitor keeps one for a finished response, and for a cancelled or
    failed one what it had written) as chat chunks, ended as the job ended."""
    store = current().store
    state = JobState(record["state"])
    ended = None
    if state is JobState.CANCELLED:
        ended = error_event("The response was cancelled.", "cancelled", "cancelled")
    elif state is JobState.FAILED:
        ended = error_event(record.get("error") or "The response failed.", "server_error",
                            record.get("error_code") or "failed")  # fmt: skip
    body = result_of(store, response_id, record)
    if body is None:  # nothing kept: what it said is gone, not what it was
        gone = error_event(f"The output of response '{response_id}' has expired.",
                           "server_error", EXPIRED)  # fmt: skip
        return [ended or gone, DONE]
    return list(chunks_of_result(body, ended))


def _status(record: dict[str, str]) -> str:
    """The response's status from its job's state (before its events end it)."""
    state = JobState(record["state"])
    if state is JobState.QUEUED:
        return "queued"
    if state is JobState.CANCELLED:
        return "cancelled"
    if state is JobState.FAILED:
        return "failed"
    return "in_progress"


def _object(response_id: str) -> dict[str, Any]:
    record, kept = _response(response_id)
    t = _translated(response_id, record, kept)
    body = t.response(_status(record))
    if body["status"] == "failed" and body["error"] is None:
        body["error"] = {"code": "server_error", "message": record.get("error") or "failed"}
    return {**body, **_fingerprint(response_id)}


def _fingerprint(response_id: str) -> dict[str, str]:
    fp = stamp_of(response_id).get("system_fingerprint")
    return {} if fp is None else {"system_fingerprint": fp}


@bp.get("/v1/responses/<response_id>")
def retrieve(response_id: str) -> Any:
    """The response (``stream=true``: its events after ``starting_after``, then
    live)."""
    _, kept = _response(response_id)
    stream = _flag("stream")
    given = request.args.getlist("starting_after")
    raw = given[0] if given else request.headers.get("Last-Event-ID") or "-1"
    try:
        after = int(raw)
        if len(given) > 1:
            raise ValueError(raw)
    except ValueError:
        raise BadRequest("starting_after must be one event's sequence_number (an integer).",
                         param="starting_after") from None  # fmt: skip
    if after < -1 or after >= 2**63:
        raise BadRequest("starting_after must be from -1 to 2^63 - 1.", param="starting_after")
    if not stream:
        return jsonify(_object(response_id))
    ending = current().store.ending(response_id)
    if ending is not None and ending.expired and after >= 0:
        raise Gone(f"The events of response '{response_id}' have expired (they are kept "
                   f"{current().settings.replay_seconds} s after it ends): GET "
                   f"/v1/responses/{response_id} has the whole response.")  # fmt: skip
    release = current().slots.take()
    try:
        resp = _stream(response_id, kept["base"], bool(kept["base"]["background"]), after)
    except BaseException:
        release()
        raise
    resp.call_on_close(release)
    return resp


def _flag(name: str) -> bool:
    """A boolean query parameter: ``true`` or ``false`` (absent: false)."""
    values = request.args.getlist(name)
    if not values:
        return False
    if len(values) > 1 or values[0] not in ("true", "false"):
        raise BadRequest(f"{name} must be given once, as true or false.", param=name)
    return values[0] == "true"


def _frame(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {data}\n\n".encode()


def _stream(response_id: str, base: dict[str, Any], queued: bool, after: int) -> Response:
    """The response's events after ``after`` as SSE: its job's stored events,
    then live; ends after its last event, or when the client leaves (a
    background response goes on)."""
    runtime = current()
    sock = request.environ.get("gunicorn.socket")

    def gone() -> bool:
        return sse.client_gone(sock)

    def generate() -> Iterator[bytes]:
        yield f": parkq response {response_id}\n\n".encode()
        t = Translator(base, queued)
        for event in t.start():
            if event["sequence_number"] > after:
                yield _frame(event)
        keepalive = runtime.settings.keepalive_seconds
        fed = 0
        for item in sse.events(runtime.store, response_id, 0, keepalive, gone):
            if item is None:
                yield sse.KEEPALIVE
                continue
            data = item[1]
            if data != DONE and json.loads(data).get("error", {}).get("code") == EXPIRED:
                # Its events expired before this read. A reading from the start
                # gets the response from its kept result; a resumed one (or one
                # that had read some) cannot continue its numbering: it ends
                # with an error event saying so.
                record = runtime.store.get(response_id) or {}
                if after >= 0 or fed or not record:
                    yield _frame({"type": "error", "sequence_number": max(t.seq, after) + 1,
                                  "code": EXPIRED, "param": None,
                                  "message": f"The events of response '{response_id}' "
                                  "expired while it was read: GET /v1/responses/"
                                  f"{response_id} has the whole response."})  # fmt: skip
                    return
                for piece in _kept_events(response_id, record):
                    for event in t.feed(piece):
                        yield _frame(event)
                return
            fed += 1
            for event in t.feed(data):
                if event["sequence_number"] > after:
                    yield _frame(event)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": response_id}
    return Response(stream_with_context(generate()), mimetype="text/event-stream", headers=headers)


def _wait(response_id: str, base: dict[str, Any]) -> dict[str, Any]:
    """The whole response once its job ends, read as a stream reader reads it
    (a lease that ends by itself; :class:`ClientGone` when the client left)."""
    runtime = current()
    sock = request.environ.get("gunicorn.socket")

    def gone() -> bool:
        return sse.client_gone(sock)

    keepalive = runtime.settings.keepalive_seconds
    for item in sse.events(runtime.store, response_id, 0, keepalive, gone):
        if item is not None and item[1] == DONE:
            return _object(response_id)
    raise ClientGone(response_id)


# -- cancel, delete, input items -------------------------------------------------------


def _stop(response_id: str) -> None:
    """Cancel a response's job and wait (a while) for it to end."""
    store = current().store
    try:
        outcome = store.cancel(response_id, time.time())
    except JobEnded:
        return
    if outcome is Cancelled.CANCELLED:
        store.telemetry.count("jobs_cancelled")
        current().rq.canceled(response_id)
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while time.monotonic() < deadline:
        record = store.get(response_id) or {}
        if not record or JobState(record["state"]) in TERMINAL:
            return
        time.sleep(0.05)


@bp.post("/v1/responses/<response_id>/cancel")
def cancel(response_id: str) -> Any:
    """Cancel a background response (queued, running or parked)."""
    record, kept = _response(response_id)
    if not kept["base"]["background"]:
        raise BadRequest("Only a response created with background=true can be cancelled.",
                         param="response_id")  # fmt: skip
    state = JobState(record["state"])
    if state in TERMINAL and state is not JobState.CANCELLED:
        status = _object(response_id)["status"]
        raise Conflict(f"The response '{response_id}' has already ended ({status}): it "
                       "cannot be cancelled.", code="response_ended")  # fmt: skip
    _stop(response_id)
    return jsonify(_object(response_id))


@bp.delete("/v1/responses/<response_id>")
def delete(response_id: str) -> Any:
    """Delete a response: its job stops if it runs, and its record and events go."""
    record, _ = _response(response_id)
    if JobState(record["state"]) not in TERMINAL:
        _stop(response_id)
    runtime = current()
    store, k = runtime.store, runtime.store.keys
    if (store.get(response_id) or {}).get("state") not in {s.value for s in TERMINAL}:
        raise Conflict(f"The response '{response_id}' is still stopping; delete it again "
                       "shortly.", code="response_running")  # fmt: skip
    store.r.delete(k.job(response_id), k.events(response_id), k.readers(response_id))
    store.r.zrem(k.ended, response_id)
    runtime.rq.forget(response_id)
    return jsonify({"id": response_id, "object": "response", "deleted": True})


@bp.get("/v1/responses/<response_id>/input_items")
def input_items(response_id: str) -> Any:
    """The response's input items (``limit``, ``order``: ``desc`` by default,
    ``after``: an item id), as OpenAI lists them."""
    _, kept = _response(response_id)
    items: list[dict[str, Any]] = list(kept["input"])
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'.", param="order")
    try:
        limit = int(request.args.get("limit", "20"))
    except ValueError:
        raise BadRequest("limit must be an integer from 1 to 100.", param="limit") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be an integer from 1 to 100.", param="limit")
    if order == "desc":
        items.reverse()
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequest(f"No input item '{after}' in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return jsonify({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    })  # fmt: skip
