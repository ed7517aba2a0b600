"""OpenAI's Responses API over parkq's chat jobs: the input items as chat
messages, and a job's chat chunks as Responses events and output items.

A response is a chat job. Its stream of Responses events is a pure function
of the job's events (:class:`Translator`): the same events give the same
Responses events, numbered the same (``sequence_number``), with the same item
ids. So a client that resumes with ``starting_after=N`` gets the events after
N of a replay of the job's events from the first, each once, as
``Last-Event-ID`` does for a chat stream, for as long as the job's events are
kept. Once they expire, the response is made from the job's kept result:
the same text and calls, not the same events (web/responses_api.py refuses
to resume past that point).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from jobs.store.events import DONE

__all__ = [
    "Translator",
    "chunks_of_result",
    "input_messages",
    "output_messages",
    "usage_of_chat",
]


def _text_of(content: Any) -> str:
    """A message's content (a text, or a list of text parts) as one text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content)


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items (validated: web/schemas.py) as chat messages: a message as
    it is, a ``function_call_output`` as a tool message, and ``function_call``
    items as the tool calls of the assistant message right before them (a
    new one where there is none): the text and the calls the model wrote in
    one turn are one assistant message, as it generated them."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        last = out[-1] if out else None
        turn = last is not None and last["role"] == "assistant"
        if kind == "message":
            text = _text_of(item.get("content"))
            out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if turn and last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item.get("output"))})  # fmt: skip
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its
    conversation (``previous_response_id``): its text (all of it, as one
    turn's content) and its calls, one assistant message."""
    text = "".join(p.get("text", "") for item in output if item["type"] == "message"
                   for p in item.get("content", []))  # fmt: skip
    items: list[dict[str, Any]] = [{"type": "message", "role": "assistant", "content": text}]
    items += [item for item in output if item["type"] == "function_call"]
    return input_messages(items)


def usage_of_chat(usage: dict[str, int] | None) -> dict[str, Any] | None:
    """A chat ``usage`` in the Responses API's shape."""
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def chunks_of_result(body: dict[str, Any], ended: str | None = None) -> Iterator[str]:
    """The chat chunks that a kept ``chat.completion`` body (a job's, once its
    events expired) sums up, then ``[DONE]``: the same text and calls (the
    text in one piece, before the calls). ``ended``: the error event of a job
    that did not finish (cancelled, failed), in place of its finish."""
    (choice,) = body["choices"]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if delta or finish else []
        return json.dumps({"id": body["id"], "choices": choices, **extra})

    if message.get("content"):
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{**call, "index": i}]})
    if ended is not None:
        yield ended
        yield DONE
        return
    yield chunk({}, choice.get("finish_reason") or "stop")
    if body.get("usage"):
        yield chunk({}, None, usage=body["usage"])
    yield DONE


class Translator:
    """A response's events from its job's events, fed in order.

    ``base`` is the response object's fields that do not change (its id, its
    request's settings); :meth:`response` gives the whole object at any point.
    """

    def __init__(self, base: dict[str, Any], queued: bool) -> None:
        self.base = base
        self.hex = str(base["id"]).removeprefix("resp_")
        self.queued = queued
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.error: dict[str, Any] | None = None
        self.status = "queued" if queued else "in_progress"
        self.ended = False
        self.seq = -1
        self._text: int | None = None  # the output index of the open message

    # -- the object ------------------------------------------------------------

    def response(self, status: str | None = None) -> dict[str, Any]:
        """The response object now (``status``: what the job's record says, when
        the events have not said it yet)."""
        status = self.status if self.ended or status is None else status
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            **self.base,
            "status": status,
            "error": self.error,
            "incomplete_details": incomplete,
            "output": [dict(item) for item in self.output],
            "usage": self.usage,
        }

    # -- events ----------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """The events before the job's first: created, then in progress."""
        created = self._event("response.created", response=self.response())
        return [created, self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, data: str) -> list[dict[str, Any]]:
        """The events that one of the job's events makes."""
        if self.ended:
            return []
        if data == DONE:
            return self._end()
        chunk = json.loads(data)
        if "error" in chunk:
            return self._failed(chunk["error"])
        if chunk.get("usage"):
            self.usage = usage_of_chat(chunk["usage"])
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._close_text()
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq, **fields}

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._text is None:
            self._text = len(self.output)
            item: dict[str, Any] = {"id": f"msg_{self.hex}_{self._text}", "type": "message",
                                    "status": "in_progress", "role": "assistant",
                                    "content": []}  # fmt: skip
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=self._text,
                                   item=json.loads(json.dumps(item))))  # fmt: skip
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}  # fmt: skip
            item["content"] = [part]
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=self._text, content_index=0,
                                   part=dict(part)))  # fmt: skip
        current = self.output[self._text]
        current["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=current["id"],
                               output_index=self._text, content_index=0, delta=text,
                               logprobs=[]))  # fmt: skip
        return out

    def _close_text(self) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        index, self._text = self._text, None
        item = self.output[index]
        part = item["content"][0]
        item["status"] = "completed"
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item=json.loads(json.dumps(item))),
        ]  # fmt: skip

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output)
        function = call.get("function") or {}
        arguments = str(function.get("arguments", ""))
        item = {"id": f"fc_{self.hex}_{index}", "type": "function_call", "status": "in_progress",
                "call_id": call.get("id") or f"call_{self.hex[:16]}_{index}",
                "name": function.get("name", ""), "arguments": ""}  # fmt: skip
        self.output.append(item)
        out = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item["arguments"] = arguments
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=arguments))  # fmt: skip
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=arguments))  # fmt: skip
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def _end(self) -> list[dict[str, Any]]:
        out = self._close_text()
        self.ended = True
        self.status = "incomplete" if self.finish == "length" else "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=self.response())]

    def _failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error event ends the response: cancelled (a cancel, its client
        gone) or failed."""
        out = self._close_text()
        self.ended = True
        cancelled = error.get("type") == "cancelled"
        self.status = "cancelled" if cancelled else "failed"
        self.error = None if cancelled else {"code": error.get("code") or "server_error",
                                             "message": error.get("message", "")}  # fmt: skip
        return [*out, self._event("response.failed", response=self.response())]
