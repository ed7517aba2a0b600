"""`parkq bench --quick` as a smoke test: it produces a complete report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.report import MODES, OPTIONAL_MODES


@pytest.mark.timeout(300)
def test_quick_bench_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cli",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--peer-server",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "bench.json").read_text())
    for mode in MODES:
        assert (mode in report) == (mode not in OPTIONAL_MODES), mode
    for mode in ("parkq", "parkq_no_preempt", "peer", "idle"):
        ttft = report[mode]["short_ttft_ms"]
        assert ttft["n"] > 0 and ttft["p50"] is not None, mode
    for mode in ("parkq", "parkq_no_preempt", "parkq_no_shorts", "peer"):
        assert report[mode]["aggregate_tokens_per_s"] > 0, mode
        assert report["timelines"][mode]["long_tokens"], mode
    assert report["bare_loop_tokens_per_s"] > 0
    assert set(report["ratios"]) >= {
        "ttft_busy_over_idle_p50",
        "ttft_no_preempt_over_preempt_p50",
        "throughput_preempt_over_no_preempt",
        "throughput_parkq_over_peer",
        "long_rate_over_bare_loop",
    }
    assert all(v is not None for v in report["ratios"].values())
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "ttft_no_preempt_over_preempt_p50" in run.stdout
