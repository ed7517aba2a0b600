"""The kernel-path choice: a probe child with llama.cpp's extra buffer types on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from jobs.engine.kernels import choose_kernels, worker_kernels
from jobs.engine.llama import LlamaEngine
from scheduler.settings import Settings, load_settings

#: A probe child that dies as llama.cpp's AMX kernels do on the machines where they crash.
SEGFAULTING_PROBE = [
    sys.executable,
    "-c",
    "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
]


def test_a_probe_that_dies_by_a_signal_turns_extra_buffers_off_and_is_cached(
    tiny_model: Path, tmp_path: Path
) -> None:
    choice = choose_kernels("auto", str(tiny_model), str(tmp_path), command=SEGFAULTING_PROBE)
    assert not choice.extra_buffers
    assert "SIGSEGV" in choice.reason
    # The verdict is remembered: a probe that would now pass is not run again.
    passing = [sys.executable, "-c", "pass"]
    again = choose_kernels("auto", str(tiny_model), str(tmp_path), command=passing)
    assert not again.extra_buffers
    assert again.reason.startswith("cached:")
    # Another cache (another machine, say) probes afresh.
    fresh = choose_kernels("auto", str(tiny_model), str(tmp_path / "other"), command=passing)
    assert fresh.extra_buffers


def test_a_probe_that_fails_or_hangs_turns_extra_buffers_off(
    tiny_model: Path, tmp_path: Path
) -> None:
    failing = [sys.executable, "-c", "raise SystemExit('no kernels here')"]
    choice = choose_kernels("auto", str(tiny_model), str(tmp_path / "a"), command=failing)
    assert not choice.extra_buffers
    assert "no kernels here" in choice.reason
    hanging = [sys.executable, "-c", "import time; time.sleep(60)"]
    choice = choose_kernels(
        "auto", str(tiny_model), str(tmp_path / "b"), command=hanging, timeout=1
    )
    assert not choice.extra_buffers
    assert "hung" in choice.reason


def test_the_real_probe_decodes_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    choice = choose_kernels("auto", str(tiny_model), str(tmp_path))
    assert choice.extra_buffers, choice.reason


def test_forced_modes_do_not_probe(tiny_model: Path, tmp_path: Path) -> None:
    cache = str(tmp_path)
    assert choose_kernels("on", str(tiny_model), cache, command=SEGFAULTING_PROBE).extra_buffers
    assert not choose_kernels(
        "off", str(tiny_model), cache, command=SEGFAULTING_PROBE
    ).extra_buffers
    assert not list(tmp_path.iterdir())


def test_both_kernel_paths_decode_the_same_greedy_tokens(tiny_model: Path) -> None:
    outputs = []
    for extra in (True, False):
        engine = LlamaEngine(str(tiny_model), n_ctx=512, n_batch=64, extra_buffers=extra)
        prompt = engine.tokenize("The park queue")
        logits = engine.eval(prompt, 0)
        out, pos = [], len(prompt)
        for _ in range(30):
            out.append(int(np.argmax(logits)))
            logits = engine.eval([out[-1]], pos)
            pos += 1
        engine.close()
        outputs.append(out)
    assert outputs[0] == outputs[1]


def test_exact_workers_of_every_width_take_the_plain_kernels_unless_told_otherwise(
    tiny_model: Path, tmp_path: Path
) -> None:
    cache = str(tmp_path)
    passing = [sys.executable, "-c", "pass"]
    assert choose_kernels("auto", str(tiny_model), cache, command=passing).extra_buffers

    def settings(**kw: object) -> Settings:
        return load_settings(model=str(tiny_model), cache_dir=cache, **kw)

    # One sequence or several: a job may move between them, so both compute
    # with the plain kernels (the probe, cached, says repacked ones work here).
    for seqs in (1, 4):
        chosen = worker_kernels(settings(max_seqs=seqs))
        assert not chosen.extra_buffers and "not batch-invariant" in chosen.reason
    assert worker_kernels(settings(max_seqs=4, extra_buffers="on")).extra_buffers
    assert worker_kernels(settings(max_seqs=1, exact=False)).extra_buffers
