"""API keys: `Authorization: Bearer <key>` on every route but the probes; the key
decides the caller's tenant (web/tenants.py)."""

from __future__ import annotations

import hmac
import time

from flask import Flask, g, request

from scheduler.settings import ApiKey
from web.dashboard import COOKIE, HEADER, session_key
from web.errors import Unauthorized
from web.tenants import NOBODY, caller_of

__all__ = ["init_app"]

#: Endpoints anyone may call: the probes (/livez; /readyz and /healthz, one
#: endpoint), and the dashboard page and its sign-in.
OPEN_ENDPOINTS = frozenset(
    {"api.healthz", "api.livez", "dashboard.page", "dashboard.login", "static"}
)


def _match(given: str, keys: tuple[ApiKey, ...]) -> ApiKey | None:
    token = given.encode()
    # Compare with every key, in constant time each, whatever matches first.
    found: ApiKey | None = None
    for key in keys:
        if hmac.compare_digest(token, key.secret.encode()) and found is None:
            found = key
    return found


def init_app(app: Flask, keys: tuple[ApiKey, ...]) -> None:
    if not keys:
        return  # one tenant, and everyone is it (web/tenants.py: OPEN)

    @app.before_request
    def _require_key() -> None:
        g.parkq_caller = NOBODY
        if request.endpoint in OPEN_ENDPOINTS:
            return
        cookie = request.cookies.get(COOKIE)
        if cookie and request.headers.get(HEADER):
            # The dashboard, signed in (the header rules out cross-site forms).
            key = session_key(cookie, keys, time.time())
            if key is not None:
                g.parkq_caller = caller_of(key)
                return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized(
                "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        key = _match(token.strip(), keys)
        if key is None:
            raise Unauthorized("Invalid API key.")
        g.parkq_caller = caller_of(key)
