"""Batch webhooks: an event when a batch ends, POSTed to PARKQ_WEBHOOK_URL in
OpenAI's shape and signed as Standard Webhooks (``webhook-id``,
``webhook-timestamp``, ``webhook-signature``), so the openai client's
``client.webhooks.unwrap(body, headers, secret=...)`` verifies it.

An event is written to Redis in the same transaction that ends its batch
(:func:`add`), and stays there until its endpoint answers 2xx: a sending thread
in every ``parkq web`` process claims due events for a lease, signs each anew
(the timestamp is the attempt's: the client refuses one older than 5 minutes)
and POSTs it; a failed attempt is tried again, backing off up to an hour, for
PARKQ_WEBHOOK_RETRY_SECONDS, then dropped (logged and counted). A process that
dies mid-delivery leaves its claim to expire, and another sends the event
again: delivery is at least once, under one ``webhook-id`` (receivers
deduplicate by it, as Standard Webhooks asks).
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from datetime import UTC, datetime
from typing import Any

import redis
import requests
from standardwebhooks.webhooks import Webhook

from jobs.store.scheduling import Store
from jobs.store.telemetry import as_text
from scheduler.settings import Settings

__all__ = ["EVENT_TYPES", "Sender", "add", "pending", "start_sender"]

log = logging.getLogger(__name__)

#: A batch's final status -> the type of the event it sends.
EVENT_TYPES = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "cancelled": "batch.cancelled",
    "expired": "batch.expired",
}
#: A claimed event is another sender's after this long (more than an attempt takes).
LEASE_SECONDS = 60.0
#: One attempt's longest wait for the endpoint's answer.
TIMEOUT_SECONDS = 10.0
#: Events one round tries, one claim each (a claim outlives its one attempt).
CLAIM = 16
#: The longest pause between two attempts of one event.
MAX_BACKOFF_SECONDS = 3600.0

# Due events (score <= now) moved past their lease, atomically: one sender each.
_CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], ARGV[2], id)
end
return ids
"""

# A failed attempt, written only while the event is still there (another sender
# that took it after a lapsed claim may have delivered it meanwhile).
_RETRY = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'attempts', ARGV[2], 'last_error', ARGV[3])
redis.call('ZADD', KEYS[2], 'XX', ARGV[4], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'webhook_attempts_failed', 1)
return 1
"""


def add(pipe: redis.client.Pipeline, store: Store, status: str, batch_id: str,
        now: float) -> str | None:  # fmt: skip
    """Queue the event of a batch that ends with ``status`` on ``pipe`` (the
    transaction that writes that status); its id, or None where no webhook is
    configured or the status sends none."""
    settings = store.settings
    type_ = EVENT_TYPES.get(status)
    if not settings.webhook_url or type_ is None:
        return None
    event_id = f"evt_{secrets.token_hex(16)}"
    body = {"id": event_id, "object": "event", "created_at": int(now), "type": type_,
            "data": {"id": batch_id}}  # fmt: skip
    k = store.keys
    pipe.hset(k.webhook(event_id), mapping={
        "body": json.dumps(body, separators=(",", ":")),
        "type": type_,
        "created_at": repr(now),
        "attempts": "0",
    })  # fmt: skip
    pipe.zadd(k.webhooks_due, {event_id: now})
    return event_id


def pending(store: Store) -> int:
    """Events not yet acknowledged by their endpoint."""
    return int(store.r.zcard(store.keys.webhooks_due))


def backoff(attempts: int, first: float) -> float:
    """Seconds before attempt ``attempts + 1``: ``first``, doubling, at most an
    hour, with a fifth of jitter (senders of many events do not come back together)."""
    base = min(first * 2 ** max(attempts - 1, 0), MAX_BACKOFF_SECONDS)
    return float(base * random.uniform(0.8, 1.2))


class Sender:
    """The sending thread of one ``parkq web`` process."""

    def __init__(self, store: Store, settings: Settings, poll_seconds: float = 1.0) -> None:
        self.store = store
        self.settings = settings
        self.poll_seconds = poll_seconds
        assert settings.webhook_url and settings.webhook_secret
        self.url = settings.webhook_url
        self.signer = Webhook(settings.webhook_secret)
        self._claim = store.r.register_script(_CLAIM)
        self._retry = store.r.register_script(_RETRY)
        self.http = requests.Session()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="parkq-webhooks", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        failures = 0
        while True:
            try:
                sent = self.once()
                failures = 0
            except redis.RedisError as exc:  # down, failing over: the events wait there
                failures = min(failures + 1, 6)
                log.warning("webhooks: Redis: %s", exc)
                sent = 0
            except Exception:  # a bug: the next round tries again
                failures = min(failures + 1, 6)
                log.exception("webhooks: a round failed")
                sent = 0
            if not sent:
                time.sleep(self.poll_seconds * 2**failures)

    def once(self, now: float | None = None) -> int:
        """Claim due events one at a time (each claim outlives its one attempt)
        and try each once, up to :data:`CLAIM`; how many were tried."""
        k = self.store.keys
        tried = 0
        while tried < CLAIM:
            at = time.time() if now is None else now
            got = self._claim(keys=[k.webhooks_due], args=[repr(at), repr(at + LEASE_SECONDS), 1])
            if not got:
                break
            self._attempt(as_text(got[0]))
            tried += 1
        return tried

    def _attempt(self, event_id: str) -> None:
        k, r = self.store.keys, self.store.r
        fields = {as_text(a): as_text(b) for a, b in r.hgetall(k.webhook(event_id)).items()}
        if "body" not in fields:  # delivered or dropped by another sender meanwhile
            r.zrem(k.webhooks_due, event_id)
            return
        body = fields["body"]
        attempts = int(fields.get("attempts", "0")) + 1
        error = self._post(event_id, body)
        now = time.time()
        if error is None:
            with r.pipeline() as p:
                p.delete(k.webhook(event_id))
                p.zrem(k.webhooks_due, event_id)
                p.hincrby(k.counters, "webhooks_delivered", 1)
                p.execute()
            log.info("webhook %s (%s) delivered, attempt %d", event_id, fields.get("type"),
                     attempts)  # fmt: skip
            return
        created = float(fields.get("created_at", now))
        if now - created >= self.settings.webhook_retry_seconds:
            with r.pipeline() as p:
                p.delete(k.webhook(event_id))
                p.zrem(k.webhooks_due, event_id)
                p.hincrby(k.counters, "webhook_attempts_failed", 1)
                p.hincrby(k.counters, "webhooks_dropped", 1)
                p.execute()
            log.error("webhook %s (%s) dropped after %d attempts over %.0f s: %s", event_id,
                      fields.get("type"), attempts, now - created, error)  # fmt: skip
            return
        wait = backoff(attempts, self.settings.webhook_backoff_seconds)
        self._retry(keys=[k.webhook(event_id), k.webhooks_due, k.counters],
                    args=[event_id, attempts, error, repr(now + wait)])  # fmt: skip
        log.warning("webhook %s (%s) attempt %d failed (%s); next in %.0f s", event_id,
                    fields.get("type"), attempts, error, wait)  # fmt: skip

    def _post(self, event_id: str, body: str) -> str | None:
        """One signed POST of ``body``; None if the endpoint took it (2xx), else why not."""
        stamp = datetime.now(tz=UTC)
        headers = {
            "webhook-id": event_id,
            "webhook-timestamp": str(int(stamp.timestamp())),
            "webhook-signature": self.signer.sign(event_id, stamp, body),
            "content-type": "application/json",
            "user-agent": "parkq-webhooks",
        }
        try:
            resp = self.http.post(self.url, data=body.encode(), headers=headers,
                                  timeout=TIMEOUT_SECONDS, allow_redirects=False)  # fmt: skip
        except requests.RequestException as exc:
            return f"{type(exc).__name__}: {exc}"[:500]
        if 200 <= resp.status_code < 300:
            return None
        return f"HTTP {resp.status_code}"


def start_sender(store: Store, settings: Settings) -> Any:
    """The sending thread, where PARKQ_WEBHOOK_URL is set (None otherwise)."""
    if not settings.webhook_url:
        return None
    sender = Sender(store, settings)
    sender.start()
    return sender
