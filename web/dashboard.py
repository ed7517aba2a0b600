"""The dashboard page at `/`: live queue, workers, parked jobs, preemptions, chat.

With API keys set, the browser signs in once with a key (a form POST); the
server answers with an HttpOnly, SameSite=Strict session cookie, so the key
never appears in a URL. Requests authenticated by that cookie must also carry
the header `X-Parkq-Dashboard` (a cross-site form cannot set it).

The sign-in itself needs no cookie, so SameSite cannot guard it: another site's
page could post its own key and sign a visitor in to its tenant (login CSRF).
A sign-in a browser sends from another site is refused (:func:`cross_site`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

from flask import Blueprint, Response, current_app, jsonify, redirect, request

from scheduler.policy import priority_label
from scheduler.settings import ApiKey
from web.errors import APIError, TooManyRequests
from web.runtime import current
from web.tenants import caller, label_of, sees
from web.usage import hourly

__all__ = [
    "COOKIE",
    "HEADER",
    "LOGIN_ATTEMPTS",
    "LOGIN_WINDOW_SECONDS",
    "SESSION_SECONDS",
    "CrossSiteSignIn",
    "bp",
    "cross_site",
    "session_key",
    "session_token",
]

bp = Blueprint("dashboard", __name__)

COOKIE = "parkq_session"
HEADER = "X-Parkq-Dashboard"


#: How long a dashboard sign-in lasts.
SESSION_SECONDS = 12 * 3600
#: Failed sign-ins one client address may make in LOGIN_WINDOW_SECONDS; past
#: them it gets 429 with Retry-After until the window ends.
LOGIN_ATTEMPTS = 10
LOGIN_WINDOW_SECONDS = 60

#: A cookie's expiry: ASCII digits only (``str.isdigit`` also takes ``²``,
#: which ``int`` then refuses).
_EXPIRY = re.compile(r"[0-9]{1,15}")


class CrossSiteSignIn(APIError):
    status = 403
    type = "invalid_request_error"
    code = "cross_site_sign_in"


class _Headers(Protocol):
    def get(self, key: str) -> str | None: ...


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _site(url: str) -> str | None:
    """``host:port`` of an absolute http(s) URL (the default port spelled out);
    None for anything else (``null``, another scheme, no host)."""
    try:
        parts = urlsplit(url)
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or port is None:
        return None
    return f"{parts.hostname}:{port}"


def cross_site(headers: _Headers, scheme: str, hosts: list[str]) -> bool:
    """Whether a browser sent this request from another site's page.

    Fetch Metadata first: ``Sec-Fetch-Site`` is set by the browser alone (a page
    cannot forge it) and, unlike Origin, needs no idea of this server's own
    name, which a proxy may have rewritten. Browsers without it (Safari before
    16.4) send ``Origin`` on every POST, or at least ``Referer``: its host must
    be one of ``hosts`` (the Host header, and the trusted proxy's
    X-Forwarded-Host), on ``scheme``'s default port unless it names one. A
    request with none of the three is no browser's cross-site form (curl, a
    script): it passes.
    """
    fetch_site = headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site.strip().lower() not in ("same-origin", "none")
    source = headers.get("Origin") or headers.get("Referer")
    if source is None:
        return False
    own = {_site(f"{scheme}://{host.strip()}") for host in hosts if host.strip()}
    site = _site(source.strip())
    return site is None or site not in own


def _own_hosts() -> list[str]:
    """The names this server is reached by: Host, and the X-Forwarded-Host that
    the outermost trusted proxy wrote (PARKQ_TRUSTED_PROXIES)."""
    hosts = [request.host]
    trusted = current().settings.trusted_proxies
    forwarded = [h for h in request.headers.get("X-Forwarded-Host", "").split(",") if h.strip()]
    if trusted and len(forwarded) >= trusted:
        hosts.append(forwarded[-trusted])
    return hosts


def _keyring(keys: tuple[ApiKey, ...]) -> bytes:
    """A digest of the whole key set: changing any key (or its name or role) ends
    every session."""
    entries = sorted(f"{k.admin:d}:{k.name}:{k.secret}" for k in keys)
    return hashlib.sha256("\n".join(entries).encode()).digest()


def session_token(key: ApiKey, keys: tuple[ApiKey, ...], expires: int) -> str:
    """The cookie value for a sign-in with ``key``: ``<expiry>.<keyed hash>``, never
    the key itself; it names its expiry and is bound to the current key set."""
    msg = b"parkq dashboard session|%d|" % expires + _keyring(keys)
    return f"{expires}.{hmac.new(key.secret.encode(), msg, hashlib.sha256).hexdigest()}"


def session_key(token: str, keys: tuple[ApiKey, ...], now: float) -> ApiKey | None:
    """The key ``token`` is an unexpired sign-in with; None if it is none."""
    expires_text, _, _ = token.partition(".")
    if not _EXPIRY.fullmatch(expires_text) or int(expires_text) < now:
        return None
    expires = int(expires_text)
    found: ApiKey | None = None
    for key in keys:  # every key, in constant time each
        if hmac.compare_digest(token.encode(), session_token(key, keys, expires).encode()):
            found = found or key
    return found


@bp.get("/")
def page() -> Any:
    return current_app.send_static_file("dashboard.html")


@bp.post("/dashboard/login")
def login() -> Any:
    """Sign in with a key. A client address gets LOGIN_ATTEMPTS wrong keys a
    minute; then 429 with Retry-After. The cookie is ``Secure`` when the page
    came over HTTPS (or through a trusted proxy that says so:
    PARKQ_TRUSTED_PROXIES). A browser's sign-in from another site's page gets
    403 (:func:`cross_site`), before it counts as an attempt."""
    if cross_site(request.headers, request.scheme, _own_hosts()):
        raise CrossSiteSignIn(
            "A sign-in from another site's page is refused: sign in from this server's "
            "dashboard page."
        )
    runtime = current()
    r, counter = runtime.store.r, runtime.settings.keys.login_failures(request.remote_addr or "-")
    # Every attempt takes its place first (parallel guesses cannot all pass a
    # read-then-write check); a right key gives its place back.
    # (SET NX EX, then INCR, which keeps the TTL: Redis 6.2 has no EXPIRE NX.)
    with r.pipeline() as p:
        p.set(counter, 0, ex=LOGIN_WINDOW_SECONDS, nx=True)
        p.incr(counter)
        attempts = int(p.execute()[1])
    if attempts > LOGIN_ATTEMPTS:
        wait = max(1, int(r.ttl(counter)))
        raise TooManyRequests(
            f"Too many failed sign-ins from this address; retry in {wait} s.",
            retry_after=wait,
            code="too_many_sign_ins",
        )
    given = request.form.get("key", "")
    keys = runtime.settings.api_key_entries
    match: ApiKey | None = None
    for key in keys:  # every key, in constant time each
        if hmac.compare_digest(given.encode(), key.secret.encode()):
            match = match or key
    if match is None:
        return redirect("/?login=failed", code=303)
    r.decr(counter)
    resp = redirect("/", code=303)
    expires = int(time.time()) + SESSION_SECONDS
    resp.set_cookie(
        COOKIE,
        session_token(match, keys, expires),
        httponly=True,
        secure=request.is_secure,
        samesite="Strict",
        max_age=SESSION_SECONDS,
    )
    return resp


@bp.get("/dashboard/state")
def state() -> Response:
    """Everything the page shows, in one snapshot. Another tenant's jobs show
    without their ids (``id`` null): how busy the server is, not what others run."""
    store = current().store
    telemetry = store.telemetry
    now = time.time()
    waiting = telemetry.waiting(200)
    rows = telemetry.job_rows(waiting, "priority", "state", "enqueued_at", "tokens", "kind",
                              "owner")  # fmt: skip
    queue = [
        {
            "id": job_id if sees(row["owner"]) else None,
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
                "id": job if sees(rec.get("owner")) else None,
                "priority": priority_label(int(rec.get("priority", "0"))),
                "tokens": int(rec.get("tokens", "0")),
                "state": rec.get("state"),
            }
        workers.append(entry)
    preemptions = telemetry.recent_preemptions(30)
    if not caller().admin:
        owners = telemetry.job_rows([p["job"] for p in preemptions], "owner")
        for entry, row in zip(preemptions, owners, strict=True):
            if not sees(row["owner"]):
                entry["job"] = None
    return jsonify({
        "now": now,
        "model": current().model_name,
        "queue": queue,
        "workers": workers,
        "preemptions": preemptions,
        "tenants": _tenant_shares(now),
    })  # fmt: skip


def _tenant_shares(now: float) -> list[dict[str, Any]]:
    """Each tenant's tokens (prompt and completion of finished jobs) in the last
    hour and the last 24 hours, and its share of the day's, largest first: by
    name (another tenant's unnamed key shows as another key, not by its id)."""
    runtime = current()
    hour = int(now // 3600) * 3600
    day: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, row in enumerate(hourly([hour - 3600 * i for i in range(24)])):
        for tenant, used in row.items():
            tokens = used.get("prompt", 0) + used.get("completion", 0)
            if tokens:
                day[tenant] = day.get(tenant, 0) + tokens
            if i == 0 and tokens:
                last[tenant] = last.get(tenant, 0) + tokens
    total = sum(day.values()) or 1
    keys = runtime.settings.api_key_entries
    out = []
    for tenant, tokens in sorted(day.items(), key=lambda kv: -kv[1]):
        name = label_of(keys, tenant) or "everyone"
        if not sees(tenant) and name.startswith(("key-", "tenant-")):
            name = "another key"
        out.append({"name": name, "tokens_hour": last.get(tenant, 0), "tokens_day": tokens,
                    "share": round(100 * tokens / total, 1)})  # fmt: skip
    return out
