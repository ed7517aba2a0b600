"""One access-log line per HTTP request, with its request id, and the HTTP
request metrics (``parkq_http_requests_total``, by method, route and status;
``parkq_http_request_duration_seconds``, of the responses that are not
streams: a stream's duration is its generation's).

Both are taken when the response is closed (its last byte sent, or its client
gone), so a stream's line says how long the stream lasted; the counters go to
Redis like every other metric (shared by every web process), and a Redis that
does not answer loses the count, never the request.
"""

from __future__ import annotations

import logging
import time

from flask import Flask, Response, g, request

from web.requestid import request_id

__all__ = ["init_app"]

log = logging.getLogger("parkq.access")

#: The methods counted by name; any other counts as "other" (a client may send
#: any token as a method: the metrics' labels stay bounded).
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


def _printable(text: str) -> str:
    """``text`` with control and non-ASCII characters escaped: a path with a
    line break in it cannot forge a log line."""
    return text.encode("unicode_escape").decode("ascii")


def init_app(app: Flask, enabled: bool) -> None:
    from web.runtime import current

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
        telemetry = current().store.telemetry

        def closed() -> None:
            ms = (time.perf_counter() - t0) * 1000
            if enabled:
                log.info("%s %s %s %d %.1f ms%s [%s]", addr, method, path, status, ms,
                         " stream" if streamed else "", rid)  # fmt: skip
            try:
                counted = method if method in METHODS else "other"
                telemetry.count(f"http|{counted}|{route}|{status}")
                if not streamed:
                    telemetry.observe("http_ms", ms)
            except Exception:  # (a metric lost to a Redis blip: the response stands)
                log.debug("HTTP metrics not written", exc_info=True)

        response.call_on_close(closed)
        return response
