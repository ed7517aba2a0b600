"""Server-sent events: framing, and one job's event stream (replay, then live).

A reader subscribes to the job's pub/sub channel first, then replays the
stored events after its last id from the job's Redis stream, then follows the
live announcements. Any gap (a missed announcement, a reconnect to Redis) is
filled from the stream, so every event reaches the reader once, in order.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import time
from collections.abc import Callable, Iterator

import redis

from jobs.store.events import DONE, error_event
from jobs.store.scheduling import Store

__all__ = ["KEEPALIVE", "Reading", "client_gone", "events", "frame", "merged"]

log = logging.getLogger(__name__)

KEEPALIVE = b": keepalive\n\n"


def frame(seq: int | str, data: str) -> bytes:
    """One SSE event with its id."""
    return f"id: {seq}\ndata: {data}\n\n".encode()


#: How often an idle stream checks that its client is still connected.
GONE_CHECK_SECONDS = 0.5
#: How long a stream waits for Redis to answer again before it gives up (the
#: client reconnects with Last-Event-ID; a waiting non-streamed request gets a
#: 503): longer than a failover or a restart takes.
OUTAGE_SECONDS = 120.0


def client_gone(sock: socket.socket | None) -> bool:
    """Whether the peer of ``sock`` has closed the connection (no write needed).

    A client that leaves while its job waits in the queue sends nothing more;
    without this check the server would notice only when a keep-alive write
    fails, up to two keep-alive periods later.
    """
    if sock is None:
        return False
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        if not ready:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, ValueError):  # ValueError: a TLS socket cannot peek
        return False
    except OSError:
        return True


class Reading:
    """A stream's hold on its jobs: a lease on each under a token of its own,
    taken at the start, renewed while it reads, given back at the end.

    Taking and giving back are idempotent (Store.lease), so :meth:`release`
    may follow a :meth:`hold` that failed halfway or whose answer was lost;
    a lease that cannot be given back (Redis unreachable then, the process
    killed) ends by itself ``lease`` seconds after its last renewal, and the
    job counts as left from then. A reader stalled longer than that (its
    client not reading) counts as left too.
    """

    def __init__(self, store: Store, job_ids: list[str], keepalive: float) -> None:
        self.store, self.job_ids = store, job_ids
        self.token = secrets.token_hex(8)
        self.lease = store.lease_seconds()
        self._renew_at = 0.0

    def hold(self, now: float) -> None:
        """Take (or renew) the lease on every job; raises what Redis raised."""
        for job_id in self.job_ids:
            self.store.lease(job_id, self.token, now + self.lease, now)
        self._renew_at = time.monotonic() + self.lease / 4

    def renew(self, force: bool = False) -> None:
        """Renew the leases when a quarter of one has passed (``force``: now); a
        failure is logged and tried again at the next call (the stream's own
        reads say whether Redis is gone)."""
        if not force and time.monotonic() < self._renew_at:
            return
        try:
            self.hold(time.time())
        except redis.RedisError as exc:
            log.warning("jobs %s: reader lease not renewed: %s", ",".join(self.job_ids), exc)
            self._renew_at = time.monotonic() + 1.0

    def release(self, now: float) -> None:
        """Give back the lease on every job, each on its own (one that fails
        ends by itself)."""
        for job_id in self.job_ids:
            try:
                self.store.lease(job_id, self.token, 0, now)
            except redis.RedisError as exc:
                log.warning("job %s: reader lease not given back (it ends in %.0f s): %s",
                            job_id, self.lease, exc)  # fmt: skip


def events(
    store: Store,
    job_id: str,
    after: int,
    keepalive: float,
    gone: Callable[[], bool] | None = None,
) -> Iterator[tuple[int, str] | None]:
    """Yield ``(seq, data)`` for every event after ``after``; ``None`` when idle.

    Ends after the ``[DONE]`` event, or when ``gone()`` says the client left
    (checked while idle, every GONE_CHECK_SECONDS). ``None`` comes at least every
    ``keepalive`` seconds while nothing happens, so the caller can keep the
    connection alive.
    """
    last = after
    for item in merged(store, [job_id], [after], keepalive, gone):
        if item is None:
            yield None
        elif item[1] > last:  # (not the [DONE] the client already has)
            last = item[1]
            yield item[1:]


def merged(
    store: Store,
    job_ids: list[str],
    after: list[int],
    keepalive: float,
    gone: Callable[[], bool] | None = None,
) -> Iterator[tuple[int, int, str] | None]:
    """The events of several jobs (the choices of one request) as they come:
    ``(i, seq, data)`` for job ``job_ids[i]``'s events after ``after[i]``, each
    job's in order; ``None`` when idle. Ends once every job has sent
    ``[DONE]`` (each one's ``[DONE]`` is yielded too), or when the client left.

    At the start and at every keep-alive each open job's state is read: a job
    that has ended with nothing stored after the client's id is closed. If its
    stream ends with a ``[DONE]`` at or before that id (a reconnect after the
    end), that ``[DONE]`` is yielded again under its own id (at or below the
    client's: :func:`events` drops it); if it ended without one (a refused
    transition, a fenced failure, a vanished record), its error and a ``[DONE]``
    are yielded under the ids after the stored ones (not stored: a reconnect
    with those ids gets what it lacks of them, or only the end).
    """
    pubsub = store.listen(job_ids)
    channels = {store.keys.channel(job_id).encode(): i for i, job_id in enumerate(job_ids)}
    last = list(after)
    open_ = set(range(len(job_ids)))
    reading = Reading(store, job_ids, keepalive)
    try:
        reading.hold(time.time())  # inside the try: a hold that fails is given back too
        stale = set(open_)  # jobs whose stored events may hold some not yet yielded
        failures, failing_since = 0, None
        while open_:
            try:
                for i in sorted(stale & open_):
                    end = store.ending(job_ids[i])  # before the events: all it wrote is stored
                    for seq, data in store.events_after(job_ids[i], last[i]):
                        last[i] = seq
                        yield i, seq, data
                        if data == DONE:
                            open_.discard(i)
                            break
                    if i in open_ and end is not None:
                        open_.discard(i)
                        if end.expired and last[i] < end.final_seq:
                            # Its events expired under this reader (past the replay
                            # window): said, never passed off as the end of its text.
                            lost = error_event(
                                "The job's events after this id have expired; GET "
                                f"/v1/jobs/{job_ids[i]}/result has its result.", "server_error",
                                "expired")  # fmt: skip
                            yield i, end.final_seq + 1, lost
                            yield i, end.final_seq + 2, DONE
                            continue
                        closing = [DONE] if end.done else end.closing_events()
                        for seq, data in enumerate(closing, start=end.final_seq - len(closing) + 1):
                            if seq > last[i]:
                                last[i] = seq
                                yield i, seq, data
                            elif data == DONE:
                                yield i, seq, data  # the client has it: the end, for merged readers
            except redis.RedisError as exc:
                # Redis down, failing over or refusing (any error reply): the
                # stream stays open (keep-alives) and reads again once it
                # answers; past OUTAGE_SECONDS the error is raised (a stream
                # ends, the client reconnects; a waiting request gets a 503).
                failures += 1
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > OUTAGE_SECONDS:
                    raise
                log.warning("jobs %s: events not read (%s); retrying",
                            ",".join(job_ids), exc)  # fmt: skip
                if gone is not None and gone():
                    return
                time.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)))
                yield None
                continue
            if failing_since is not None:
                # Back: the leases are renewed before anyone can take the
                # readers for gone (a worker compares them with the time).
                reading.renew(force=True)
            failures, failing_since = 0, None
            stale = set()
            deadline = time.monotonic() + keepalive
            while open_ and not stale:
                reading.renew()
                left = deadline - time.monotonic()
                if left <= 0:
                    yield None
                    stale = set(open_)  # and look in the streams once more
                    break
                if gone is not None and gone():
                    return
                try:
                    msg = pubsub.get_message(timeout=min(left, GONE_CHECK_SECONDS))
                except redis.RedisError:
                    time.sleep(min(1.0, left))
                    stale = set(open_)
                    break
                if msg is None:
                    continue
                i = channels[msg["channel"]]
                head, _, data = msg["data"].decode().partition(" ")
                seq = int(head)
                if seq <= last[i] or i not in open_:
                    continue
                if seq != last[i] + 1:
                    stale = {i}  # a gap: fill it from the stream
                    break
                last[i] = seq
                yield i, seq, data
                if data == DONE:
                    open_.discard(i)
                deadline = time.monotonic() + keepalive
    finally:
        try:
            reading.release(time.time())
        finally:
            pubsub.close()
