"""The GPU check's dry run on the CPU (what CI runs, so the check cannot rot
between the sessions that have a GPU), and the engine's device settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.engine.kernels import invariant_batch_size
from jobs.engine.llama import LlamaEngine, device_key, gpu_layers
from scheduler.settings import load_settings

ROOT = Path(__file__).parents[2]


# The time limit is a cap, not a target: a slow or busy machine must not skip a section.
@pytest.mark.timeout(900)
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tools.bench.gpu", "--cpu", "--out", str(out),
           "--seconds", "600", "--clients", "1,2", "--mixed-seconds", "4",
           "--work", str(tmp_path / "work")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads((out / "gpu-check.json").read_text())
    for section in ("environment", "models", "opcheck", "probe", "park", "step", "concurrency",
                    "mixed", "exactness"):  # fmt: skip
        assert "error" not in r[section] and "skipped" not in r[section], (section, r[section])
    for quant in ("q8_0", "q4_0"):
        ops = r["opcheck"][quant]
        assert ops["device"].startswith("CPU") and ops["widths"] == 4 and ops["n_ctx"] == 4096
        assert any(op["name"].startswith("attention") for op in ops["ops"])
        assert f"Per-op check, {quant}" in (out / "gpu-check.md").read_text()
        probe = r["probe"][quant]
        assert probe["device"] == "CPU"
        assert set(probe["sizes"]) == {"1", "2", "3", "4"}
        assert probe["sizes"]["1"] == "identical"  # a step that does not repeat is an error
        assert probe["positions_checked"] > 400
        assert 1 <= probe["worker_takes"] <= 4
    for positions in ("500", "4000"):
        assert r["park"][positions]["next_logits_identical"], r["park"]
    arms = {(row["system"], row["max_seqs"], row["sampling"]) for row in r["concurrency"]["rows"]}
    assert arms == {
        (system, seqs, sampling)
        for system, seqs in (("parkq", 1), ("parkq", "default"), ("parkq inexact", "default"))
        for sampling in ("greedy", "default")
    }
    assert all(row["tokens"] == 16 * row["clients"] for row in r["concurrency"]["rows"])
    # Paired: each cell's burst goes to every stack in turn, the next cell's in the reverse order.
    order = [(row["system"], row["max_seqs"]) for row in r["concurrency"]["rows"]]
    assert order[:3] == [("parkq", "default"), ("parkq inexact", "default"), ("parkq", 1)]
    assert order[3:6] == order[2::-1]
    assert r["mixed"]["parkq_greedy"]["short_unanswered"] == 0
    assert r["mixed"]["parkq_default"]["short_requests"] > 0
    assert r["exactness"]["returncode"] == 0, r["exactness"]
    assert "# parkq GPU check" in (out / "gpu-check.md").read_text()


@pytest.mark.timeout(900)
def test_the_trimmed_llama_cpp_source_configures(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    for action in (["source"], ["build", "--cpu"]):
        done = subprocess.run(
            [sys.executable, "-m", "tools.bench.gpu_kit", *action, "--kit", str(kit)],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    assert "configures" in done.stderr


def test_gpu_layers_default_to_all_only_where_llama_cpp_can_offload(tiny_model: Path) -> None:
    # This build has no GPU backend: unset and -1 mean none, a number is kept.
    assert gpu_layers(None) == 0
    assert gpu_layers(-1) == 0
    assert gpu_layers(7) == 7
    assert load_settings(n_gpu_layers=-1).n_gpu_layers == -1
    with pytest.raises(ValueError):
        load_settings(n_gpu_layers=-2)
    engine = LlamaEngine(str(tiny_model), n_ctx=256, n_gpu_layers=None)
    assert engine.device == "CPU"
    assert "on the CPU" in engine.placement()
    engine.close()


def test_a_batching_verdict_is_not_reused_on_another_device(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path)
    engine = LlamaEngine(str(tiny_model), n_ctx=512, n_seq_max=2)
    assert invariant_batch_size(engine, 2, cache)[1].startswith("checked")
    assert invariant_batch_size(engine, 2, cache)[1].startswith("cached")
    monkeypatch.setattr(LlamaEngine, "device", property(lambda self: "CUDA0 (a GPU, 80 GiB)"))
    assert invariant_batch_size(engine, 2, cache)[1].startswith("checked")
    engine.close()
    assert device_key(None) == "CPU"
