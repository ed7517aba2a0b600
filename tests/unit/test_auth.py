"""API keys on every route but the probes (/livez, /readyz, /healthz)."""

from __future__ import annotations

import time

import fakeredis
import pytest
from flask import Flask

from scheduler.settings import Settings, parse_keys
from tests.fakes import FakeVocab
from web.app import create_app


@pytest.fixture
def app(settings: Settings, fake_redis: fakeredis.FakeRedis) -> Flask:
    s = settings.model_copy(update={"api_keys": "key-one, key-two"})
    return create_app(s, vocab=FakeVocab(), client=fake_redis)


def _routes(app: Flask) -> list[tuple[str, str]]:
    out = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<job_id>", "some-job")
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):  # type: ignore[operator]
            out.append((method, path))
    return out


def test_every_route_but_the_probes_needs_a_valid_key(app: Flask) -> None:
    client = app.test_client()
    routes = _routes(app)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/healthz") in routes
    # Open: the probes, the dashboard page (it asks for a key) and its sign-in form.
    probes = {("GET", "/healthz"), ("GET", "/livez"), ("GET", "/readyz")}
    open_routes = {*probes, ("GET", "/"), ("POST", "/dashboard/login")}
    for method, path in routes:
        if (method, path) in open_routes:
            with client.open(path, method=method) as resp:
                assert resp.status_code != 401
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"}):
            resp = client.open(path, method=method, headers=headers, json={})
            assert resp.status_code == 401, (method, path, headers)
            assert resp.get_json()["error"]["type"] == "invalid_request_error"
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        for key in ("key-one", "key-two"):
            resp = client.open(
                path, method=method, headers={"Authorization": f"Bearer {key}"}, json={}
            )
            assert resp.status_code != 401, (method, path)


def test_without_keys_nothing_is_asked(settings: Settings, fake_redis) -> None:
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    assert client.get("/v1/models").status_code == 200


def test_dashboard_signs_in_with_a_cookie_never_a_url(app: Flask) -> None:
    client = app.test_client()
    assert client.get("/dashboard/state", headers={"X-Parkq-Dashboard": "1"}).status_code == 401
    bad = client.post("/dashboard/login", data={"key": "wrong"})
    assert bad.status_code == 303 and bad.headers["Location"].endswith("/?login=failed")
    good = client.post("/dashboard/login", data={"key": "key-two"})
    assert good.status_code == 303 and "key-two" not in good.headers["Location"]
    cookie = good.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "key-two" not in cookie
    assert client.get("/dashboard/state", headers={"X-Parkq-Dashboard": "1"}).status_code == 200
    # The cookie alone (a cross-site form could send it) is not enough.
    assert client.get("/dashboard/state").status_code == 401
    assert client.get("/v1/models", headers={"X-Parkq-Dashboard": "1"}).status_code == 200


def test_a_dashboard_session_expires_and_ends_when_the_keys_change(
    app: Flask, settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    from web.dashboard import COOKIE, SESSION_SECONDS, session_token

    client = app.test_client()
    good = client.post("/dashboard/login", data={"key": "key-one"})
    token = good.headers["Set-Cookie"].split(";")[0].split("=", 1)[1]
    assert f"Max-Age={SESSION_SECONDS}" in good.headers["Set-Cookie"]
    headers = {"X-Parkq-Dashboard": "1"}
    assert client.get("/dashboard/state", headers=headers).status_code == 200
    # An expired token, even correctly made, is refused.
    keys = parse_keys("key-one, key-two")
    stale = client.__class__(app)
    stale.set_cookie(COOKIE, session_token(keys[0], keys, int(time.time()) - 1))
    assert stale.get("/dashboard/state", headers=headers).status_code == 401
    # A server with another key set (key-two revoked) refuses the old session.
    rotated = create_app(
        settings.model_copy(update={"api_keys": "key-one, key-three"}),
        vocab=FakeVocab(),
        client=fake_redis,
    ).test_client()
    rotated.set_cookie(COOKIE, token)
    assert rotated.get("/dashboard/state", headers=headers).status_code == 401


def test_a_cookie_whose_expiry_is_not_ascii_digits_is_refused_not_a_500(app: Flask) -> None:
    """``"²".isdigit()`` is True and ``int("²")`` raises: the expiry is parsed strictly."""
    from web.dashboard import COOKIE

    headers = {"X-Parkq-Dashboard": "1"}
    for expiry in ("²", "١٢٣", "99999999999999999999999", "-1", "", " 1"):
        client = app.test_client()
        client.set_cookie(COOKIE, f"{expiry}.{'0' * 64}")
        resp = client.get("/dashboard/state", headers=headers)
        assert resp.status_code == 401, expiry


def test_a_burst_of_wrong_keys_is_limited_per_address(app: Flask) -> None:
    """Ten wrong keys a minute from one address; the eleventh attempt (right key or
    not) gets 429 with Retry-After; another address is not held back."""
    from web.dashboard import LOGIN_ATTEMPTS, LOGIN_WINDOW_SECONDS

    client = app.test_client()
    here = {"REMOTE_ADDR": "203.0.113.7"}
    for _ in range(LOGIN_ATTEMPTS):
        resp = client.post("/dashboard/login", data={"key": "wrong"}, environ_base=here)
        assert resp.status_code == 303
    for key in ("wrong", "key-one"):
        resp = client.post("/dashboard/login", data={"key": key}, environ_base=here)
        assert resp.status_code == 429
        assert 1 <= int(resp.headers["Retry-After"]) <= LOGIN_WINDOW_SECONDS
        assert resp.get_json()["error"]["code"] == "too_many_sign_ins"
    there = {"REMOTE_ADDR": "203.0.113.8"}
    resp = client.post("/dashboard/login", data={"key": "key-one"}, environ_base=there)
    assert resp.status_code == 303 and resp.headers["Location"] == "/"


def test_the_cookie_is_secure_over_https_and_behind_a_trusted_proxy(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    plain = create_app(settings.model_copy(update={"api_keys": "k"}), vocab=FakeVocab(),
                       client=fake_redis).test_client()  # fmt: skip
    assert "Secure" not in plain.post("/dashboard/login", data={"key": "k"}).headers["Set-Cookie"]
    https = plain.post("/dashboard/login", data={"key": "k"}, base_url="https://localhost")
    assert "Secure" in https.headers["Set-Cookie"]
    # A proxy's word is taken only when the deployment says it has one.
    forwarded = {"X-Forwarded-Proto": "https"}
    resp = plain.post("/dashboard/login", data={"key": "k"}, headers=forwarded)
    assert "Secure" not in resp.headers["Set-Cookie"]
    proxied = create_app(
        settings.model_copy(update={"api_keys": "k", "trusted_proxies": 1}),
        vocab=FakeVocab(),
        client=fake_redis,
    ).test_client()
    resp = proxied.post("/dashboard/login", data={"key": "k"}, headers=forwarded)
    assert "Secure" in resp.headers["Set-Cookie"]


def test_too_few_web_threads_for_the_streams_cap_lowers_the_cap(settings: Settings) -> None:
    """An old PARKQ_WEB_THREADS=64 beside the default PARKQ_MAX_STREAMS=512: the
    cap follows the threads, keeping 32 free (else streams would fill every
    thread and /healthz would wait, the 503 never sent)."""
    from web.app import stream_slots
    from web.slots import SPARE_THREADS

    assert stream_slots(settings) == settings.max_streams
    narrow = settings.model_copy(update={"web_threads": 64})
    assert stream_slots(narrow) == 64 - SPARE_THREADS
    wide = settings.model_copy(update={"web_threads": 2000, "max_streams": 100})
    assert stream_slots(wide) == 100


def test_a_sign_in_from_another_sites_page_is_refused(app: Flask) -> None:
    """Login CSRF: another site's page posting its own key would sign the visitor in
    to its tenant. The browser's own word (Sec-Fetch-Site), else Origin, else
    Referer, must name this server; a request with none of them (curl) passes."""
    client = app.test_client()
    refused = [
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site", "Origin": "http://localhost"},  # Fetch Metadata first
        {"Origin": "https://evil.example"},
        {"Origin": "null"},  # a sandboxed frame, a cross-site redirect
        {"Origin": "http://localhost:8080"},  # another port is another origin
        {"Origin": "http://localhost.evil.example"},
        {"Referer": "https://evil.example/page?x=1"},
        {"Referer": "not a url"},
    ]
    for headers in refused:
        resp = client.post("/dashboard/login", data={"key": "key-one"}, headers=headers)
        assert resp.status_code == 403, headers
        assert resp.get_json()["error"] == {
            "message": resp.get_json()["error"]["message"],
            "type": "invalid_request_error",
            "param": None,
            "code": "cross_site_sign_in",
        }
        assert "Set-Cookie" not in resp.headers
    allowed = [
        {},
        {"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"},
        {"Sec-Fetch-Site": "none"},  # typed by the user
        {"Origin": "http://localhost"},
        {"Origin": "http://LOCALHOST:80"},
        {"Referer": "http://localhost/?login=failed"},
    ]
    for headers in allowed:
        resp = client.post("/dashboard/login", data={"key": "key-one"}, headers=headers)
        assert resp.status_code == 303 and resp.headers["Location"] == "/", headers
        assert "Set-Cookie" in resp.headers


def test_a_refused_cross_site_sign_in_is_not_an_attempt(app: Flask) -> None:
    """Refused before the attempt counter: another site's page cannot lock a
    visitor's address out of signing in."""
    from web.dashboard import LOGIN_ATTEMPTS

    client = app.test_client()
    for _ in range(LOGIN_ATTEMPTS + 5):
        resp = client.post("/dashboard/login", data={"key": "wrong"},
                           headers={"Origin": "https://evil.example"})  # fmt: skip
        assert resp.status_code == 403
    assert client.post("/dashboard/login", data={"key": "key-one"}).status_code == 303


def test_a_sign_in_through_a_proxy_that_rewrites_host(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    """Behind a proxy the Host header may name the upstream: a browser with Fetch
    Metadata is judged by it alone; an older one's Origin may name the host the
    trusted proxy forwarded (X-Forwarded-Host), and only a trusted proxy's."""
    s = settings.model_copy(update={"api_keys": "k"})
    origin = {"Origin": "https://parkq.example", "X-Forwarded-Host": "parkq.example",
              "X-Forwarded-Proto": "https"}  # fmt: skip
    direct = create_app(s, vocab=FakeVocab(), client=fake_redis).test_client()
    resp = direct.post("/dashboard/login", data={"key": "k"}, headers=origin,
                       base_url="http://127.0.0.1:8000")  # fmt: skip
    assert resp.status_code == 403  # nobody vouches for the forwarded name
    fetch = {"Sec-Fetch-Site": "same-origin", "Origin": "https://parkq.example"}
    resp = direct.post("/dashboard/login", data={"key": "k"}, headers=fetch,
                       base_url="http://127.0.0.1:8000")  # fmt: skip
    assert resp.status_code == 303
    proxied = create_app(s.model_copy(update={"trusted_proxies": 1}), vocab=FakeVocab(),
                         client=fake_redis).test_client()  # fmt: skip
    resp = proxied.post("/dashboard/login", data={"key": "k"}, headers=origin,
                        base_url="http://127.0.0.1:8000")  # fmt: skip
    assert resp.status_code == 303 and "Secure" in resp.headers["Set-Cookie"]
