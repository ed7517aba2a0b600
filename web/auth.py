"""API keys: `Authorization: Bearer <key>` on every route but /healthz."""

from __future__ import annotations

import hmac
import time

from flask import Flask, request

from web.dashboard import COOKIE, HEADER, session_valid
from web.errors import Unauthorized

__all__ = ["init_app"]

#: Endpoints anyone may call: liveness, and the dashboard page and its sign-in.
OPEN_ENDPOINTS = frozenset({"api.healthz", "dashboard.page", "dashboard.login", "static"})


def _valid(given: str, keys: tuple[bytes, ...]) -> bool:
    token = given.encode()
    # Compare with every key, in constant time each, whatever matches first.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


def init_app(app: Flask, keys: tuple[str, ...]) -> None:
    if not keys:
        return
    encoded = tuple(k.encode() for k in keys)

    @app.before_request
    def _require_key() -> None:
        if request.endpoint in OPEN_ENDPOINTS:
            return
        cookie = request.cookies.get(COOKIE)
        if cookie and request.headers.get(HEADER) and session_valid(cookie, keys, time.time()):
            return  # the dashboard, signed in (the header rules out cross-site forms)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        if not _valid(token.strip(), encoded):
            raise Unauthorized("Invalid API key.")
