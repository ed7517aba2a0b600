"""The commands that print their own report (demo, bench, batch, soak) quiet
the stack's logs to WARNING unless PARKQ_LOG_LEVEL says otherwise."""

from __future__ import annotations

import pytest

from scheduler.settings import load_settings
from tools.cli import _quiet


def test_the_reports_quiet_the_logs_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARKQ_LOG_LEVEL", raising=False)
    assert load_settings(log_level=_quiet()).log_level == "WARNING"


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "ERROR"])
def test_parkq_log_level_is_honoured(monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    monkeypatch.setenv("PARKQ_LOG_LEVEL", level)
    assert load_settings(log_level=_quiet()).log_level == level
