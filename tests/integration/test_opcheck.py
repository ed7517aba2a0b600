"""The per-op batching check (jobs/engine/opcheck.py) on real llama.cpp: it names
the kernel that changes with the batch width, it is at least as strict as the
whole-model probe, the worker's check certifies what the kernels of its
environment allow, and the widths it certifies keep sequences past 1,000
positions exact.

The K-quant model is the ``small`` shape quantized by llama.cpp to Q4_K_M, so
its products take llama.cpp's K-quant kernels: on x86 CPUs the tiled product
from 8 columns, which sums in another order than one column alone (the planted
width-dependent kernel here is llama.cpp's own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jobs.engine import opcheck
from jobs.engine.ggmlapi import Device, Ggml
from jobs.engine.kernels import (
    EXACT_TILED_FLOOR,
    FA_SPLIT_SWITCH,
    TILED_FLOOR,
    TILED_SWITCH,
    exact_kernels,
    keep_attention_unsplit,
    keep_decode_untiled,
)
from jobs.engine.llama import LlamaEngine, build_info, device_key, library_dir
from jobs.engine.testmodel import write_kquant_model, write_test_model
from scheduler.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
#: llama.cpp builds its tiled K-quant product for x86 CPUs with AVX or better.
TILED_BUILT = any(f"{isa} = 1" in build_info() for isa in ("AVX2", "AVX512", "AVX "))
#: Where an engine loaded with the defaults runs (a CUDA build: the GPU).
ON_GPU = device_key(None) != "CPU"


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (TILED_SWITCH, TILED_FLOOR, FA_SPLIT_SWITCH)}  # fmt: skip
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _opcheck(
    model: Path,
    widths: int,
    ctx: int,
    *,
    gpu: bool = False,
    env: dict[str, str] | None = None,
    flash: bool = False,
) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "jobs.engine.opcheck", str(model), "--widths", str(widths),
         "--ctx", str(ctx), "--json", "--threads", "2", *(["--gpu"] if gpu else []),
         *(["--flash-attn"] if flash else [])],
        capture_output=True, text=True, timeout=300, env=_child_env(**(env or {})), check=False,
    )  # fmt: skip
    assert done.stdout, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == (0 if verdict["size"] >= widths else 1)
    return verdict


def _width_run(
    model: Path, width: int, positions: int, env: dict[str, str], flash: bool = False
) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.widthrun", str(model), str(width), str(positions),
         *(["flash"] if flash else [])],
        capture_output=True, text=True, timeout=300, env=_child_env(**env), check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kquant_model(tmp_path_factory.mktemp("kquant") / "small-q4_k_m.gguf")


@pytest.fixture
def clean_switch() -> Iterator[None]:
    """The tests set the switch and the floor in this process's environment
    (exact_kernels' child inherits them): put them back."""
    before = {k: os.environ.pop(k, None) for k in (TILED_SWITCH, TILED_FLOOR, FA_SPLIT_SWITCH)}
    yield
    for k, v in before.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def test_the_installed_llama_cpp_is_parkq_s_patched_build() -> None:
    """What ./scripts/test and ./scripts/demo install (tools/llamapatch): the
    floor of the tiled product below is that build's."""
    import llama_cpp

    from tools import llamapatch

    assert llama_cpp.__version__ == llamapatch.label()


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0"])
def test_the_op_check_finds_every_width_the_whole_model_probe_finds(
    quant: str, tmp_path: Path
) -> None:
    """Where a whole model decoded beside others gets other logits at some width,
    the per-op check refuses that width too, and names a product."""
    model = write_test_model(tmp_path / f"tiny-{quant}.gguf", seed=0, quant=quant)
    ops = _opcheck(model, 4, 1024, gpu=ON_GPU)
    engine = LlamaEngine(str(model), n_ctx=1024, n_batch=16, n_seq_max=4, extra_buffers=False)
    whole = engine.probe_invariance(4, seconds=600)
    engine.close()
    assert ops["size"] <= whole.size
    if whole.size < 4:  # what differed is named (on a CPU: a product; see below)
        named = [op["name"] for op in ops["ops"] if op["first_differs"] == ops["size"] + 1]
        assert named
        if not ON_GPU:
            assert all(name.startswith("mul_mat") for name in named)
    if quant == "f32" and not ON_GPU and TILED_BUILT:
        # x86: llamafile's sgemm takes F32 products from 2 columns, in another order
        # than the one-column product; both checks see it.
        assert ops["size"] == whole.size == 1


def test_the_tiled_k_quant_product_is_named_and_every_width_agrees_without_it(
    kquant_model: Path,
) -> None:
    on = _opcheck(kquant_model, 9, 1024, env={TILED_SWITCH: "1"})
    off = _opcheck(kquant_model, 9, 1024, env={TILED_SWITCH: "0"})
    assert off["size"] == 9, off
    assert {op["name"].split()[1] for op in off["ops"] if op["name"].startswith("mul_mat")} == {
        "Q4_K", "Q6_K"}  # fmt: skip
    if TILED_BUILT:
        assert on["size"] == 7
        named = {op["name"].split()[1] for op in on["ops"] if op["first_differs"] == 8}
        assert named and named <= {"Q4_K", "Q6_K"}, on
    else:  # no tiled product in this build: nothing changes with the width
        assert on["size"] == 9


def test_the_tiled_product_s_floor_keeps_every_decode_width_exact_and_prompts_tiled(
    kquant_model: Path,
) -> None:
    """parkq's patched build: with the floor at 10, widths 1 to 9 take the
    one-column product and agree; width 10 takes the tiled one again (so prompts
    keep llama.cpp's fast prefill), and the check refuses it."""
    below = _opcheck(kquant_model, 9, 1024, env={TILED_FLOOR: "10"})
    assert below["size"] == 9, below
    at = _opcheck(kquant_model, 10, 1024, env={TILED_FLOOR: "10"})
    if TILED_BUILT:
        assert at["size"] == 9, at
        named = {op["name"].split()[1] for op in at["ops"] if op["first_differs"] == 10}
        assert named and named <= {"Q4_K", "Q6_K"}, at
    else:
        assert at["size"] == 10


def test_flash_attention_agrees_at_every_width_only_with_its_kv_split_off(
    kquant_model: Path,
) -> None:
    """Stock llama.cpp splits a lone sequence's 512 or more cells across threads
    (2 here) and no other call's: the check refuses width 2, in a call spanning 512.
    With parkq's switch off (GGML_CPU_FA_SPLIT_KV=0) every width and KV length
    agrees."""
    split = _opcheck(kquant_model, 4, 1024, flash=True, env={FA_SPLIT_SWITCH: "1"})
    (attention,) = [op for op in split["ops"] if op["name"].startswith("flash attention")]
    assert attention["first_differs"] == 2, split
    lengths = json.loads(attention["where"].split("in a call of lengths ")[1])
    assert opcheck._pad(max(lengths)) >= 512 and split["size"] == 1  # the cells a call spans
    unsplit = _opcheck(kquant_model, 4, 1024, flash=True, env={FA_SPLIT_SWITCH: "0"})
    (attention,) = [op for op in unsplit["ops"] if op["name"].startswith("flash attention")]
    assert attention["first_differs"] is None and attention["cells"] == 1024, unsplit


def test_flash_attention_without_its_split_is_the_same_on_any_thread_count_and_after_a_park(
    kquant_model: Path,
) -> None:
    """One sequence past 512 cells with flash attention, the split off: 1 and 2
    threads give the same logits at every step, and a restored KV state (what a
    park keeps) continues as if never parked. With the split on, thread counts
    differ (the reason the worker turns it off)."""

    def alone(threads: int, split: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.widthrun", str(kquant_model), "alone", "700",
             str(threads)],
            capture_output=True, text=True, timeout=300, check=True,
            env=_child_env(**{FA_SPLIT_SWITCH: split}),
        )  # fmt: skip
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    one, two = alone(1, "0"), alone(2, "0")
    assert one["resumed"] and two["resumed"]
    assert one["digest"] == two["digest"]
    assert alone(2, "1")["digest"] != one["digest"]


def test_the_worker_s_check_certifies_what_its_kernels_allow_and_names_the_switch(
    kquant_model: Path, tmp_path: Path, clean_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model=str(kquant_model), max_seqs=8, cache_dir=str(tmp_path))
    default = exact_kernels(settings, 1024, gpu=False)
    assert default.size == (7 if TILED_BUILT else 8), default.how
    assert (TILED_SWITCH + "=0" in default.hint) == TILED_BUILT
    if TILED_BUILT:
        assert "differs at width 8" in default.how and "Q4_K" in default.how
    # Cached: a second start runs no check.

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("the op check ran again")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert exact_kernels(settings, 1024, gpu=False) == default
    monkeypatch.undo()
    # What the worker does (tools/worker_process.py): the one floor of every exact
    # worker, whatever its width.
    assert keep_decode_untiled() == (17, "GGML_CPU_TILED_MM_MIN_ROWS=17")
    floored = exact_kernels(settings, 1024, gpu=False)
    assert (floored.size, floored.hint) == (8, "")
    assert "every width up to 8 agrees" in floored.how
    # Wider than the floor: 16 per call, and the tiled product named.
    wide = exact_kernels(settings.model_copy(update={"max_seqs": 18}), 1024, gpu=False)
    assert wide.size == (16 if TILED_BUILT else 18), wide.how
    # An operator's own floor is kept; one llama.cpp would ignore is not.
    os.environ[TILED_FLOOR] = "9"
    assert keep_decode_untiled() == (9, "GGML_CPU_TILED_MM_MIN_ROWS=9, the operator's")
    os.environ[TILED_FLOOR] = "0"
    assert keep_decode_untiled()[0] == 17 and os.environ[TILED_FLOOR] == "17"
    os.environ.pop(TILED_FLOOR)
    # The operator turns the tiled product off: every width agrees, nothing to hint.
    os.environ[TILED_SWITCH] = "0"
    off = exact_kernels(settings, 1024, gpu=False)
    assert (off.size, off.hint) == (8, "")
    assert "every width up to 8 agrees" in off.how
    # Four sequences per call never reach the tiled product.
    os.environ.pop(TILED_SWITCH)
    four = exact_kernels(settings.model_copy(update={"max_seqs": 4}), 1024, gpu=False)
    assert (four.size, four.hint) == (4, "")


def test_eight_sequences_past_1000_positions_get_their_logits_alone_at_the_certified_width(
    kquant_model: Path, tmp_path: Path, clean_switch: None
) -> None:
    """The width the check certifies holds for a whole model deep in its context;
    a width it refuses (the tiled product on, where it is built) does not."""
    settings = Settings(model=str(kquant_model), max_seqs=8, cache_dir=str(tmp_path))
    # The worker's setting: prompts prefilled by the tiled product, decode widths not.
    os.environ[TILED_FLOOR] = str(EXACT_TILED_FLOOR)
    assert exact_kernels(settings, 1200, gpu=False).size == 8
    run = _width_run(kquant_model, 8, 1030, {TILED_FLOOR: str(EXACT_TILED_FLOOR)})
    assert run == {"equal": True, "positions": 1030 + 16 * 7 + 6}
    # With flash attention, as the worker runs it where its check certifies it.
    assert keep_attention_unsplit(False)[0] and os.environ[FA_SPLIT_SWITCH] == "0"
    assert exact_kernels(settings, 1200, gpu=False, flash=True).size == 8
    floor = str(EXACT_TILED_FLOOR)
    run = _width_run(kquant_model, 8, 1030, {TILED_FLOOR: floor, FA_SPLIT_SWITCH: "0"}, True)
    assert run == {"equal": True, "positions": 1030 + 16 * 7 + 6}
    # Stock llama.cpp's split: a lone sequence's cells are summed otherwise.
    split = {TILED_FLOOR: floor, FA_SPLIT_SWITCH: "1"}
    assert not _width_run(kquant_model, 8, 1030, split, True)["equal"]
    os.environ.pop(TILED_FLOOR)
    os.environ.pop(FA_SPLIT_SWITCH)
    # The tiled product off altogether.
    os.environ[TILED_SWITCH] = "0"
    assert exact_kernels(settings, 1200, gpu=False).size == 8
    run = _width_run(kquant_model, 8, 1030, {TILED_SWITCH: "0"})
    assert run == {"equal": True, "positions": 1030 + 16 * 7 + 6}
    if TILED_BUILT:
        os.environ[TILED_SWITCH] = "1"
        assert exact_kernels(settings, 1200, gpu=False).size == 7
        assert not _width_run(kquant_model, 8, 1030, {TILED_SWITCH: "1"})["equal"]
        assert _width_run(kquant_model, 7, 1030, {TILED_SWITCH: "1"})["equal"]


def _planted(real: Any, width: int, span: int) -> Any:
    """``_attend`` with a kernel that changes at ``width`` sequences per call once a
    call spans ``span`` cells or more."""

    def attend(dev: Any, a: Any, data: Any, lengths: Any, streams: Any, **kw: Any) -> Any:
        out = real(dev, a, data, lengths, streams, **kw)
        if len(lengths) >= width and opcheck._pad(max(lengths)) >= span:
            out[0, 0, 0] = np.nextafter(out[0, 0, 0], np.float32(np.inf))
        return out

    return attend


def test_the_attention_check_reports_the_narrowest_width_wherever_it_first_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted in the attention graph: width 2 differs only past 768 cells, width 5
    from the first call: the check says 2 (not the 5 it meets first), and where."""
    import numpy as np

    shape = opcheck.AttentionShape(16, 16, 4, 2)
    dev = Device(Ggml(library_dir()), False, 1)
    try:
        rng = np.random.default_rng(0)
        clean = opcheck.check_attention(dev, shape, 1024, 6, rng, seconds=600)
        assert clean.first_differs is None and clean.cells == 1024
        real = opcheck._attend
        monkeypatch.setattr(opcheck, "_attend", _planted(_planted(real, 5, 256), 2, 1024))
        found = opcheck.check_attention(dev, shape, 1024, 6, rng, seconds=600)
        assert found.first_differs == 2, found
        lengths = json.loads(found.where.split("in a call of lengths ")[1])
        assert len(lengths) == 2 and max(lengths) > 768, found.where
        monkeypatch.setattr(opcheck, "_attend", _planted(real, 3, 768))
        assert opcheck.check_attention(dev, shape, 1024, 6, rng, seconds=600).first_differs == 3
        # Out of time at once: the first span only, and said so.
        short = opcheck.check_attention(dev, shape, 1024, 6, rng, seconds=0)
        assert short.cells == 256
    finally:
        dev.close()
