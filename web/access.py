"""One access-log line per HTTP request, with its request id, and the HTTP
request metrics (``parkq_http_requests_total``, by method, route and status;
``parkq_http_request_duration_seconds``, of the responses that are not
streams: a stream's duration is its generation's).

Both are taken when the response is closed (its last byte sent, or its client
gone), so a stream's line says how long the stream lasted. The counts are
kept in the process and written to Redis (shared by every web process, like
every other metric) by a thread of their own about once a second, and by
/metrics before it reads them: a request never waits for Redis to count it,
and a Redis that does not answer delays the counts, never a request. The
probes (/livez, /readyz, /healthz) are counted but logged at DEBUG: a
launcher or an orchestrator polls them all day.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from flask import Flask, Response, g, request

from jobs.store.telemetry import Telemetry, bucket_of
from web.requestid import request_id

__all__ = ["HttpCounts", "init_app"]

log = logging.getLogger("parkq.access")

#: The methods counted by name; any other counts as "other" (a client may send
#: any token as a method: the metrics' labels stay bounded).
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
#: Routes polled all day: their lines go to DEBUG.
PROBES = frozenset({"/livez", "/readyz", "/healthz"})
#: How often the counting thread writes, and how many idle rounds it waits
#: before it ends (it starts again with the next request).
FLUSH_SECONDS, IDLE_ROUNDS = 1.0, 30


class HttpCounts:
    """The process's HTTP counts not yet in Redis."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._buckets: Counter[str] = Counter()
        self._total_ms = 0.0
        self._thread: threading.Thread | None = None

    def add(self, counter: str, ms: float | None) -> None:
        with self._lock:
            self._counts[counter] += 1
            if ms is not None:
                self._buckets[bucket_of(ms)] += 1
                self._total_ms += ms
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-counts",
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def flush(self) -> None:
        """Write what was counted; on a failure keep it for the next time."""
        with self._lock:
            counts, buckets, total = self._counts, self._buckets, self._total_ms
            self._counts, self._buckets, self._total_ms = Counter(), Counter(), 0.0
        if not counts and not buckets:
            return
        try:
            self.telemetry.add_counts(dict(counts))
            counts = Counter()
            if buckets:
                self.telemetry.observe_many("http_ms", dict(buckets), total)
        except Exception:
            log.debug("HTTP metrics not written yet", exc_info=True)
            with self._lock:
                self._counts.update(counts)
                self._buckets.update(buckets)
                self._total_ms += total

    def _run(self) -> None:
        idle = 0
        while True:
            time.sleep(FLUSH_SECONDS)
            with self._lock:
                busy = bool(self._counts or self._buckets)
                if not busy:
                    idle += 1
                    if idle >= IDLE_ROUNDS:
                        self._thread = None
                        return
            if busy:
                idle = 0
                self.flush()


def _printable(text: str) -> str:
    """``text`` with control and non-ASCII characters escaped: a path with a
    line break in it cannot forge a log line."""
    return text.encode("unicode_escape").decode("ascii")


def init_app(app: Flask, telemetry: Telemetry, enabled: bool) -> HttpCounts:
    counts = HttpCounts(telemetry)

    @app.before_request
    def _start() -> None:
        g.access_t0 = time.perf_counter()

    @app.after_request
    def _log(response: Response) -> Response:
        t0 = g.get("access_t0", time.perf_counter())
        rid, method = request_id() or "-", _printable(request.method)
        path = _printable(request.path)
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        status, streamed = response.status_code, response.is_streamed
        addr = request.remote_addr or "-"
        level = logging.DEBUG if route in PROBES else logging.INFO

        def closed() -> None:
            ms = (time.perf_counter() - t0) * 1000
            if enabled:
                log.log(level, "%s %s %s %d %.1f ms%s [%s]", addr, method, path, status, ms,
                        " stream" if streamed else "", rid)  # fmt: skip
            counted = method if method in METHODS else "other"
            counts.add(f"http|{counted}|{route}|{status}", None if streamed else ms)

        response.call_on_close(closed)
        return response

    return counts
