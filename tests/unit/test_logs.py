"""Structured logs: one JSON object per line with PARKQ_LOG_FORMAT=json."""

from __future__ import annotations

import io
import json
import logging

from scheduler.settings import Settings
from tools.logs import configure_logging


def test_json_log_lines_carry_the_job_id(monkeypatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json")
        logging.getLogger("jobs.worker.loop").info("job %s: parked after %d tokens", "cmpl-1", 12)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    entry = json.loads(stream.getvalue().strip())
    assert entry["msg"] == "job cmpl-1: parked after 12 tokens"
    assert entry["level"] == "info" and entry["logger"] == "jobs.worker.loop"


def test_gunicorns_own_lines_follow_the_log_format(monkeypatch) -> None:
    from tools.serve import _Gunicorn

    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    settings = Settings(log_format="json", port=0)
    app = _Gunicorn(settings)
    logger = app.cfg.logger_class(app.cfg)
    logger.info("Listening at: %s", "http://127.0.0.1:0")
    entry = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert entry["logger"] == "gunicorn.error"
    assert entry["msg"] == "Listening at: http://127.0.0.1:0"
