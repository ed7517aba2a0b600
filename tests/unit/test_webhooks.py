"""The webhook outbox's logic on fakeredis: what is queued, when an attempt comes
again, and what is given up. Delivery to a real endpoint, the openai client's
verification and a web restart: tests/integration/test_webhooks.py."""

from __future__ import annotations

import base64
import json

import fakeredis
import pytest

from jobs.store.scheduling import Store
from scheduler.settings import Settings
from web import webhooks

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()


def _store(fake_redis: fakeredis.FakeRedis, **given: object) -> Store:
    settings = Settings(redis_url="redis://fake", n_ctx=0, **given)  # type: ignore[arg-type]
    return Store(fake_redis, settings)


def _queue(store: Store, status: str, batch_id: str = "batch_1", now: float = 1000.0) -> str | None:
    with store.r.pipeline() as p:
        event_id = webhooks.add(p, store, status, batch_id, now)
        p.execute()
    return event_id


def test_an_ended_batch_queues_one_event_of_its_status(fake_redis: fakeredis.FakeRedis) -> None:
    store = _store(fake_redis, webhook_url="http://127.0.0.1:9/hook", webhook_secret=SECRET)
    for status, type_ in webhooks.EVENT_TYPES.items():
        event_id = _queue(store, status, f"batch_{status}")
        assert event_id is not None
        body = json.loads(store.r.hget(store.keys.webhook(event_id), "body") or b"")
        assert body == {"id": event_id, "object": "event", "created_at": 1000, "type": type_,
                        "data": {"id": f"batch_{status}"}}  # fmt: skip
    assert webhooks.pending(store) == 4
    assert _queue(store, "in_progress") is None  # not an end


def test_nothing_is_queued_without_a_webhook_url(fake_redis: fakeredis.FakeRedis) -> None:
    store = _store(fake_redis)
    assert _queue(store, "completed") is None
    assert webhooks.pending(store) == 0 and not fake_redis.keys("*webhook*")


def test_attempts_back_off_doubling_up_to_an_hour() -> None:
    for attempts, base in ((1, 5.0), (2, 10.0), (3, 20.0), (30, 3600.0)):
        for _ in range(50):
            assert 0.8 * base <= webhooks.backoff(attempts, 5.0) <= 1.2 * base


def test_a_refused_attempt_comes_again_later_and_a_too_old_event_is_dropped(
    fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Port 9 (discard) refuses on the loopback: every attempt fails at once.
    store = _store(fake_redis, webhook_url="http://127.0.0.1:9/hook", webhook_secret=SECRET,
                   webhook_retry_seconds=3600)  # fmt: skip
    sender = webhooks.Sender(store, store.settings)
    clock = [1000.0]
    monkeypatch.setattr("web.webhooks.time.time", lambda: clock[0])
    event_id = _queue(store, "completed", now=clock[0])
    assert event_id is not None
    assert sender.once(clock[0]) == 1
    fields = store.r.hgetall(store.keys.webhook(event_id))
    assert fields[b"attempts"] == b"1" and fields[b"last_error"].startswith(b"ConnectionError")
    due = store.r.zscore(store.keys.webhooks_due, event_id)
    assert due is not None and clock[0] + 4 <= due <= clock[0] + 6
    assert sender.once(clock[0] + 1) == 0  # not yet due
    clock[0] = 1000.0 + 3600  # the retry window has passed: this attempt is the last
    assert sender.once(clock[0]) == 1
    assert webhooks.pending(store) == 0 and not store.r.exists(store.keys.webhook(event_id))
    counters = store.telemetry.counters()
    assert counters["webhook_attempts_failed"] == 2 and counters["webhooks_dropped"] == 1


def test_a_claimed_event_is_not_taken_by_another_sender_within_its_lease(
    fake_redis: fakeredis.FakeRedis,
) -> None:
    store = _store(fake_redis, webhook_url="http://127.0.0.1:9/hook", webhook_secret=SECRET)
    event_id = _queue(store, "failed", now=1000.0)
    claim = fake_redis.register_script(webhooks._CLAIM)
    key = store.keys.webhooks_due
    assert claim(keys=[key], args=["1000.5", repr(1000.5 + webhooks.LEASE_SECONDS), 16]) == [
        event_id.encode()  # type: ignore[union-attr]
    ]
    assert claim(keys=[key], args=["1001", "1061", 16]) == []  # held by the first
    assert claim(keys=[key], args=["1061", "1121", 16]) == [event_id.encode()]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"webhook_url": "http://x/hook"}, "PARKQ_WEBHOOK_SECRET is not"),
        ({"webhook_url": "ftp://x/hook", "webhook_secret": SECRET}, "http:// or https://"),
        ({"webhook_secret": "whsec_not base64!"}, "base64 of 16"),
        ({"webhook_secret": "whsec_" + base64.b64encode(b"short").decode()}, "base64 of 16"),
        # What the openai client cannot verify with: no prefix, or unpadded base64.
        ({"webhook_secret": SECRET.removeprefix("whsec_")}, "base64 of 16"),
        (
            {"webhook_secret": "whsec_" + base64.b64encode(b"x" * 17).decode().rstrip("=")},
            "base64 of 16",
        ),
    ],
)
def test_a_webhook_setting_that_cannot_work_stops_the_process_at_start(
    given: dict[str, str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        Settings(redis_url="redis://fake", **given)  # type: ignore[arg-type]
