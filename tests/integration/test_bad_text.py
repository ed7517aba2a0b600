"""Every text field a client sends, with every kind of bad or odd text: the
answer is an answer or a 4xx in OpenAI's error body, never a 5xx; text that is
not Unicode (a lone surrogate, bytes that are not UTF-8) is a 400 naming the
field; a refused request leaves no job behind.

The app runs in this process with the tiny model's real tokenizer (the one that
raised on a lone surrogate) against a real redis-server; no worker runs, so a
request that is accepted is streamed, and its job cancelled."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.settings import load_settings
from web.app import create_app

MARK = "\U0001f9e9MARK\U0001f9e9"  # where the bad text goes, in an otherwise valid body

#: (route, a body with MARK in one text field): every text field of every route.
FIELDS: dict[str, tuple[str, Callable[[str], dict[str, Any]]]] = {
    "prompt": ("/v1/completions", lambda t: {"prompt": t}),
    "prompt list": ("/v1/completions", lambda t: {"prompt": ["ok", t]}),
    "completion stop": ("/v1/completions", lambda t: {"prompt": "ok", "stop": [t]}),
    "completion user": ("/v1/completions", lambda t: {"prompt": "ok", "user": t}),
    "model": ("/v1/completions", lambda t: {"prompt": "ok", "model": t}),
    "priority": ("/v1/completions", lambda t: {"prompt": "ok", "priority": t}),
    "logit_bias key": ("/v1/completions", lambda t: {"prompt": "ok", "logit_bias": {t: 1}}),
    "unknown field": ("/v1/completions", lambda t: {"prompt": "ok", "x_extra": t}),
    "unknown key": ("/v1/completions", lambda t: {"prompt": "ok", t: 1}),
    "content": ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]}),
    "content part": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]}),
    "system": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "system", "content": t}, {"role": "user", "content": "ok"}]}),
    "name": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": "ok", "name": t}]}),
    "tool call arguments": ("/v1/chat/completions", lambda t: {"messages": [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": t}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    "tool result": ("/v1/chat/completions", lambda t: {"messages": [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": t}]}),
    "tool description": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": t,
                                                    "parameters": {"type": "object"}}}]}),
    "schema": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": "ok"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "object", "description": t}}}}),
    "chat stop": ("/v1/chat/completions", lambda t: {
        "messages": [{"role": "user", "content": "ok"}], "stop": t}),
    "tokenize text": ("/v1/tokenize", lambda t: {"text": t}),
    "tokenize messages": ("/v1/tokenize", lambda t: {
        "messages": [{"role": "user", "content": t}]}),
}  # fmt: skip

#: Text that is not Unicode: always a 400.
INVALID = ("lone surrogate", "low surrogate", "bytes not UTF-8")
#: Odd but valid text: answered, or a 4xx (too long for the context, a bad name).
ODD = ("NUL", "long line", "control characters")


def _body(field: str, kind: str, text: str) -> bytes:
    route, build = FIELDS[field]
    body = build(MARK)
    if route != "/v1/tokenize":
        body = {**body, "max_tokens": 2, "stream": True}
    raw = json.dumps(body)  # ASCII: MARK is escaped, and replaced here
    mark = json.dumps(MARK)[1:-1]
    bad = {
        "lone surrogate": "\\ud800",
        "low surrogate": "\\udfff",
        "bytes not UTF-8": "\udcff",  # written as the byte 0xff below
        "NUL": "\\u0000",
        "long line": "word " * 20_000,
        "control characters": "\\u0001\\u001b[31m\\u007f",
    }[kind]
    out = raw.replace(mark, json.dumps(text)[1:-1] + bad)
    return out.encode("utf-8", "surrogateescape")


@pytest.fixture(scope="module")
def app_client(redis_server: Any, tiny_model: Path) -> Iterator[tuple[FlaskClient, redis.Redis]]:
    prefix = f"badtext{time.monotonic_ns()}"
    s = load_settings(model=str(tiny_model), redis_url=redis_server.url, key_prefix=prefix,
                      queue_name=prefix, n_ctx=512)  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    app = create_app(s, client=client)
    yield app.test_client(), client


def _jobs(r: redis.Redis, prefix: str) -> int:
    return sum(1 for _ in r.scan_iter(f"{prefix}:job:*", count=1000))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(sorted(FIELDS)),
    kind=st.sampled_from(INVALID + ODD),
    text=st.text(max_size=8),
)
def test_every_text_field_with_bad_text_gets_an_answer_or_a_clear_error(
    app_client: tuple[FlaskClient, redis.Redis], field: str, kind: str, text: str
) -> None:
    client, r = app_client
    prefix = client.application.extensions["parkq"].settings.key_prefix
    before = _jobs(r, prefix)
    route = FIELDS[field][0]
    resp = client.post(route, data=_body(field, kind, text), content_type="application/json")
    try:
        assert resp.status_code < 500, (field, kind, resp.status_code, resp.get_data()[:300])
        if resp.status_code >= 400:
            error = resp.get_json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error"
            assert _jobs(r, prefix) == before, "a refused request left a job"
        if kind in INVALID:
            assert resp.status_code == 400, (field, kind, resp.status_code)
            if kind != "bytes not UTF-8":  # the body is not even JSON then
                assert error["code"] == "invalid_text" and error["param"], error
    finally:
        job_id = resp.headers.get("X-Job-Id")
        resp.close()
        if job_id:  # accepted: no worker will run it
            assert client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202)


def test_a_batch_line_with_text_that_is_not_unicode_is_an_error_line(
    app_client: tuple[FlaskClient, redis.Redis],
) -> None:
    """One bad line of three: the batch runs the other two; the bad one is an
    error line naming the field, never a 500 or a failed batch."""
    client, _ = app_client
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "ok", "max_tokens": 1}}  # fmt: skip
    bad = json.dumps({**good, "custom_id": "b", "body": {"prompt": MARK}})
    bad = bad.replace(json.dumps(MARK)[1:-1], "\\ud800")
    lines = "\n".join([json.dumps(good), bad, json.dumps({**good, "custom_id": "c"})])
    form = {"purpose": "batch", "file": (io.BytesIO(lines.encode()), "b.jsonl")}
    up = client.post("/v1/files", data=form)
    assert up.status_code == 200, up.get_data()
    made = client.post("/v1/batches", json={"input_file_id": up.get_json()["id"],
                                            "endpoint": "/v1/completions",
                                            "completion_window": "24h"})  # fmt: skip
    assert made.status_code == 200, made.get_data()
    batch_id = made.get_json()["id"]
    deadline = time.monotonic() + 60
    while (batch := client.get(f"/v1/batches/{batch_id}").get_json())["status"] == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert batch["status"] == "in_progress", batch
    assert batch["request_counts"]["total"] == 3 and batch["request_counts"]["failed"] >= 1
    assert client.post(f"/v1/batches/{batch_id}/cancel").status_code == 200
    deadline = time.monotonic() + 60
    while (batch := client.get(f"/v1/batches/{batch_id}").get_json())["status"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    errors = client.get(f"/v1/files/{batch['error_file_id']}/content").get_data().decode()
    line = next(json.loads(x) for x in errors.splitlines() if json.loads(x)["custom_id"] == "b")
    assert line["error"]["code"] == "invalid_text"
    assert "body.prompt" in line["error"]["message"]
