"""The dashboard page at `/`: live queue, workers, parked jobs, preemptions, chat.

With API keys set, the browser signs in once with a key (a form POST); the
server answers with an HttpOnly, SameSite=Strict session cookie, so the key
never appears in a URL. Requests authenticated by that cookie must also carry
the header `X-Parkq-Dashboard` (a cross-site form cannot set it).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, redirect, request

from scheduler.policy import priority_label
from web.runtime import current

__all__ = ["COOKIE", "HEADER", "SESSION_SECONDS", "bp", "session_token", "session_valid"]

bp = Blueprint("dashboard", __name__)

COOKIE = "parkq_session"
HEADER = "X-Parkq-Dashboard"


#: How long a dashboard sign-in lasts.
SESSION_SECONDS = 12 * 3600


def _keyring(keys: tuple[str, ...]) -> bytes:
    """A digest of the whole key set: changing any key ends every session."""
    return hashlib.sha256("\n".join(sorted(keys)).encode()).digest()


def session_token(key: str, keys: tuple[str, ...], expires: int) -> str:
    """The cookie value for a sign-in with ``key``: ``<expiry>.<keyed hash>``, never
    the key itself; it names its expiry and is bound to the current key set."""
    msg = b"parkq dashboard session|%d|" % expires + _keyring(keys)
    return f"{expires}.{hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()}"


def session_valid(token: str, keys: tuple[str, ...], now: float) -> bool:
    """Whether ``token`` is an unexpired sign-in with one of ``keys``."""
    expires_text, _, _ = token.partition(".")
    if not expires_text.isdigit() or int(expires_text) < now:
        return False
    expires = int(expires_text)
    found = False
    for key in keys:  # every key, in constant time each
        found |= hmac.compare_digest(token.encode(), session_token(key, keys, expires).encode())
    return found


@bp.get("/")
def page() -> Any:
    return current_app.send_static_file("dashboard.html")


@bp.post("/dashboard/login")
def login() -> Any:
    key = request.form.get("key", "")
    keys = current().settings.api_key_list
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        return redirect("/?login=failed", code=303)
    resp = redirect("/", code=303)
    expires = int(time.time()) + SESSION_SECONDS
    resp.set_cookie(
        COOKIE,
        session_token(key, keys, expires),
        httponly=True,
        samesite="Strict",
        max_age=SESSION_SECONDS,
    )
    return resp


@bp.get("/dashboard/state")
def state() -> Response:
    """Everything the page shows, in one snapshot."""
    store = current().store
    telemetry = store.telemetry
    now = time.time()
    waiting = telemetry.waiting(200)
    rows = telemetry.job_rows(waiting, "priority", "state", "enqueued_at", "tokens", "kind")
    queue = [
        {
            "id": job_id,
            "priority": priority_label(int(row["priority"] or 0)),
            "state": row["state"] or "",
            "age": round(now - float(row["enqueued_at"] or now), 1),
            "tokens": int(row["tokens"] or 0),
            "kind": row["kind"] or "",
        }
        for job_id, row in zip(waiting, rows, strict=True)
    ]
    alive = store.workers.alive(now)
    workers = []
    for w, row in zip(alive, telemetry.worker_rows(alive, "job", "checkpoint_bytes", "rss_bytes"),
                      strict=True):  # fmt: skip
        entry: dict[str, Any] = {
            "name": w,
            "checkpoint_bytes": int(row["checkpoint_bytes"] or 0),
            "rss_bytes": int(row["rss_bytes"] or 0),
            "job": None,
        }
        if job := row["job"]:
            rec = store.get(job) or {}
            entry["job"] = {
                "id": job,
                "priority": priority_label(int(rec.get("priority", "0"))),
                "tokens": int(rec.get("tokens", "0")),
                "state": rec.get("state"),
            }
        workers.append(entry)
    return jsonify({
        "now": now,
        "model": current().model_name,
        "queue": queue,
        "workers": workers,
        "preemptions": store.telemetry.recent_preemptions(30),
    })  # fmt: skip
