"""Structured outputs through the real pipeline (tiny model, real Redis, real
llama.cpp and llguidance): what a schema asks for is what comes out, also
across parks; a schema the engine cannot follow is a 400; fields parkq does
not implement are refused, never dropped."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.integration.conftest import Server
from tests.integration.helpers import (
    chunks,
    completion_text,
    job,
    logprob_tokens,
    read_events,
    submit_stream,
    wait_until,
)
from tests.integration.test_workers import Cluster, running_cluster

#: A schema whose answer is long (40 strings of 12 characters: over 500
#: tokens of the tiny model) so that a job can be parked several times inside it.
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "minLength": 12, "maxLength": 12},
            "minItems": 40,
            "maxItems": 40,
        },
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["notes", "ok", "size"],
    "additionalProperties": False,
}

CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def _format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def _content(events: list[tuple[int, str]]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks(events) if c.get("choices")
    )


def _finish(events: list[tuple[int, str]]) -> str | None:
    reasons = [c["choices"][0].get("finish_reason") for c in chunks(events) if c.get("choices")]
    return next((r for r in reasons if r), None)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_a_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    for temperature in (0.0, 0.9):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Describe the city of Paris."}],
            response_format=_format(CITY_SCHEMA, "city"),
            temperature=temperature,
            seed=3,
            max_tokens=400,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), CITY_SCHEMA)


def test_json_object_gives_one_json_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=2000,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_completions_and_streams_follow_the_schema_too(server: Server) -> None:
    body = {"prompt": "The city:", "max_tokens": 400, "temperature": 0,
            "response_format": _format(CITY_SCHEMA)}  # fmt: skip
    plain = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    events = read_events(submit_stream(server.base_url, body))
    streamed = "".join(c["choices"][0]["text"] for c in chunks(events) if c.get("choices"))
    assert streamed == text


def test_max_tokens_inside_the_structure_ends_with_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Notes, please."}],
        response_format=_format(LONG_SCHEMA),
        max_tokens=5,
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5
    content = out.choices[0].message.content or ""
    assert content and '{"notes":["'.startswith(content)  # the schema's forced start, cut


@pytest.mark.parametrize(
    ("response_format", "says"),
    [
        (_format({"type": "nonsense"}), "Invalid type"),
        (_format({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
        (_format({"type": "string", "pattern": "(("}), "regex"),
        (_format({"type": "object", "description": "x" * 70_000}), "at most"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "response_format"),
    ],
)
def test_a_schema_the_engine_cannot_follow_is_a_400(
    server: Server, response_format: dict[str, Any], says: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    resp = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("response_format")
    assert says in error["message"]


REFUSED = [("tool_choice", "required"), ("best_of", 3), ("suffix", "end"),
           ("modalities", ["text", "audio"]), ("prediction", {"type": "content"})]  # fmt: skip
UNUSED = {"tool_choice": "auto", "best_of": 1, "suffix": "", "modalities": ["text"],
          "prediction": None}  # fmt: skip


@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_an_openai_field_parkq_does_not_implement_is_refused(
    server: Server, field: str, value: Any
) -> None:
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    resp = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field
    # Its "not used" value, and fields nobody knows, are fine.
    ok = {"prompt": "hi", "max_tokens": 2, field: UNUSED[field], "some_extension": True}
    assert requests.post(f"{server.base_url}/v1/completions", json=ok, timeout=30).ok


def test_logit_bias_and_penalties_shape_the_answer(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    tokens = requests.post(f"{server.base_url}/v1/tokenize", json={"text": "park"}, timeout=30)
    token = tokens.json()["tokens"][-1]
    body = {"prompt": "The", "max_tokens": 12, "temperature": 0}
    forced = requests.post(url, json={**body, "logit_bias": {str(token): 100}}, timeout=30)
    piece = requests.post(f"{server.base_url}/v1/detokenize", json={"tokens": [token]},
                          timeout=30).json()["text"]  # fmt: skip
    assert forced.json()["choices"][0]["text"] == piece * 12
    # A frequency penalty makes greedy decoding stop repeating itself.
    plain = requests.post(url, json={**body, "max_tokens": 200}, timeout=30).json()
    penalized = requests.post(
        url, json={**body, "max_tokens": 200, "frequency_penalty": 2.0}, timeout=30
    ).json()
    assert plain["choices"][0]["text"] != penalized["choices"][0]["text"]
    for field, bad in [("logit_bias", {"x": 1}), ("logit_bias", {"5": 500}),
                       ("logit_bias", {"99999999": 1}), ("presence_penalty", 3)]:  # fmt: skip
        resp = requests.post(url, json={**body, field: bad}, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"].startswith(field)


def test_the_batch_api_follows_each_lines_schema(client: openai.OpenAI, tmp_path: Path) -> None:
    lines = [
        {"custom_id": f"city-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"City number {i}"}],
                  "max_tokens": 400, "temperature": 0.7, "seed": i,
                  "response_format": _format(CITY_SCHEMA, "city")}}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with path.open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
    assert batch.status == "completed" and batch.output_file_id
    results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["city-0", "city-1", "city-2"]
    for r in results:
        message = r["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(message), CITY_SCHEMA)


# -- across parks --------------------------------------------------------------


@pytest.fixture(scope="module")
def slow(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    """One worker whose decode steps take at least 2 ms: a long structured
    answer runs long enough to be parked several times on any machine."""
    root = tmp_path_factory.mktemp("structured")
    with running_cluster(redis_server.url, tiny_model, root, "structured", ()) as c:
        c.start_worker("w", env={"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.002"})
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        yield c


def _uninterrupted_and_parked(
    c: Cluster, body: dict[str, Any], parks: int, route: str = "completions"
) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The events of ``body`` run once alone and once parked ``parks`` times (an
    interactive request each time the job has made 20 more tokens)."""
    reference_resp = submit_stream(c.base_url, body, route)
    reference = read_events(reference_resp)
    assert job(c.base_url, reference_resp.headers["X-Job-Id"])["preemptions"] == 0
    resp = submit_stream(c.base_url, body, route)
    job_id = resp.headers["X-Job-Id"]
    short = {"prompt": "Quick question", "max_tokens": 4, "priority": "interactive"}
    for _ in range(parks):
        start = job(c.base_url, job_id)["tokens"]

        def running_on(start: int = start) -> bool:
            status = job(c.base_url, job_id)
            return bool(status["tokens"] > start + 20 and status["state"] == "running")

        wait_until(running_on)
        assert read_events(submit_stream(c.base_url, short))[-1][1] == "[DONE]"
    events = read_events(resp)
    assert job(c.base_url, job_id)["preemptions"] == parks
    return reference, events


@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_schema_constrained_job_parked_three_times_is_identical_and_valid(
    slow: Cluster, temperature: float
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write the notes."}],
        "max_tokens": 3000, "temperature": temperature, "seed": 11, "logprobs": True,
        "priority": "batch", "response_format": _format(LONG_SCHEMA),
    }  # fmt: skip
    reference, events = _uninterrupted_and_parked(slow, body, 3, "chat/completions")
    text = _content(events)
    assert text == _content(reference)
    assert [c["choices"][0].get("logprobs") for c in chunks(events) if c.get("choices")] == [
        c["choices"][0].get("logprobs") for c in chunks(reference) if c.get("choices")
    ]
    assert _finish(events) == "stop"
    jsonschema.validate(json.loads(text), LONG_SCHEMA)


# -- tool calls ----------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
#: A function whose arguments are long: a call that can be parked inside.
NOTES = {
    "type": "function",
    "function": {
        "name": "save_notes",
        "parameters": {
            "type": "object",
            "properties": {"notes": LONG_SCHEMA["properties"]["notes"]},
            "required": ["notes"],
            "additionalProperties": False,
        },
    },
}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters: dict[str, Any] = tool["function"]["parameters"]
    return parameters


def test_tool_choice_required_makes_a_valid_call(client: openai.OpenAI) -> None:
    for temperature in (0.0, 0.9):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=temperature,
            seed=5,
            max_tokens=400,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert calls
        tools = {"get_weather": WEATHER, "get_time": TIME}
        for call in calls:
            fn = call.function
            jsonschema.validate(json.loads(fn.arguments), _parameters(tools[fn.name]))


def test_a_named_tool_choice_calls_that_function_once(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Which time is it?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=400,
    )
    calls = out.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), _parameters(TIME))
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    )
    assert not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "parallel_tool_calls": False, "tools": []}, "tool_choice"),
        ({"tool_choice": "auto", "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ],
)  # fmt: skip
def test_a_tool_choice_that_cannot_be_followed_is_a_400(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **extra}
    resp = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.timeout(300)
def test_a_required_tool_call_parked_twice_is_identical(slow: Cluster) -> None:
    body = {
        "messages": [{"role": "user", "content": "Save the notes."}],
        "tools": [NOTES], "tool_choice": {"type": "function", "function": {"name": "save_notes"}},
        "max_tokens": 3000, "temperature": 0.8, "seed": 21, "priority": "batch",
    }  # fmt: skip
    reference, events = _uninterrupted_and_parked(slow, body, 2, "chat/completions")

    def calls(evs: list[tuple[int, str]]) -> list[dict[str, Any]]:
        return [  # the call ids derive from the job ids: compare the rest
            {**call, "id": None}
            for c in chunks(evs)
            if c.get("choices")
            for call in c["choices"][0]["delta"].get("tool_calls") or []
        ]

    got = calls(events)
    assert got == calls(reference) and len(got) == 1
    assert got[0]["function"]["name"] == "save_notes"
    jsonschema.validate(json.loads(got[0]["function"]["arguments"]), _parameters(NOTES))
    assert _finish(events) == "tool_calls"


@pytest.mark.timeout(300)
def test_penalties_and_bias_are_exact_across_parks(slow: Cluster) -> None:
    body = {"prompt": "The long penalized job", "max_tokens": 600, "temperature": 0.8,
            "seed": 4, "logprobs": 1, "ignore_eos": True, "priority": "batch",
            "presence_penalty": 0.7, "frequency_penalty": 0.4,
            "logit_bias": {"5": 3.5}}  # fmt: skip
    reference, events = _uninterrupted_and_parked(slow, body, 2)
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)


def test_echo_puts_the_prompt_before_the_completion(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    body = {"prompt": "The printing press", "max_tokens": 16, "temperature": 0}
    plain = requests.post(url, json=body, timeout=30).json()["choices"][0]["text"]
    echoed = requests.post(url, json={**body, "echo": True}, timeout=30).json()
    assert echoed["choices"][0]["text"] == "The printing press" + plain
    assert echoed["usage"]["completion_tokens"] == 16
    events = read_events(submit_stream(server.base_url, {**body, "echo": True}))
    assert completion_text(events) == "The printing press" + plain
    ids = requests.post(f"{server.base_url}/v1/tokenize", json={"text": "The printing press"},
                        timeout=30).json()["tokens"]  # fmt: skip
    by_ids = requests.post(url, json={**body, "prompt": ids, "echo": True}, timeout=30).json()
    ids_plain = requests.post(url, json={**body, "prompt": ids}, timeout=30).json()
    text = requests.post(f"{server.base_url}/v1/detokenize", json={"tokens": ids},
                         timeout=30).json()["text"]  # fmt: skip
    assert by_ids["choices"][0]["text"] == text + ids_plain["choices"][0]["text"]
    refused = requests.post(url, json={**body, "echo": True, "logprobs": 2}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
