"""Every response's ``x-request-id``, and the same id on the web's log lines
of that request.

The id is the client's own ``X-Request-Id`` where it sent a usable one (a
proxy's, to follow one request through both logs), else ``req_`` and 32 hex
digits.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from flask import Flask, Response, g, has_request_context, request

__all__ = ["init_app", "request_id"]

#: A client's id that is taken as it is; any other is replaced.
_USABLE = re.compile(r"[A-Za-z0-9._:-]{1,128}", re.ASCII)


def request_id() -> str | None:
    """The current request's id (None outside a request)."""
    return g.get("request_id") if has_request_context() else None


_installed = False


def _tag_records() -> None:
    """Put the request's id in front of every message logged in this process
    while a request is handled (any logger: the app's, ``web.sse``'s...), by
    wrapping the log record factory once."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def tagged(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        rid = request_id()
        if rid and isinstance(record.msg, str):
            # (The message, not an attribute: a caller's extra={"request_id": ...}
            # must not collide with it.)
            record.msg = f"[{rid}] {record.msg}"
        return record

    logging.setLogRecordFactory(tagged)


def init_app(app: Flask) -> None:
    """Register first: a request refused before the route (a 401) has an id too."""

    @app.before_request
    def _take() -> None:
        given = request.headers.get("X-Request-Id", "")
        g.request_id = given if _USABLE.fullmatch(given) else f"req_{secrets.token_hex(16)}"

    @app.after_request
    def _give(response: Response) -> Response:
        rid = request_id()
        if rid:
            response.headers["x-request-id"] = rid
        from web.intake import CLAMPED_HEADER, clamped

        said = clamped()
        if said:
            response.headers[CLAMPED_HEADER] = said
        return response

    _tag_records()
