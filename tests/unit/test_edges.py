"""Edge inputs: exact limits and absurd values get clear errors and leave nothing behind."""

from __future__ import annotations

import json

import fakeredis
import pytest
from flask.testing import FlaskClient

from scheduler.settings import Settings
from tests.fakes import FakeVocab
from web.app import create_app

LIMIT = 2000


@pytest.fixture
def client(settings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    s = settings.model_copy(update={"max_body_bytes": LIMIT})
    return create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()


def _body_of_size(size: int) -> bytes:
    base = {"prompt": "hi", "max_tokens": 1, "stream": True, "user": ""}
    pad = size - len(json.dumps(base).encode())
    return json.dumps({**base, "user": "x" * pad}).encode()


def _post(client: FlaskClient, data: bytes):
    resp = client.post("/v1/completions", data=data, content_type="application/json")
    resp.close()
    return resp


def test_body_exactly_at_the_limit_is_accepted_one_byte_over_is_413(client: FlaskClient) -> None:
    assert len(_body_of_size(LIMIT)) == LIMIT
    assert _post(client, _body_of_size(LIMIT)).status_code == 200
    assert _post(client, _body_of_size(LIMIT + 1)).status_code == 413


def test_prompt_exactly_filling_the_context_and_one_token_over(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis
) -> None:
    n_ctx = FakeVocab.n_ctx_train  # the fake tokenizer: one token per byte
    ok = {"prompt": "a" * (n_ctx - 1), "max_tokens": 1, "stream": True}
    assert _post(client, json.dumps(ok).encode()).status_code == 200
    over = {"prompt": "a" * n_ctx, "max_tokens": 1}
    resp = client.post("/v1/completions", json=over)
    assert resp.status_code == 400
    error = resp.get_json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"{n_ctx + 1}" in error["message"] and f"{n_ctx}" in error["message"]
    assert fake_redis.zcard("{parkq}:queue") == 1  # only the first one


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 10**9),
        ("max_tokens", -5),
        ("temperature", 1e9),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_k", -1),
        ("min_p", 2),
        ("seed", 2**70),
        ("priority", 10**9),
        ("priority", "urgent"),
        ("stop", ["s"] * 100),
        ("stop", ["x" * 1000]),
        ("n", 0),
        ("logprobs", 50),
    ],
)
def test_absurd_values_get_400_and_create_no_job(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, field: str, value: object
) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hello", field: value})
    assert resp.status_code == 400, resp.get_json()
    error = resp.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert fake_redis.zcard("{parkq}:queue") == 0
    assert fake_redis.llen("rq:queue:parkq") == 0


def test_redis_unavailable_is_a_503_never_a_500(settings: Settings) -> None:
    """Redis refusing connections (down, failing over, out of connections): the
    request answers 503 with Retry-After, in OpenAI's error body."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2,
                       retry=Retry(NoBackoff(), 0))  # fmt: skip
    client = create_app(settings, vocab=FakeVocab(), client=dead).test_client()
    for method, path, body in (("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                               ("GET", "/v1/jobs/some-job", None),
                               ("GET", "/v1/files", None)):  # fmt: skip
        resp = client.open(path, method=method, json=body)
        assert resp.status_code == 503, (path, resp.status_code, resp.get_data()[:200])
        assert resp.get_json()["error"]["code"] == "store_unavailable"
        assert resp.headers["Retry-After"] == "1"


def test_a_last_event_id_past_any_event_number_is_a_400(client: FlaskClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True})
    job_id = resp.headers["X-Job-Id"]
    resp.close()
    for bad in (str(2**64), "-1", "9" * 40):
        got = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
        assert got.status_code == 400, bad
        assert got.get_json()["error"]["type"] == "invalid_request_error"
