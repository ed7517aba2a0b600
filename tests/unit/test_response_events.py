"""The Responses events of a job's events (web/response_events.py), over
generated jobs: the same events every time (so a resumed stream continues the
first one), numbered from 0 without a gap, and summing up to the response."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from jobs.store.events import DONE, error_event
from jobs.worker.chunks import ChunkWriter
from web.response_events import Translator, chunks_of_result, input_messages, output_messages

BASE = {"id": "resp_00ff", "object": "response", "background": True, "model": "m"}
WRITER = ChunkWriter("chat", "resp_00ff", "m", 0, lambda t: bytes([t]))

pieces = st.one_of(
    st.tuples(st.just("text"), st.text(min_size=1, max_size=8)),
    st.tuples(st.just("call"), st.text(min_size=1, max_size=6), st.text(max_size=12)),
)
endings = st.one_of(
    st.sampled_from(["stop", "length", "tool_calls"]),
    st.sampled_from([("error", "cancelled", "cancelled"), ("error", "server_error", "failed")]),
)


def _job_events(steps: list[Any], ending: Any, usage: bool) -> list[str]:
    out = [WRITER.role()]
    for i, step in enumerate(steps):
        if step[0] == "text":
            out.append(WRITER.delta(step[1], None, 0))
        else:
            out.append(WRITER.tool_call(i, f"call_{i}", step[1], step[2]))
    if isinstance(ending, tuple):
        return [*out, error_event("stopped", ending[1], ending[2]), DONE]
    out.append(WRITER.finish(ending))
    if usage:
        out.append(WRITER.usage({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}))
    return [*out, DONE]


def _translate(events: list[str]) -> tuple[list[dict[str, Any]], Translator]:
    t = Translator(dict(BASE), queued=True)
    out = t.start()
    for data in events:
        out += t.feed(data)
    return out, t


@given(st.lists(pieces, max_size=8), endings, st.booleans())
def test_a_job_s_events_give_the_same_numbered_events_summing_up_to_the_response(
    steps: list[Any], ending: Any, usage: bool
) -> None:
    events = _job_events(steps, ending, usage)
    first, t = _translate(events)
    again, _ = _translate(events)
    assert first == again  # a replay, as a resumed stream makes it
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    assert first[0]["type"] == "response.created" and first[0]["response"]["status"] == "queued"
    final = t.response()
    want = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
    expected = want[ending] if isinstance(ending, str) else ending[2]
    assert final["status"] == expected
    assert first[-1]["response"] == final
    deltas = "".join(e["delta"] for e in first if e["type"] == "response.output_text.delta")
    texts = "".join(p["text"] for item in final["output"] if item["type"] == "message"
                    for p in item["content"])  # fmt: skip
    assert deltas == texts == "".join(s[1] for s in steps if s[0] == "text")
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (s[1], s[2]) for s in steps if s[0] == "call"
    ]
    added = [e["item"]["id"] for e in first if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in first if e["type"] == "response.output_item.done"]
    assert added == done == [item["id"] for item in final["output"]]
    assert len(set(added)) == len(added)
    if usage and isinstance(ending, str):
        assert final["usage"]["total_tokens"] == 7


@given(st.lists(pieces, max_size=6), st.sampled_from(["stop", "length", "tool_calls"]))
def test_a_kept_result_gives_the_output_its_events_gave(steps: list[Any], finish: str) -> None:
    """Once a job's events expire, its kept chat body stands in: the same text,
    calls and status."""
    _, live = _translate(_job_events(steps, finish, True))
    text = "".join(s[1] for s in steps if s[0] == "text")
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": s[1], "arguments": s[2]}}
                  for i, s in enumerate(steps) if s[0] == "call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body = {"id": "resp_00ff", "choices": [{"index": 0, "message": message,
                                           "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}  # fmt: skip
    _, kept = _translate(list(chunks_of_result(body)))

    def summed(t: Translator) -> tuple[str, list[tuple[str, str]], str]:
        out = t.response()
        text = "".join(p["text"] for item in out["output"] if item["type"] == "message"
                       for p in item["content"])  # fmt: skip
        calls = [(item["name"], item["arguments"]) for item in out["output"]
                 if item["type"] == "function_call"]  # fmt: skip
        return text, calls, out["status"]

    # (A kept body has its text in one piece, before the calls: text written
    # between two calls comes back as one message.)
    assert summed(kept) == summed(live)


def test_input_items_become_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                       {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
    ]  # fmt: skip
    messages = input_messages(items)
    assert messages[0] == {"role": "user", "content": "ab"}
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "x"}
    assert json.dumps(messages)  # plain JSON, as a record keeps it


def test_one_turn_of_text_and_calls_is_one_assistant_message() -> None:
    """Calls join the assistant message right before them (as the model wrote
    them in one turn); two assistant messages are never glued together; and a
    response's own output (text, a call, more text) continues as the one
    assistant message it generated."""
    said = [
        {"type": "message", "role": "user", "content": "go"},
        {"type": "message", "role": "assistant", "content": "Hi."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "message", "role": "assistant", "content": "Done."},
        {"type": "message", "role": "assistant", "content": "More?"},
    ]
    messages = input_messages(said)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "assistant"]
    assert messages[1]["content"] == "Hi."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1"]
    assert [m["content"] for m in messages[3:]] == ["Done.", "More?"]
    output: list[dict[str, Any]] = [
        {"type": "message", "content": [{"type": "output_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "[]"},
        {"type": "message", "content": [{"type": "output_text", "text": " there"}]},
    ]
    (turn,) = output_messages(output)
    assert turn["content"] == "Hi there" and [c["id"] for c in turn["tool_calls"]] == ["c2"]
