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
from web.runtime import Runtime

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


def _rt() -> Runtime:
    runtime: Runtime = current_app.extensions["parkq"]
    return runtime


@bp.get("/")
def page() -> Any:
    return current_app.send_static_file("dashboard.html")


@bp.post("/dashboard/login")
def login() -> Any:
    key = request.form.get("key", "")
    keys = _rt().settings.api_key_list
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
    store = _rt().store
    keys, r = store.keys, store.r
    now = time.time()
    waiting = [x.decode() for x in r.zrange(keys.queue, 0, 199)]
    alive = store.workers_alive(now)
    with r.pipeline(transaction=False) as p:
        for job_id in waiting:
            p.hmget(keys.job(job_id), "priority", "state", "enqueued_at", "tokens", "kind")
        for w in alive:
            p.hmget(keys.worker(w), "job", "checkpoint_bytes", "rss_bytes")
        rows = p.execute()
    queue = []
    for job_id, (level, st, enq, tokens, kind) in zip(waiting, rows, strict=False):
        queue.append({
            "id": job_id,
            "priority": priority_label(int(level or 0)),
            "state": (st or b"").decode(),
            "age": round(now - float(enq or now), 1),
            "tokens": int(tokens or 0),
            "kind": (kind or b"").decode(),
        })  # fmt: skip
    workers = []
    for w, (job, held, rss) in zip(alive, rows[len(waiting) :], strict=False):
        entry: dict[str, Any] = {
            "name": w,
            "checkpoint_bytes": int(held or 0),
            "rss_bytes": int(rss or 0),
            "job": None,
        }
        if job:
            rec = store.get(job.decode()) or {}
            entry["job"] = {
                "id": job.decode(),
                "priority": priority_label(int(rec.get("priority", "0"))),
                "tokens": int(rec.get("tokens", "0")),
                "state": rec.get("state"),
            }
        workers.append(entry)
    return jsonify({
        "now": now,
        "model": _rt().model_name,
        "queue": queue,
        "workers": workers,
        "preemptions": store.recent_preemptions(30),
    })  # fmt: skip
