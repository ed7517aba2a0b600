"""Server-sent events: framing, and one job's event stream (replay, then live).

A reader subscribes to the job's pub/sub channel first, then replays the
stored events after its last id from the job's Redis stream, then follows the
live announcements. Any gap (a missed announcement, a reconnect to Redis) is
filled from the stream, so every event reaches the reader once, in order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import redis

from jobs.events import DONE
from jobs.store import Store

__all__ = ["KEEPALIVE", "events", "frame"]

KEEPALIVE = b": keepalive\n\n"


def frame(seq: int, data: str) -> bytes:
    """One SSE event with its id."""
    return f"id: {seq}\ndata: {data}\n\n".encode()


def events(
    store: Store, job_id: str, after: int, keepalive: float
) -> Iterator[tuple[int, str] | None]:
    """Yield ``(seq, data)`` for every event after ``after``; ``None`` when idle.

    Ends after the ``[DONE]`` event. ``None`` comes at least every
    ``keepalive`` seconds while nothing happens, so the caller can keep the
    connection alive.
    """
    pubsub = store.r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.channel(job_id))
    last = after
    store.reader(job_id, +1, time.time())
    try:
        while True:
            for seq, data in store.events_after(job_id, last):
                last = seq
                yield seq, data
                if data == DONE:
                    return
            deadline = time.monotonic() + keepalive
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    yield None
                    break
                try:
                    msg = pubsub.get_message(timeout=left)
                except redis.ConnectionError:
                    time.sleep(min(1.0, left))
                    break
                if msg is None:
                    continue
                head, _, data = msg["data"].decode().partition(" ")
                seq = int(head)
                if seq <= last:
                    continue
                if seq != last + 1:
                    break  # a gap: fill it from the stream
                last = seq
                yield seq, data
                if data == DONE:
                    return
                deadline = time.monotonic() + keepalive
    finally:
        pubsub.close()
        store.reader(job_id, -1, time.time())
