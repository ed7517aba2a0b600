"""`parkq --version`, the package's version and its pins (issue 37: upgrades)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PARKQ = Path(sys.executable).parent / "parkq"


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def test_parkq_version_names_parkq_and_the_engine_it_runs() -> None:
    run = subprocess.run([str(PARKQ), "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    engine = version("llama_cpp_python")
    assert run.stdout == f"parkq {_project()['version']} (llama-cpp-python {engine})\n"


def test_the_changelog_dates_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(str(_project()['version']))} \(\d{{4}}-\d\d-\d\d\)$",
                     text, flags=re.M)  # fmt: skip


def test_the_engine_is_pinned_exactly_and_numpy_below_its_next_major() -> None:
    deps = {r.name: r for r in map(Requirement, _project()["dependencies"])}
    pins = [s for s in deps["llama-cpp-python"].specifier if s.operator == "=="]
    assert pins, "llama-cpp-python is pinned"
    # The installed one is that release (parkq's patched build of it included).
    assert deps["llama-cpp-python"].specifier.contains(version("llama_cpp_python"))
    assert any(s.operator == "<" for s in deps["numpy"].specifier)
    assert deps["numpy"].specifier.contains(version("numpy"))
