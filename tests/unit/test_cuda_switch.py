"""When an exact worker turns on CUDA's batch-invariant switch
(tools/llamapatch/0005-cuda-batch-invariant.patch) and with it flash attention:
only on a GPU, only on a build that has the switch, never over an operator's
own setting. The kernels themselves are checked on a card (scripts/gpu-check)."""

from __future__ import annotations

import os

import pytest

from jobs.engine import kernels
from jobs.engine.kernels import (
    CUDA_INVARIANT_SWITCH,
    keep_attention_unsplit,
    keep_cuda_invariant,
    worker_attention,
)
from scheduler.settings import Settings


@pytest.fixture
def level(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(CUDA_INVARIANT_SWITCH, raising=False)
    monkeypatch.setattr(kernels, "patch_level", lambda: 5)
    return monkeypatch


def test_an_exact_worker_on_a_gpu_turns_the_switch_and_flash_attention_on(
    level: pytest.MonkeyPatch,
) -> None:
    on, said = keep_cuda_invariant(True)
    assert on and os.environ[CUDA_INVARIANT_SWITCH] == "1"
    assert f"{CUDA_INVARIANT_SWITCH}=1" in said
    flash, said = keep_attention_unsplit(True)
    assert flash and CUDA_INVARIANT_SWITCH in said


def test_the_operators_setting_is_kept_and_then_flash_attention_stays_off(
    level: pytest.MonkeyPatch,
) -> None:
    level.setenv(CUDA_INVARIANT_SWITCH, "0")
    on, said = keep_cuda_invariant(True)
    assert not on and os.environ[CUDA_INVARIANT_SWITCH] == "0"
    assert "the operator's" in said
    assert keep_attention_unsplit(True) == (
        False,
        "flash attention off: exact mode on this GPU build keeps the plain attention",
    )


def test_a_build_without_the_switch_is_named_and_left_alone(level: pytest.MonkeyPatch) -> None:
    level.setattr(kernels, "patch_level", lambda: 4)
    on, said = keep_cuda_invariant(True)
    assert not on and CUDA_INVARIANT_SWITCH not in os.environ
    assert "tools.llamapatch ensure" in said
    assert not keep_attention_unsplit(True)[0]


def test_a_cpu_worker_never_sets_it(level: pytest.MonkeyPatch) -> None:
    assert keep_cuda_invariant(False) == (False, "")
    assert CUDA_INVARIANT_SWITCH not in os.environ


@pytest.mark.parametrize(
    ("exact", "switch", "level_", "flash"),
    [
        (True, None, 5, True),  # the worker sets it: the peer runs flash attention too
        (True, "0", 5, False),
        (True, None, 4, False),
        (False, None, 5, False),  # PARKQ_EXACT=0 on a GPU: as before
    ],
)
def test_the_benchmark_peer_gets_the_attention_a_gpu_worker_runs(
    level: pytest.MonkeyPatch, exact: bool, switch: str | None, level_: int, flash: bool
) -> None:
    from jobs.engine import llama

    level.setattr(llama, "device_key", lambda n_gpu_layers: "CUDA0 (NVIDIA H100, 80 GiB)")
    level.setattr(kernels, "patch_level", lambda: level_)
    if switch is not None:
        level.setenv(CUDA_INVARIANT_SWITCH, switch)
    settings = Settings(model="m.gguf", exact=exact)
    assert worker_attention(settings) is flash


def test_a_switch_value_counts_as_llama_cpp_reads_it(level: pytest.MonkeyPatch) -> None:
    """``atoi(value) != 0``: '2' is on (and kept), 'off' is off."""
    level.setenv(CUDA_INVARIANT_SWITCH, "2")
    assert keep_cuda_invariant(True)[0] and os.environ[CUDA_INVARIANT_SWITCH] == "2"
    assert keep_attention_unsplit(True)[0]
    level.setenv(CUDA_INVARIANT_SWITCH, "off")
    assert not keep_cuda_invariant(True)[0]


def test_flash_attention_stays_off_on_a_gpu_the_switch_does_not_reach(
    level: pytest.MonkeyPatch,
) -> None:
    level.setenv(CUDA_INVARIANT_SWITCH, "1")  # set by hand on, say, a Vulkan device
    assert not keep_attention_unsplit(True, cuda=False)[0]
    from jobs.engine import llama

    level.setattr(llama, "device_key", lambda n_gpu_layers: "Vulkan0 (AMD Radeon, 16 GiB)")
    assert worker_attention(Settings(model="m.gguf")) is False
