"""Inputs that once got a 500 or failed a whole batch (issue 33, "every input"),
with Flask's test client, fakeredis and the fake vocabulary: each is a 400 in
OpenAI's error body naming the field, or (in a batch) one error line."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import fakeredis
import pytest
from flask.testing import FlaskClient
from llama_cpp import llama_chat_format

from jobs.store.events import DONE
from jobs.store.scheduling import Claim, Store
from jobs.worker.loop import Worker
from scheduler.settings import Settings
from scheduler.state import JobState
from tests.fakes import FakeEngine, FakeVocab
from web.app import create_app
from web.janitor import compact_ended

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(settings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    return create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()


def _error(resp: Any) -> dict[str, Any]:
    body = resp.get_json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error"
    return dict(body["error"])


def _nothing_queued(r: fakeredis.FakeRedis, settings: Settings) -> None:
    assert r.zcard(settings.keys.queue) == 0
    assert not list(r.scan_iter(settings.keys.job("*")))
    assert r.llen(f"rq:queue:{settings.queue_name}") == 0


@pytest.mark.parametrize(
    "key", ["²", "٣", "1²", "\uff11", " 1", "+1", "-1", "1e3", "", "9999999999"]
)
def test_a_logit_bias_key_that_is_not_ascii_digits_is_a_400(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings, key: str
) -> None:
    for route, body in (("/v1/chat/completions", {"messages": CHAT}),
                        ("/v1/completions", {"prompt": "hi"})):  # fmt: skip
        resp = client.post(route, json={**body, "logit_bias": {key: 1}, "stream": True})
        assert resp.status_code == 400, (key, resp.get_data()[:200])
        assert _error(resp)["param"] == "logit_bias"
    _nothing_queued(fake_redis, settings)


def test_a_logit_bias_in_ascii_digits_past_the_vocabulary_is_a_400(client: FlaskClient) -> None:
    ok = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"007": 1},
                                              "stream": True})  # fmt: skip
    assert ok.status_code == 200
    ok.close()
    resp = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"257": 1}})
    assert resp.status_code == 400 and _error(resp)["param"] == "logit_bias"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "seed": Infinity}',
        b'{"prompt": "hi", "user": ' + b"[" * 100 + b"]" * 100 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "hi", "x": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
    ],
    ids=["NaN", "Infinity", "100 deep", "100000 deep", "5000 deep objects"],
)
def test_a_body_off_json_or_nested_too_deep_is_a_400(
    settings: Settings, fake_redis: fakeredis.FakeRedis, raw: bytes
) -> None:
    s = settings.model_copy(update={"max_body_bytes": 1 << 20})
    client = create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()
    resp = client.post("/v1/completions", data=raw, content_type="application/json")
    assert resp.status_code == 400, resp.get_data()[:300]
    assert "not valid JSON" in _error(resp)["message"]


def test_jsonl_lines_split_at_newlines_only() -> None:
    """U+2028, U+2029 and U+0085 may stand raw in a JSON string; the controls
    \\x0b, \\x0c and \\x1c-\\x1e may not, but still do not end a line."""
    text = '\ufeff{"a": "x\u2028y\u2029z\x85"}\r\n\n  \r\n{"b": 1}\n\x0b\x0c\x1c\x1d\x1e\n{"c": 2}'
    from web.files import jsonl_lines

    lines = list(jsonl_lines(text.encode()))
    assert [n for n, _ in lines] == [1, 4, 5, 6]
    assert json.loads(lines[0][1])["a"] == "x\u2028y\u2029z\x85"
    assert lines[1][1] == '{"b": 1}'
    assert lines[2][1] == "\x0b\x0c\x1c\x1d\x1e"
    with pytest.raises(UnicodeDecodeError):
        list(jsonl_lines(b"\xff\n"))


# -- chat messages and templates ------------------------------------------------

#: A template that renders tool calls as many published ones do, and an extra field.
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<call>{{ c.function.name }}: {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% endif %}"
    "{% if m.tags is defined %}[{{ m.tags | join(', ') }}]{% endif %}"
    "{% if m.role == 'system' and loop.index > 1 %}{{ raise_exception('system first') }}{% endif %}"
    "\n{% endfor %}<|assistant|>"
)


class TemplateVocab(FakeVocab):
    """The fake vocabulary with llama-cpp-python's own Jinja2 renderer."""

    def __init__(self) -> None:
        self.formatter: Any = llama_chat_format.Jinja2ChatFormatter(TOOLS_TEMPLATE, "", "")

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]:
        return self.formatter(messages=messages, tools=tools).prompt, []


@pytest.fixture
def tclient(settings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    return create_app(settings, vocab=TemplateVocab(), client=fake_redis).test_client()


def _assistant(**fields: Any) -> list[dict[str, Any]]:
    return [*CHAT, {"role": "assistant", "content": "", **fields}, {"role": "user", "content": "?"}]


GOOD_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_calls": "f()"}, "messages.1.tool_calls"),
        ({"tool_calls": {"0": GOOD_CALL}}, "messages.1.tool_calls"),
        ({"tool_calls": [5]}, "messages.1.tool_calls.0"),
        ({"tool_calls": [{"id": "c1", "type": "function"}]}, "messages.1.tool_calls.0.function"),
        ({"tool_calls": [{**GOOD_CALL, "function": {"name": "f", "arguments": {"a": 1}}}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"tool_calls": [{**GOOD_CALL, "function": {"arguments": "{}"}}]},
         "messages.1.tool_calls.0.function.name"),
        ({"tool_calls": [{**GOOD_CALL, "type": "code"}]}, "messages.1.tool_calls.0.type"),
        ({"name": 5}, "messages.1.name"),
        ({"tool_call_id": ["c1"]}, "messages.1.tool_call_id"),
    ],
)  # fmt: skip
def test_malformed_tool_calls_are_a_400_naming_the_field(
    tclient: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings, fields, param
) -> None:
    resp = tclient.post("/v1/chat/completions", json={"messages": _assistant(**fields)})
    assert resp.status_code == 400, resp.get_data()[:300]
    assert _error(resp)["param"] == param
    _nothing_queued(fake_redis, settings)


def test_well_formed_tool_calls_are_rendered(tclient: FlaskClient) -> None:
    resp = tclient.post("/v1/tokenize", json={"messages": _assistant(tool_calls=[GOOD_CALL])})
    assert resp.status_code == 200, resp.get_data()[:300]
    text = bytes(resp.get_json()["tokens"]).decode()
    assert '<call>f: "{}"</call>' in text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi", "tags": 5}],  # join of an int: TypeError
        [*CHAT, {"role": "system", "content": "late"}],  # the template's raise_exception
    ],
)
def test_a_template_that_fails_on_the_messages_is_a_400(
    tclient: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings, messages
) -> None:
    for route in ("/v1/chat/completions", "/v1/tokenize"):
        resp = tclient.post(route, json={"messages": messages})
        assert resp.status_code == 400, resp.get_data()[:300]
        err = _error(resp)
        assert err["param"] == "messages" and err["code"] == "chat_template_error"
        assert "chat template" in err["message"]
    _nothing_queued(fake_redis, settings)


def test_malformed_tools_are_a_400_before_the_template_renders_them(tclient: FlaskClient) -> None:
    for tools in ([{"type": "function"}], [{"type": "function", "function": "f"}], [7]):
        resp = tclient.post("/v1/chat/completions", json={"messages": CHAT, "tools": tools})
        assert resp.status_code == 400, resp.get_data()[:300]
        assert _error(resp)["param"] == "tools.0"


# -- n > 1 after a choice's events or record expired -----------------------------


def _claim(store: Store, worker: str) -> Claim:
    claim = store.claim(worker, time.time())
    assert claim is not None
    return claim


def _finish(store: Store, claim: Claim, worker: str, text: str) -> None:
    """Finish the claimed job with ``text``, as a worker does."""
    chunk = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
    last = {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]}  # fmt: skip
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    store.finish(claim.job_id, claim.exec_token, worker, JobState.FINISHED,
                 {"usage": json.dumps(usage), "finish_reason": "stop"}, 1,
                 [json.dumps(chunk), json.dumps(last), DONE], time.time())  # fmt: skip


def test_a_choice_that_ended_past_the_replay_window_before_its_siblings_is_answered(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    """n=2, not streamed: choice 1 ends, the janitor compacts it and its events
    expire; then choice 0 ends. The answer holds both (once a 500)."""
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    store = client.application.extensions["parkq"].store
    got: list[Any] = []
    body = {"messages": CHAT, "n": 2, "max_tokens": 2}
    thread = threading.Thread(target=lambda: got.append(client.post("/v1/chat/completions",
                                                                    json=body)))  # fmt: skip
    thread.start()
    deadline = time.monotonic() + 10
    while len(queued := [x.decode() for x in fake_redis.zrange(settings.keys.queue, 0, -1)]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    zero, one = _claim(store, "w0"), _claim(store, "w1")  # both run, on two workers
    assert (zero.job_id, one.job_id) == (queued[0], queued[1])
    _finish(store, one, "w1", "one")
    compact_ended(store, replay_seconds=1)
    time.sleep(1.3)  # choice 1's events expire; its result is kept in its record
    assert not fake_redis.exists(settings.keys.events(one.job_id))
    _finish(store, zero, "w0", "zero")
    thread.join(timeout=20)
    resp = got[0]
    assert resp.status_code == 200, resp.get_data()[:400]
    choices = resp.get_json()["choices"]
    assert [(c["index"], c["message"]["content"]) for c in choices] == [(0, "zero"), (1, "one")]


def test_a_job_with_a_choice_whose_record_expired_is_a_410_not_a_500(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hi", "n": 3, "stream": True})
    job_id = resp.headers["X-Job-Id"]
    resp.close()
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200  # every choice ended
    assert client.get(f"/v1/jobs/{job_id}").get_json()["state"] == "cancelled"
    fake_redis.delete(settings.keys.job(f"{job_id}_1"))  # past its result TTL
    got = client.get(f"/v1/jobs/{job_id}")
    assert got.status_code == 410, got.get_data()[:300]
    assert "choice 1" in _error(got)["message"]


# -- batch lines ---------------------------------------------------------------


def _run_batch(client: FlaskClient, r: fakeredis.FakeRedis, settings: Settings,
               content: bytes, endpoint: str = "/v1/completions") -> dict[str, Any]:  # fmt: skip
    form = {"purpose": "batch", "file": (io.BytesIO(content), "in.jsonl")}
    up = client.post("/v1/files", data=form, content_type="multipart/form-data")
    assert up.status_code == 200, up.get_data()
    made = client.post(
        "/v1/batches",
        json={
            "input_file_id": up.get_json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
        },
    )
    assert made.status_code == 200, made.get_data()
    batch_id = made.get_json()["id"]
    w = Worker(settings, FakeEngine(), r, name="w1")
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while (batch := client.get(f"/v1/batches/{batch_id}").get_json())["status"] not in (
            "completed", "failed", "cancelled"):  # fmt: skip
            assert time.monotonic() < deadline, batch
            time.sleep(0.02)
    finally:
        w.stop()
        thread.join(timeout=10)
    return dict(batch)


def _rows(client: FlaskClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = client.get(f"/v1/files/{file_id}/content").get_data()
    return [json.loads(line) for line in data.split(b"\n") if line]


def test_one_refused_line_is_one_error_line_and_the_others_run(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings
) -> None:
    """Lines the endpoint refuses in every way that once failed the whole batch
    (int('²'), a nesting past the stack) or split a line (a raw U+2028)."""

    def line(custom_id: str, **body: Any) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "hi", "max_tokens": 2, **body}},
                          ensure_ascii=False)  # fmt: skip

    deep = '{"custom_id": "deep", "body": ' + "[" * 3000 + "]" * 3000 + "}"
    lines = [
        line("a", user="x\u2028y"),
        line("bad", logit_bias={"²": 1}),
        deep,
        line("c", stop=["\u2029"]),
        line("nan", temperature=1.0).replace("1.0", "NaN"),
    ]
    content = ("\ufeff" + "\r\n".join(lines)).encode()  # a BOM, CRLF, no last newline
    batch = _run_batch(client, fake_redis, settings, content)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    assert [x["custom_id"] for x in _rows(client, batch["output_file_id"])] == ["a", "c"]
    errors = _rows(client, batch["error_file_id"])
    assert sorted((x["custom_id"] or "") for x in errors) == ["", "", "bad"]
    assert all(set(x["error"]) >= {"code", "message"} for x in errors)
    refused = next(x for x in errors if x["custom_id"] == "bad")
    assert "logit_bias" in refused["error"]["message"]


def test_a_line_a_bug_refuses_is_that_lines_error(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from web.intake import completion_job as real

    def buggy(req: Any) -> Any:
        if req.user == "boom":
            raise KeyError("a bug")
        return real(req)

    monkeypatch.setattr("web.batches.completion_job", buggy)
    good: dict[str, Any] = {
        "custom_id": "ok",
        "url": "/v1/completions",
        "body": {"prompt": "hi", "max_tokens": 1},
    }
    bad = {**good, "custom_id": "boom", "body": {**good["body"], "user": "boom"}}
    batch = _run_batch(client, fake_redis, settings,
                       f"{json.dumps(good)}\n{json.dumps(bad)}\n".encode())  # fmt: skip
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert [x["custom_id"] for x in _rows(client, batch["error_file_id"])] == ["boom"]
