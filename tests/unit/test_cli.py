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


def test_bench_without_its_extra_says_so_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import util

    from click.testing import CliRunner

    from tools.cli import main

    found = util.find_spec

    def without_matplotlib(name: str, *rest: str | None) -> object:
        return None if name == "matplotlib" else found(name, *rest)

    monkeypatch.setattr(util, "find_spec", without_matplotlib)
    run = CliRunner().invoke(main, ["bench", "--quick"])
    assert run.exit_code == 1
    assert "parkq bench needs the [bench] extra (matplotlib missing)" in run.output


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        (
            "PARKQ_MODEL",
            "$PARKQ_TEST_UNSET_DIR/m.gguf",
            "names $PARKQ_TEST_UNSET_DIR, which is not set",
        ),
        ("PARKQ_N_CTX", "abc", "Input should be a valid integer"),
    ],
)
def test_a_wrong_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, says: str
) -> None:
    from click.testing import CliRunner

    from tools.cli import main

    monkeypatch.delenv("PARKQ_TEST_UNSET_DIR", raising=False)
    monkeypatch.setenv(name, value)
    run = CliRunner().invoke(main, ["up"])
    assert run.exit_code == 1
    lines = run.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {name}: ")
    assert says in run.output
