"""`parkq soak`, short: a mixed workload on its own stack, nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_a_short_soak_loses_nothing(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cli",
            "soak",
            "--duration",
            "20s",
            "--model",
            str(tiny_model),
            "--tiny",
            "--rate",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PARKQ_LOG_LEVEL": "WARNING"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["unexpected_errors"] == 0 and report["lost"] == 0
    assert (
        report["requests"]
        == report["completions"] + report["cancellations"] + report["refused_429"]
    )
    assert report["completions"] > 10 and report["preemptions"] > 0
    assert report["ttft_ms"]["interactive"]["n"] > 0
    assert report["worker_rss_start"] > 0 and report["worker_rss_end"] > 0
    for label in ("requests", "completions", "preemptions", "unexpected errors", "result"):
        assert label in run.stdout


@pytest.mark.timeout(300)
def test_a_soak_that_exercised_nothing_says_so(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.cli", "soak", "--duration", "3s", "--model",
         str(tiny_model), "--tiny", "--rate", "0.01", "--batch-clients", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PARKQ_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and "nothing was parked" in report["unexercised"]
    assert "INCONCLUSIVE" in run.stdout and "OK" not in run.stdout.splitlines()[-1]
    assert "inconclusive: " in run.stderr and "nothing was parked" in run.stderr
