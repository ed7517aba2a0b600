"""API keys on every route but /healthz."""

from __future__ import annotations

import fakeredis
import pytest
from flask import Flask

from scheduler.settings import Settings
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


def test_every_route_but_healthz_needs_a_valid_key(app: Flask) -> None:
    client = app.test_client()
    routes = _routes(app)
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/healthz") in routes
    for method, path in routes:
        if path == "/healthz":
            assert client.open(path, method=method).status_code != 401
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
