"""/openapi.json describes every route the app serves."""

from __future__ import annotations

import re

import fakeredis

from scheduler.settings import Settings
from tests.fakes import FakeVocab
from web.app import create_app
from web.openapi import UNDESCRIBED, spec


def test_every_route_of_the_app_is_described_and_nothing_else(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    app = create_app(settings, vocab=FakeVocab(), client=fake_redis)
    served = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    described = {(path, method) for path, ops in spec()["paths"].items() for method in ops}
    assert described == {(p, m) for p, m in served if p not in UNDESCRIBED}
    assert {p for p, _ in served} >= UNDESCRIBED  # each exception is a real route
