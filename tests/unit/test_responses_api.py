"""The Responses routes with Flask's test client, fakeredis and a hand-driven
job (no worker): what a response says once its events have expired, and a
stream whose events expire while it is read."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from flask.testing import FlaskClient

from jobs.store.events import DONE, error_event
from jobs.store.scheduling import CANCEL_EVENTS, Cancelled, Store
from jobs.worker.chunks import ChunkWriter
from scheduler.settings import Settings
from scheduler.state import JobState
from tests.fakes import FakeVocab
from web import sse
from web.app import create_app
from web.janitor import compact_ended

TEXTS = ["The ", "park ", "is ", "green."]


@pytest.fixture
def client(settings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    s = settings.model_copy(update={"model_alias": "fake-model"})
    return create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ")]  # fmt: skip


def _started(client: FlaskClient, store: Store) -> tuple[str, str]:
    """A background response, claimed by a worker "w" that wrote TEXTS."""
    body = {"input": "hi", "background": True, "max_output_tokens": 5}
    response_id = client.post("/v1/responses", json=body).get_json()["id"]
    claim = store.claim("w", time.time())
    assert claim is not None and claim.job_id == response_id
    writer = ChunkWriter("chat", response_id, "fake-model", 0, lambda t: bytes([t]))
    payloads = [writer.role()] + [writer.delta(t, None, 0) for t in TEXTS]
    store.step(response_id, claim.exec_token, "w", len(TEXTS), 1, payloads)
    return response_id, claim.exec_token


def test_a_finished_response_reads_the_same_after_its_events_expire(
    client: FlaskClient, store: Store
) -> None:
    response_id, token = _started(client, store)
    writer = ChunkWriter("chat", response_id, "fake-model", 0, lambda t: bytes([t]))
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    store.finish(response_id, token, "w", JobState.FINISHED,
                 {"finish_reason": "length", "usage": json.dumps(usage), "tokens": "4"},
                 len(TEXTS) + 2, [writer.finish("length"), writer.usage(usage), DONE],
                 time.time())  # fmt: skip
    before = client.get(f"/v1/responses/{response_id}").get_json()
    assert before["status"] == "incomplete" and before["usage"]["total_tokens"] == 7
    compact_ended(store, replay_seconds=0)  # its result kept, its events gone
    assert not store.events_after(response_id, 0)
    after = client.get(f"/v1/responses/{response_id}").get_json()
    text = "".join(p["text"] for p in after["output"][0]["content"])
    assert text == "".join(TEXTS) and after["status"] == "incomplete"
    assert after["usage"] == before["usage"]
    whole = _events(client.get(f"/v1/responses/{response_id}?stream=true").data)
    assert whole[-1]["type"] == "response.incomplete"
    assert "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta") == text
    # A resumed stream cannot continue numbers its events no longer have.
    assert (
        client.get(f"/v1/responses/{response_id}?stream=true&starting_after=3").status_code == 410
    )


def test_a_cancelled_response_keeps_its_partial_output_after_its_events_expire(
    client: FlaskClient, store: Store
) -> None:
    response_id, token = _started(client, store)
    assert store.cancel(response_id, time.time()) is Cancelled.CANCELLING
    store.finish(response_id, token, "w", JobState.CANCELLED,
                 {"finish_reason": "cancelled", "tokens": "4"}, 0, CANCEL_EVENTS,
                 time.time())  # fmt: skip
    live = client.get(f"/v1/responses/{response_id}").get_json()
    compact_ended(store, replay_seconds=0)
    assert not store.events_after(response_id, 0)
    kept = client.get(f"/v1/responses/{response_id}").get_json()
    for body in (live, kept):
        assert body["status"] == "cancelled"
        assert "".join(p["text"] for p in body["output"][0]["content"]) == "".join(TEXTS)


def test_a_stream_whose_events_expire_while_it_is_read_ends_with_an_error_not_a_splice(
    client: FlaskClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events that expire after some were read (a slow reader): the stream
    cannot go on numbering from the kept result, so it says so and ends."""
    response_id, _ = _started(client, store)
    writer = ChunkWriter("chat", response_id, "fake-model", 0, lambda t: bytes([t]))
    gone = error_event("expired", "invalid_request_error", "expired")

    def expiring(*_: Any, **__: Any) -> Iterator[tuple[int, str]]:
        yield 1, writer.role()
        yield 2, writer.delta(TEXTS[0], None, 0)
        yield 3, gone

    monkeypatch.setattr(sse, "events", expiring)
    events = _events(client.get(f"/v1/responses/{response_id}?stream=true").data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "expired"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [TEXTS[0]]  # what was read, once; nothing spliced after it


def test_every_log_line_of_a_request_carries_the_id_its_response_has(
    client: FlaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        resp = client.post("/v1/completions", json={"prompt": "hello", "stream": True},
                           headers={"X-Request-Id": "edge-7:a"})  # fmt: skip
        job_id = resp.headers["X-Job-Id"]
        resp.close()
    assert resp.headers["x-request-id"] == "edge-7:a"
    queued = [r.getMessage() for r in caplog.records if job_id in r.getMessage()]
    assert queued and all(m.startswith("[edge-7:a] ") for m in queued)
    for given in ("", "x" * 129, "with space", "é"):
        made = client.get("/v1/jobs/nope", headers={"X-Request-Id": given} if given else {})
        assert made.status_code == 404
        assert made.headers["x-request-id"].startswith("req_")
