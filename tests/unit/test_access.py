"""The access log and the HTTP request metrics (web/access.py), on fakeredis
with the real app. Against `parkq up`: tests/integration/test_cli.py."""

from __future__ import annotations

import logging
import time

import fakeredis
import pytest

from scheduler.settings import Settings
from tests.fakes import FakeVocab
from web.app import create_app


@pytest.mark.parametrize("on", [True, False])
def test_one_line_a_request_unless_turned_off_and_counted_either_way(
    settings: Settings, caplog: pytest.LogCaptureFixture, on: bool
) -> None:
    app = create_app(settings.model_copy(update={"access_log": on}), vocab=FakeVocab(),
                     client=fakeredis.FakeRedis())  # fmt: skip
    client = app.test_client()
    with caplog.at_level(logging.DEBUG, logger="parkq.access"):
        for path in ("/livez", "/v1/jobs/nope", "/no-such-route"):
            client.get(path, headers={"X-Request-Id": f"id{path.replace('/', '-')}"}).close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "parkq.access" and "[id" in r.getMessage()]  # fmt: skip
    if on:
        # The probe's line at DEBUG (polled all day), the others at INFO.
        assert [(level, line.split()[1:4]) for level, line in lines] == [
            (logging.DEBUG, ["GET", "/livez", "200"]),
            (logging.INFO, ["GET", "/v1/jobs/nope", "404"]),
            (logging.INFO, ["GET", "/no-such-route", "404"]),
        ]  # fmt: skip
        assert lines[1][1].endswith("[id-v1-jobs-nope]")
    else:
        assert lines == []
    page = client.get("/metrics").text
    assert 'parkq_http_requests_total{method="GET",route="/livez",status="200"} 1.0' in page
    assert 'route="/v1/jobs/<job_id>",status="404"} 1.0' in page
    assert 'route="unmatched",status="404"} 1.0' in page
    assert "parkq_http_request_duration_seconds_count 3.0" in page


def test_an_odd_method_counts_as_other(settings: Settings) -> None:
    app = create_app(settings, vocab=FakeVocab(), client=fakeredis.FakeRedis())
    client = app.test_client()
    for i in range(3):
        client.open("/no-such-route", method=f"BREW{i}").close()
    page = client.get("/metrics").text
    assert 'parkq_http_requests_total{method="other",route="unmatched",status="404"} 3.0' in page
    assert "BREW" not in page


def test_a_path_cannot_forge_a_log_line(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(settings, vocab=FakeVocab(), client=fakeredis.FakeRedis())
    with caplog.at_level(logging.INFO, logger="parkq.access"):
        app.test_client().get("/x%0A127.0.0.1 GET /admin 200").close()
    lines = [r.getMessage() for r in caplog.records if r.name == "parkq.access"]
    assert len(lines) == 1 and "\n" not in lines[0] and "/x\\n127.0.0.1" in lines[0]


def test_counting_never_waits_for_redis(settings: Settings) -> None:
    """Redis stops answering: requests are answered as fast as before, their
    counts wait in the process and reach Redis once it answers again."""
    server = fakeredis.FakeServer()
    app = create_app(settings, vocab=FakeVocab(), client=fakeredis.FakeRedis(server=server))
    client = app.test_client()
    server.connected = False  # (fakeredis: every call now raises ConnectionError)
    try:
        t0 = time.perf_counter()
        for _ in range(20):
            client.get("/livez").close()
        assert time.perf_counter() - t0 < 5
        app.extensions["parkq.http"].flush()  # fails, keeps the counts
    finally:
        server.connected = True
    page = client.get("/metrics").text
    assert 'parkq_http_requests_total{method="GET",route="/livez",status="200"} 20.0' in page
