"""`parkq bench --quick` as a smoke test: it produces a complete report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.report import MODES, OPTIONAL_MODES


@pytest.mark.timeout(600)
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
        timeout=580,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["bare_loop_tokens_per_s"] > 0
    # Greedy, and what the openai client sends when told nothing.
    assert set(report["arms"]) == {"greedy", "default"}
    for arm, r in report["arms"].items():
        assert r["sampling"] == arm
        sent = r["workload"]["sampling"]
        assert sent == ({"temperature": 0} if arm == "greedy" else {}), sent
        for mode in MODES:
            assert (mode in r) == (mode not in OPTIONAL_MODES), (arm, mode)
        for mode in ("parkq", "parkq_no_preempt", "peer", "idle"):
            ttft = r[mode]["short_ttft_ms"]
            assert ttft["n"] > 0 and ttft["p50"] is not None, (arm, mode)
        for mode in ("parkq", "parkq_no_preempt", "parkq_no_shorts", "peer"):
            assert r[mode]["aggregate_tokens_per_s"] > 0, (arm, mode)
            assert r[mode]["short_unanswered"] == 0, (arm, mode)
            assert report["timelines"][arm][mode]["long_tokens"], (arm, mode)
        assert set(r["ratios"]) >= {
            "ttft_busy_over_idle_p50",
            "ttft_no_preempt_over_preempt_p50",
            "throughput_preempt_over_no_preempt",
            "throughput_parkq_over_peer",
            "long_rate_over_bare_loop",
        }
        assert all(v is not None for v in r["ratios"].values()), arm
        png = (out / f"bench-{arm}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "ttft_no_preempt_over_preempt_p50" in run.stdout
    assert "sampling default" in run.stdout


def test_the_streams_benchmark_runs_and_reports_the_refusal(tmp_path: Path) -> None:
    """`python -m tools.bench.streams` at a small size: every stream opens, the
    one past the cap is refused with 503, and the slots come back."""
    out = tmp_path / "streams.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench.streams", "--streams", "16", "--hold", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["one_more"]["status"] == 503 and report["one_more"]["code"] == "server_busy"
    assert report["slots_back_after_close"] is True
    assert report["healthz_while_open"]["n"] > 0 and not report["probe_failures"]
    assert report["web_threads"] >= 16
