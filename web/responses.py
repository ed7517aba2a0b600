"""Responses out: a request's jobs as one SSE stream (the choices merged when
``n`` > 1) or as one whole OpenAI response body."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from flask import Response, request, stream_with_context

from jobs.engine.request import GenerationRequest
from jobs.store.events import DONE
from jobs.store.scheduling import Store
from jobs.store.telemetry import as_text
from web import sse
from web.errors import APIError, Conflict, Gone
from web.runtime import current

__all__ = [
    "ClientGone",
    "aggregate",
    "assemble",
    "result_of",
    "stamp_of",
    "stream",
    "usage_of",
]


def stream(response_id: str, jobs: list[str], after: list[int]) -> Response:
    runtime = current()
    sock = request.environ.get("gunicorn.socket")  # to notice a client that left

    def gone() -> bool:
        return sse.client_gone(sock)

    def generate() -> Iterator[bytes]:
        # A first comment sends the headers at once, even while the job waits.
        yield f": parkq job {response_id}\n\n".encode()
        keepalive = runtime.settings.keepalive_seconds
        if len(jobs) == 1 and response_id == jobs[0]:
            extra: str | None = None
            for item in sse.events(runtime.store, jobs[0], after[0], keepalive, gone):
                if item is None:
                    yield sse.KEEPALIVE
                    continue
                seq, data = item
                if extra is None and data.startswith(CHUNK):
                    extra = _stamp_or_none(jobs[0])  # read once the job has a worker
                yield sse.frame(seq, _stamped(data, extra or ""))
        else:
            yield from _choices_stream(jobs, after, gone)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Job-Id": response_id}
    return Response(stream_with_context(generate()), mimetype="text/event-stream", headers=headers)


#: How every chunk a worker writes begins (an error event does not).
CHUNK = '{"id":'


def stamp_of(job_id: str) -> dict[str, str]:
    """What a job's chunks and bodies carry besides what its worker wrote: the
    ``service_tier`` it was served at and its ``system_fingerprint`` (what the
    worker that finished it recorded, else what the worker running it or every
    live worker announces), each where known."""
    runtime = current()
    store = runtime.store
    worker, fingerprint, raw = store.r.hmget(
        store.keys.job(job_id), ["worker", "fingerprint", "request"]
    )
    out: dict[str, str] = {}
    fp = (
        as_text(fingerprint)
        if fingerprint
        else runtime.fingerprint(as_text(worker) if worker else None)
    )
    if fp:
        out["system_fingerprint"] = fp
    tier = json.loads(raw).get("service_tier") if raw else None
    if tier:
        out["service_tier"] = str(tier)
    return out


def _stamp_or_none(job_id: str) -> str | None:
    """:func:`stamp_of` as a chunk's first members; None while Redis does not
    answer (the stream rides an outage out as before: the next chunk asks
    again)."""
    try:
        return _inline(stamp_of(job_id))
    except redis.RedisError:
        return None


def _inline(fields: dict[str, str]) -> str:
    """``fields`` as the start of a JSON object's members (``"a":"b",``)."""
    return "".join(f"{json.dumps(k)}:{json.dumps(v)}," for k, v in fields.items())


def _stamped(data: str, extra: str) -> str:
    """A chunk's JSON with the members ``extra`` first (other events as they are)."""
    return "{" + extra + data[1:] if extra and data.startswith(CHUNK) else data


def _choices_stream(jobs: list[str], after: list[int], gone: Callable[[], bool]) -> Iterator[bytes]:
    """The events of a request's choices (``n`` > 1) as they come, each under the
    id ``s0,s1,...``: the last event of every choice so far, which a reconnect
    sends back as Last-Event-ID. An error ends every choice and is sent once;
    then the usage chunk (when asked for) and one [DONE]."""
    runtime = current()
    last, ended, failed = list(after), set(), False
    extra: str | None = None
    items = sse.merged(runtime.store, jobs, after, runtime.settings.keepalive_seconds, gone)
    for item in items:
        if item is None:
            yield sse.KEEPALIVE
            continue
        i, seq, data = item
        if extra is None and data.startswith(CHUNK):
            extra = _stamp_or_none(jobs[i])
        data = _stamped(data, extra or "")
        last[i] = seq
        if data == DONE:
            ended.add(i)
            continue
        if data.startswith('{"error"'):
            if failed:
                continue
            failed = True
            runtime.store.cancel_live(jobs, time.time())
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
            **stamp_of(jobs[0]),
            "choices": [],
            "usage": usage_of(records),
        }
        yield sse.frame(event_id, json.dumps(chunk, separators=(",", ":")))
    yield sse.frame(event_id, DONE)


def _event_id(last: list[int]) -> str:
    return ",".join(map(str, last))


def usage_of(records: list[dict[str, str]]) -> dict[str, int] | None:
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


class ClientGone(Exception):
    """The client of a non-streamed request left before its answer was whole."""


#: The code of the error event a reader gets where a job's events expired
#: before it read them (web/sse.py): its result is in its record.
EXPIRED = "expired"


def _failure(error: dict[str, Any]) -> APIError:
    """The answer of a non-streamed request one of whose jobs ended in ``error``."""
    if error.get("type") == "cancelled":
        return Conflict(error["message"], code=error["code"])
    return APIError(error["message"], code=error["code"])


def result_of(store: Store, job_id: str, record: dict[str, str]) -> dict[str, Any] | None:
    """A finished job's non-streamed response body (its one choice at index 0),
    from its record's kept result or its events; None when both are gone."""
    if record.get("result"):
        body: dict[str, Any] = json.loads(record["result"])
        return body
    events = store.events_after(job_id, 0)
    if not events:
        return None
    gen = GenerationRequest.from_json(json.loads(record["request"]))
    chunks = [json.loads(data) for _, data in events if data != DONE]
    chunks = [c for c in chunks if "error" not in c]
    usage = json.loads(record.get("usage") or "null")
    return assemble(job_id, gen, chunks, usage)


def aggregate(response_id: str, jobs: list[str], gen: GenerationRequest) -> dict[str, Any]:
    """The whole response: every choice's chunks assembled (an error in one
    ends the others and is the answer).

    The request reads every choice as a stream reader does (a lease on each,
    renewed while it waits, :class:`sse.Reading`), for as long as it waits; a
    client that leaves is noticed (:class:`ClientGone`) and its jobs are
    detached, so interactive ones are abandoned after the grace period as a
    streamed request's are. A process killed while it waits leaves no reader
    behind: its leases end by themselves."""
    sock = request.environ.get("gunicorn.socket")

    def gone() -> bool:
        return sse.client_gone(sock)

    return _aggregate(response_id, jobs, gen, gone)


def _aggregate(
    response_id: str, jobs: list[str], gen: GenerationRequest, gone: Callable[[], bool]
) -> dict[str, Any]:
    """Every choice's chunks, read together as they come (one reader over all of
    them, as a stream has), then assembled; a choice whose events expired before
    they were read (it ended long before its siblings and the janitor compacted
    it) is answered from its kept result."""
    runtime = current()
    store = runtime.store
    chunks: list[list[dict[str, Any]]] = [[] for _ in jobs]
    unread: set[int] = set()
    done: set[int] = set()
    keepalive = runtime.settings.keepalive_seconds
    for item in sse.merged(store, jobs, [0] * len(jobs), keepalive, gone):
        if item is None:
            continue
        i, _, data = item
        if data == DONE:
            done.add(i)
            continue
        chunk = json.loads(data)
        if "error" not in chunk:
            chunks[i].append(chunk)
        elif chunk["error"].get("code") == EXPIRED:
            unread.add(i)
        else:
            store.cancel_live(jobs, time.time())
            raise _failure(chunk["error"])
    if len(done) < len(jobs):
        raise ClientGone(response_id)
    records = [store.get(job_id) or {} for job_id in jobs]
    choices: list[dict[str, Any]] = []
    for i, (job_id, record) in enumerate(zip(jobs, records, strict=True)):
        if i not in unread:
            usage = json.loads(record.get("usage") or "null")
            choices.extend(assemble(response_id, gen, chunks[i], usage, i)["choices"])
            continue
        kept = result_of(store, job_id, record) if record else None
        if kept is None:
            raise Gone(
                f"The result of choice {i} of '{response_id}' expired before the other "
                "choices ended."
            )
        choices.extend({**c, "index": i} for c in kept["choices"])
    body = assemble(response_id, gen, [], None)
    return {**body, **stamp_of(jobs[0]), "choices": choices, "usage": usage_of(records)}


def assemble(
    job_id: str, gen: GenerationRequest, chunks: list[dict[str, Any]], usage: Any, index: int = 0
) -> dict[str, Any]:
    """The non-streamed response body of a job from its streamed chunks (its
    one choice has ``index``)."""
    finish = None
    text: list[str] = []
    chat_lp: list[Any] = []
    tool_calls: list[Any] = []
    cmpl_lp: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish = choice.get("finish_reason") or finish
            lp = choice.get("logprobs")
            if gen.kind == "chat":
                text.append(choice["delta"].get("content") or "")
                tool_calls.extend(choice["delta"].get("tool_calls") or [])
                if lp:
                    chat_lp.extend(lp["content"])
            else:
                text.append(choice.get("text") or "")
                if lp:
                    for key, values in cmpl_lp.items():
                        values.extend(lp[key])
    base = {"id": job_id, "created": gen.created, "model": gen.model, "usage": usage}
    if gen.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if tool_calls:
            message["tool_calls"] = [
                {k: v for k, v in call.items() if k != "index"} for call in tool_calls
            ]
        logprobs = {"content": chat_lp} if gen.logprobs else None
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {**base, "object": "chat.completion", "choices": [choice]}
    logprobs_c = cmpl_lp if gen.logprobs else None
    text_ = "".join(text)
    choice = {"index": index, "text": text_, "logprobs": logprobs_c, "finish_reason": finish}
    return {**base, "object": "text_completion", "choices": [choice]}
