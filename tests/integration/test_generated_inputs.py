"""Generated requests (tests/inputs.py) against the app with the tiny model's
real tokenizer and chat template and a real redis-server: never a 5xx; every
4xx in OpenAI's error body; a refused request leaves no key behind (no job, no
queue entry, no RQ record, no file, no batch).

No worker runs: a generation request that is accepted is sent streamed (its
``stream`` set unless the body gave a wrong type), its jobs are cancelled and
its response closed; an accepted batch is validated, then cancelled; an
uploaded file is deleted. PARKQ_INPUT_EXAMPLES sets the number of requests
(default 300; ``PARKQ_INPUT_EXAMPLES=5000`` for a long run)."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from flask.testing import FlaskClient
from hypothesis import HealthCheck, event, given, settings

from scheduler.settings import load_settings
from tests.inputs import FILE_ID, JOB_ID, RESPONSE_ID, Call, requests
from web.app import create_app

settings.register_profile(
    "parkq-inputs",
    max_examples=int(os.environ.get("PARKQ_INPUT_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: Keys a refused request may still change: counters and latency figures.
TELEMETRY = (":counters", ":hist:", ":samples:")


class App:
    def __init__(self, client: FlaskClient, r: redis.Redis, prefix: str) -> None:
        self.client, self.r, self.prefix = client, r, prefix
        self.file_id = ""
        self.response_id = ""
        self.job_id = self._cancelled_job()

    def keys(self) -> set[bytes]:
        """Every key of this app's store and of RQ, but its telemetry and what
        only RQ workers write: their registrations and their executions of jobs
        (no request makes one; other tests' workers on this Redis come and go,
        take jobs, and their keys expire, while this test runs)."""
        found = set(self.r.scan_iter(f"{self.prefix}:*", count=1000))
        found |= {k for k in self.r.scan_iter("rq:*", count=1000)
                  if not k.startswith((b"rq:worker", b"rq:execution"))}  # fmt: skip
        return {k for k in found if not any(t.encode() in k for t in TELEMETRY)}

    def _cancelled_job(self) -> str:
        resp = self.client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        job_id = resp.headers["X-Job-Id"]
        resp.close()
        assert self.client.delete(f"/v1/jobs/{job_id}").status_code == 200
        return str(job_id)

    def a_response(self) -> str:
        """A cancelled background response of this app (made again if a request
        deleted it): its routes answer about a real response."""
        path = f"/v1/responses/{self.response_id}"
        if self.response_id and self.client.get(path).status_code == 200:
            return self.response_id
        body = {"input": "hi", "background": True, "max_output_tokens": 2}
        self.response_id = self.client.post("/v1/responses", json=body).get_json()["id"]
        assert self.client.post(f"/v1/responses/{self.response_id}/cancel").status_code == 200
        return self.response_id

    def a_file(self) -> str:
        """A batch input file of this app (uploaded again if a request deleted it)."""
        if self.file_id and self.client.get(f"/v1/files/{self.file_id}").status_code == 200:
            return self.file_id
        line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}
        form = {"purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode()), "f.jsonl")}
        self.file_id = self.client.post("/v1/files", data=form).get_json()["id"]
        return self.file_id


@pytest.fixture(scope="module")
def app(redis_server: Any, tiny_model: Path) -> Iterator[App]:
    prefix = f"inputs{time.monotonic_ns()}"
    s = load_settings(model=str(tiny_model), redis_url=redis_server.url, key_prefix=prefix,
                      queue_name=prefix, n_ctx=512, batch_max_lines=20)  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    yield App(create_app(s, client=client).test_client(), client, prefix)
    client.close()


def _prepared(call: Call, app: App) -> Call:
    """The call with this app's ids in place of the markers, and a generation
    request that would wait for a worker sent streamed instead."""
    marks = {quote(FILE_ID, safe=""): app.a_file, quote(JOB_ID, safe=""): lambda: app.job_id,
             quote(RESPONSE_ID, safe=""): app.a_response}  # fmt: skip
    path = call.path
    for quoted, made in marks.items():
        if quoted in path:
            path = path.replace(quoted, made())
    body = call.body
    if isinstance(body, dict):
        if body.get("input_file_id") == FILE_ID:
            body = {**body, "input_file_id": app.a_file()}
        if path.endswith("completions") and body.get("stream", False) is False:
            body = {**body, "stream": True}
        # A response that is not in the background is streamed too (one that is
        # is answered at once).
        if path == "/v1/responses" and body.get("stream", False) is False:
            body = {**body, "stream": True}
    return replace(call, path=path, body=body)


def _send(app: App, call: Call) -> Any:
    if call.form is not None:
        form = {k: (io.BytesIO(v[0]), v[1]) if isinstance(v, tuple) else v
                for k, v in call.form.items()}  # fmt: skip
        return app.client.open(call.path, method=call.method, data=form,
                               content_type="multipart/form-data")  # fmt: skip
    if call.data is None:
        return app.client.open(call.path, method=call.method)
    return app.client.open(call.path, method=call.method, data=call.data,
                           content_type="application/json")  # fmt: skip


def _clean_up(app: App, call: Call, resp: Any) -> None:
    """Undo what an accepted request made: no worker will run it."""
    if job_id := resp.headers.get("X-Job-Id"):
        assert app.client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202, 409)
    elif call.path == "/v1/responses" and call.method == "POST":  # a background one
        response_id = resp.get_json()["id"]
        assert app.client.delete(f"/v1/responses/{response_id}").status_code == 200
    elif call.path == "/v1/batches" and call.method == "POST":
        batch_id = resp.get_json()["id"]
        deadline = time.monotonic() + 30
        while app.client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        app.client.post(f"/v1/batches/{batch_id}/cancel")  # (409 once ended: all lines bad)
    elif call.path == "/v1/files" and call.method == "POST":
        assert app.client.delete(f"/v1/files/{resp.get_json()['id']}").status_code == 200


@settings(settings.get_profile("parkq-inputs"))
@given(call=requests())
def test_generated_requests_get_an_answer_or_a_clear_4xx_and_leave_nothing(
    app: App, call: Call
) -> None:
    call = _prepared(call, app)
    before = app.keys()
    queued = app.r.zcard(f"{app.prefix}:queue")
    resp = _send(app, call)
    try:
        status = resp.status_code
        route = call.path if call.path.count("/") < 3 else "/".join(call.path.split("/")[:3])
        event(f"{call.method} {route}: {status}")
        head = resp.get_data()[:300] if resp.mimetype != "text/event-stream" else b"(a stream)"
        assert status < 500, (call.method, call.path, (call.data or b"")[:300], status, head)
        if status >= 400:
            body = resp.get_json()
            assert body is not None, (status, head)
            error = body["error"]
            event(f"{call.method} {route}: {status} {error.get('param')} {error.get('code')}")
            assert set(error) == {"message", "type", "param", "code"}, error
            assert isinstance(error["message"], str) and error["message"], error
            assert isinstance(error["type"], str), error
            assert error["param"] is None or isinstance(error["param"], str), error
            if call.method == "POST" and status != 409:
                assert app.keys() == before, (call.path, status, app.keys() ^ before)
                assert app.r.zcard(f"{app.prefix}:queue") == queued
    finally:
        if resp.status_code == 200:
            _clean_up(app, call, resp)
        resp.close()
    assert app.r.zcard(f"{app.prefix}:queue") == 0, "an accepted job was left queued"
