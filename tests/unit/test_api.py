"""The HTTP layer with Flask's test client, fakeredis and a fake vocabulary."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import fakeredis
import pytest
from flask.testing import FlaskClient

from jobs.store.events import DONE
from jobs.store.scheduling import Store
from scheduler.settings import Settings
from tests.fakes import FakeVocab
from web.app import create_app


@pytest.fixture
def client(settings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    s = settings.model_copy(update={"max_body_bytes": 2000, "model_alias": "fake-model"})
    return create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()


def _error(resp) -> dict[str, Any]:
    body = resp.get_json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 7}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "priority": "urgent"}, "priority"),
    ],
)
def test_invalid_chat_fields_get_400_naming_the_field(client: FlaskClient, body, param) -> None:
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    err = _error(resp)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_too_many_choices_says_the_limit(client: FlaskClient) -> None:
    resp = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 17}
    )
    assert "less than or equal to 16" in _error(resp)["message"]


def test_several_prompts_are_refused_by_name(client: FlaskClient, store) -> None:
    for prompt in (["one", "two"], [[1, 2], [3, 4]]):
        resp = client.post("/v1/completions", json={"prompt": prompt})
        assert resp.status_code == 400
        err = _error(resp)
        assert err["param"] == "prompt"
        assert "one prompt per request is supported" in err["message"]
    one = client.post("/v1/completions", json={"prompt": ["one"], "max_tokens": 1, "stream": True})
    assert one.status_code == 200
    one.close()
    assert store.r.zcard(store.keys.queue) == 1  # only the valid one was queued


def test_malformed_json_and_invalid_utf8(client: FlaskClient) -> None:
    for data in (b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]"):
        resp = client.post("/v1/completions", data=data, content_type="application/json")
        assert resp.status_code == 400
        _error(resp)


def test_body_over_the_limit_is_413(client: FlaskClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "x" * 5000})
    assert resp.status_code == 413
    assert _error(resp)["code"] == "request_too_large"


def test_prompt_plus_max_tokens_over_context_gives_counts(client: FlaskClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 100})
    assert resp.status_code == 400
    err = _error(resp)
    assert err["code"] == "context_length_exceeded"
    assert "256" in err["message"] and "300" in err["message"] and "200" in err["message"]


def test_rejected_requests_leave_no_job(client: FlaskClient, fake_redis) -> None:
    client.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 100})
    assert fake_redis.zcard("{parkq}:queue") == 0


def test_unknown_job_and_route_are_404(client: FlaskClient) -> None:
    for resp in (
        client.get("/v1/jobs/nope"),
        client.delete("/v1/jobs/nope"),
        client.get("/v1/jobs/nope/events"),
        client.get("/v1/nothing"),
    ):
        assert resp.status_code == 404
        _error(resp)


def test_models_lists_the_one_model(client: FlaskClient) -> None:
    data = client.get("/v1/models").get_json()["data"]
    assert [m["id"] for m in data] == ["fake-model"]


def test_healthz_needs_a_live_worker(client: FlaskClient, store: Store) -> None:
    resp = client.get("/healthz")
    assert resp.status_code == 503 and resp.get_json()["workers"] == 0
    store.workers.heartbeat("w1", 1e12, 10)  # alive far into the future
    body = client.get("/healthz").get_json()
    assert body == {"status": "ok", "redis": True, "workers": 1, "model": "fake-model"}


def _sse(raw: bytes) -> list[tuple[int, str]]:
    events = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "id" in lines:
            events.append((int(lines["id"]), lines["data"]))
    return events


def test_events_replay_after_last_event_id(client: FlaskClient, store: Store) -> None:
    store.enqueue("j1", "completion", {}, 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    chunks = [json.dumps({"n": i}) for i in range(5)]
    store.step("j1", claim.exec_token, "w", 5, 1, chunks)
    store.step("j1", claim.exec_token, "w", 5, 6, [DONE])
    resp = client.get("/v1/jobs/j1/events", headers={"Last-Event-ID": "3"})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert _sse(resp.data) == [(4, chunks[3]), (5, chunks[4]), (6, DONE)]


def test_live_events_follow_the_replay(client: FlaskClient, store: Store) -> None:
    store.enqueue("j2", "completion", {}, 0, 1.0)
    claim = store.claim("w", 2.0)
    assert claim is not None
    store.step("j2", claim.exec_token, "w", 1, 1, ["a"])

    def produce() -> None:
        for seq, data in enumerate(("b", "c", DONE), start=2):
            store.step("j2", claim.exec_token, "w", 1, seq, [data])

    timer = threading.Timer(0.3, produce)
    timer.start()
    resp = client.get("/v1/jobs/j2/events")
    raw = resp.data
    timer.join()
    assert _sse(raw) == [(1, "a"), (2, "b"), (3, "c"), (4, DONE)]
    assert b": keepalive" in raw  # the stream idled longer than keepalive_seconds


def test_cancel_queued_job(client: FlaskClient, store: Store) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hello", "stream": True})
    job_id = resp.headers["X-Job-Id"]
    resp.close()
    assert client.get(f"/v1/jobs/{job_id}").get_json()["state"] == "queued"
    assert client.delete(f"/v1/jobs/{job_id}").get_json()["state"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}").get_json()["state"] == "cancelled"
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 409
    assert store.claim("w", 1e12) is None


def test_a_full_queue_answers_429_with_retry_after(settings, fake_redis) -> None:
    s = settings.model_copy(update={"max_queue": 2})
    client = create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()
    codes = []
    for _ in range(3):
        resp = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        codes.append(resp.status_code)
        if resp.status_code == 429:
            assert int(resp.headers["Retry-After"]) >= 1
            err = _error(resp)
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        resp.close()
    assert codes == [200, 200, 429]
    assert fake_redis.zcard("{parkq}:queue") == 2
    assert fake_redis.llen("rq:queue:parkq") == 2  # the refused job left no RQ record


def test_a_waiting_non_streamed_request_holds_a_lease_not_a_count(
    client: FlaskClient, store: Store
) -> None:
    """While a non-streamed request waits, its job is read under a lease that
    ends by itself (a web process killed meanwhile leaves the job detached once
    the lease ends); when the request ends, the job is detached at once."""
    answers: list[Any] = []
    waiting = threading.Thread(
        target=lambda: answers.append(client.post("/v1/completions", json={"prompt": "hello"}))
    )
    waiting.start()
    lease = store.lease_seconds()
    for _ in range(200):
        job_ids = [j.decode() for j in store.r.zrange(store.keys.queue, 0, -1)]
        if job_ids and store.r.zcard(store.keys.readers(job_ids[0])):
            break
        threading.Event().wait(0.02)
    else:
        raise AssertionError("the request never read its job")
    job_id = job_ids[0]
    held, detached = store.r.hmget(store.keys.job(job_id), ["held", "detached_at"])
    assert int(held or 0) == 0  # no count that a killed process would leave behind
    assert detached is not None and float(detached) > time.time() + lease / 2
    store.cancel(job_id, time.time())
    waiting.join(timeout=10)
    assert not waiting.is_alive() and answers[0].status_code < 500
    readers, detached = store.r.hmget(store.keys.job(job_id), ["readers", "detached_at"])
    assert int(readers) == 0 and float(detached) <= time.time()
