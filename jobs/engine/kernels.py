"""Which llama.cpp kernel path a model may take on this machine.

llama.cpp repacks weights into "extra buffer types" for the CPU's fastest
kernels (AMX on recent Xeons, AVX-512/AVX2 repacks for Q4_0 and friends). On
some machines those kernels crash the process on the first decode (a known,
machine-dependent llama.cpp bug on virtualized Sapphire/Granite Rapids). A
crash cannot be caught in-process, so in ``auto`` mode a *child process* (a
fresh interpreter, never a fork: docs/design.md, "What llama.cpp does here")
loads the model with extra buffers on and decodes a few tokens; if the child
dies by a signal (or fails, or hangs), the worker runs with extra buffers off,
which is always safe.

The verdict is cached per (llama.cpp build and CPU features, CPU flags, model
file), so the probe runs once per machine and model.

Invariant: ``on`` is chosen in ``auto`` mode only after a probe child on this
exact (build, CPU, model file) decoded successfully with extra buffers on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from scheduler.settings import Settings, cache_root

if TYPE_CHECKING:
    from jobs.engine.llama import LlamaEngine

__all__ = [
    "BatchVerdict",
    "KernelChoice",
    "OpChoice",
    "choose_kernels",
    "cpu_only_build",
    "cuda_device",
    "exact_kernels",
    "exact_prompts",
    "invariant_batch_size",
    "keep_attention_unsplit",
    "keep_cuda_invariant",
    "keep_decode_untiled",
    "patch_level",
    "peer_server_command",
    "probe_command",
    "prompt_floors",
    "prompts_together",
    "worker_attention",
    "worker_kernels",
]

log = logging.getLogger(__name__)

#: A probe that has not finished by then counts as failed (a hang is not a pass).
PROBE_TIMEOUT_SECONDS = 300.0
#: Tokens the probe decodes one at a time after its prompt (the decode kernels).
PROBE_DECODE_STEPS = 4


@dataclass(frozen=True)
class KernelChoice:
    """The engine's kernel path and why it was taken (for the worker's log)."""

    extra_buffers: bool
    reason: str


def probe_command(model: str, n_gpu_layers: int | None = None) -> list[str]:
    """The command that probes ``model`` with extra buffers on (a fresh
    interpreter), with the worker's layers on the GPU."""
    layers = "" if n_gpu_layers is None else str(n_gpu_layers)
    return [sys.executable, "-m", "jobs.engine.kernels", "probe", model, layers]


def peer_server_command(extra_buffers: bool) -> list[str]:
    """``python -m llama_cpp.server`` with extra buffers forced on or off (append its args)."""
    return [sys.executable, "-m", "jobs.engine.kernels", "serve", "on" if extra_buffers else "off"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cache_key(model: str, build: str) -> str:
    st = os.stat(model)
    parts = [build, _cpu_flags(), os.path.realpath(model), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _cache_path(cache_dir: str | None, key: str) -> Path:
    base = cache_root(cache_dir)
    return base / "kernels" / f"{key}.json"


def _probe(command: Sequence[str], timeout: float) -> KernelChoice:
    try:
        done = subprocess.run(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return KernelChoice(False, f"the probe with extra buffers on hung for {timeout:.0f} s")
    except OSError as exc:
        return KernelChoice(False, f"the probe could not start ({exc})")
    rc = done.returncode
    if rc == 0:
        return KernelChoice(True, "a probe decoded with extra buffers on")
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return KernelChoice(False, f"the probe with extra buffers on died by {name}")
    tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return KernelChoice(False, f"the probe with extra buffers on failed (status {rc}) {tail[0]}")


def choose_kernels(
    mode: str,
    model: str,
    cache_dir: str | None,
    *,
    command: Sequence[str] | None = None,
    timeout: float = PROBE_TIMEOUT_SECONDS,
    n_gpu_layers: int | None = None,
) -> KernelChoice:
    """Decide extra buffers ``on``/``off`` for ``model``; ``auto`` probes once and
    caches, per llama.cpp build, CPU, model file and devices (``n_gpu_layers``:
    the worker's setting; a verdict for the CPU is not one for a GPU).

    ``command`` replaces the probe child (the tests inject one that crashes).
    """
    if mode == "on":
        return KernelChoice(True, "PARKQ_EXTRA_BUFFERS=on")
    if mode == "off":
        return KernelChoice(False, "PARKQ_EXTRA_BUFFERS=off")
    if mode != "auto":
        raise ValueError(f"extra buffers mode must be auto, on or off, not {mode!r}")
    from jobs.engine.llama import build_info, device_key

    path = _cache_path(cache_dir, _cache_key(model, f"{build_info()}\n{device_key(n_gpu_layers)}"))
    try:
        cached = json.loads(path.read_text())
        return KernelChoice(bool(cached["extra_buffers"]), f"cached: {cached['reason']}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("probing llama.cpp's extra buffer types on %s in a child process", model)
    choice = _probe(command or probe_command(model, n_gpu_layers), timeout)
    _remember(path, {"extra_buffers": choice.extra_buffers, "reason": choice.reason})
    return choice


def _remember(path: Path, verdict: dict[str, object]) -> None:
    """Write a verdict to the cache atomically; a cache that cannot be written is
    only a warning (the check runs again at the next start)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(verdict))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot cache the verdict at %s: %s", path, exc)


def kernel_environment() -> str:
    """The environment variables that change which kernels llama.cpp and its
    backends take (``GGML_*``, ``LLAMA_*``, CUDA's and ROCm's), as one line."""
    prefixes = ("GGML_", "LLAMA_", "CUDA_", "CUBLAS", "HIP_", "ROCR_", "HSA_", "OMP_")
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(prefixes))


class BatchVerdict(NamedTuple):
    """How many sequences one decode call may take; what the check found (for the
    log); and the position up to which it checked, of how many."""

    size: int
    how: str
    horizon: int
    n_ctx: int
    #: Checked short of the context (the probe's time budget ran out): past
    #: ``horizon`` a batched sequence was not compared with one alone.
    partial: bool


def _engine_cache(engine: LlamaEngine, what: str, cache_dir: str | None) -> Path:
    """Where a whole-model check of ``engine`` (``what``) is cached: per llama.cpp
    build, CPU, model file, engine shape, device, attention, repacked weights
    and kernel environment."""
    from jobs.engine.llama import build_info

    shape = (f"{what} threads {engine.n_threads} ctx {engine.n_ctx} "
             f"seqs {engine.n_seq_max} n_batch {engine.n_batch} device {engine.device} "
             f"flash {engine.flash_attn} env {kernel_environment()}")  # fmt: skip
    key = _cache_key(engine.path, f"{build_info()}\n{shape}\n{engine.extra_buffers}")
    return _cache_path(cache_dir, key)


def invariant_batch_size(engine: LlamaEngine, limit: int, cache_dir: str | None) -> BatchVerdict:
    """How many sequences one decode call of ``engine`` may take and stay exact
    (:meth:`LlamaEngine.probe_invariance`), checked once and cached per llama.cpp
    build, CPU, model file, engine shape, device and kernel environment (CUDA's
    kernels are not the CPU's); and what the check found, for the log.

    A verdict cut short by the probe's time budget is kept too (it says how far it
    got); a build that does not repeat a step raises :class:`NotRepeatable`."""
    from jobs.engine.llama import ProbeVerdict

    path = _engine_cache(engine, f"batch {limit} exact {engine.exact}", cache_dir)
    try:
        verdict = ProbeVerdict.from_json(json.loads(path.read_text())["probe"])
        how = f"cached: {verdict.describe()}"
    except (OSError, ValueError, KeyError, TypeError):
        verdict = engine.probe_invariance(limit)
        _remember(path, {"probe": verdict.to_json()})
        how = f"checked: {verdict.describe()}"
    return BatchVerdict(verdict.size, how, verdict.horizon, verdict.n_ctx, not verdict.complete)


def worker_kernels(settings: Settings) -> KernelChoice:
    """The kernel path a worker with ``settings`` takes (and so the bench's peers).

    With PARKQ_EXACT on, ``auto`` takes the plain kernels even where repacked
    weights work, whatever the worker's width: the repacked matrix products
    switch to another kernel (another summation order) from 4 rows on, so a
    sequence decoded beside 3 others gets other logits than alone (measured on
    an AVX-512 CPU, demo model: batch-invariant up to 3 sequences with repacked
    weights, up to 7 without, and a lone sequence decodes as fast either way),
    and a one-sequence worker on repacked weights computes other logits than a
    wider one on plain weights, so a job that moves between them (a park taken
    up by the other, a replay after a crash) would change its tokens."""
    choice = choose_kernels(settings.extra_buffers, settings.model or "", settings.cache_dir,
                            n_gpu_layers=settings.n_gpu_layers)  # fmt: skip
    if choice.extra_buffers and settings.extra_buffers == "auto" and settings.exact:
        return KernelChoice(
            False,
            "exact: repacked weights are not batch-invariant, and every exact worker of "
            f"a model computes with the same kernels ({choice.reason})",
        )
    return choice


#: The op check in a child that has not answered by then counts as a check that
#: certified nothing beyond one sequence per call.
OPCHECK_TIMEOUT_SECONDS = 300.0
#: The switch of llama.cpp's tiled K-quant CPU product (on by default; read once
#: per process, at its first matrix product; an operator's setting).
TILED_SWITCH = "GGML_CPU_TILED_MM"
#: The fewest columns that take the tiled product, in the llama.cpp that parkq
#: installs (tools/llamapatch/0001-cpu-tiled-min-rows.patch; stock llama.cpp: always 8,
#: and this is ignored).
TILED_FLOOR = "GGML_CPU_TILED_MM_MIN_ROWS"
#: Where stock llama.cpp starts the tiled product.
TILED_STOCK_FLOOR = 8
#: The weight types llama.cpp's tiled CPU product takes (ggml-cpu/tiled/tiled.cpp).
TILED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
               "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")  # fmt: skip


@dataclass(frozen=True)
class OpChoice:
    """What the per-op check (jobs/engine/opcheck.py) certified, with the kernel
    settings the worker runs: the most sequences one call may take, for the log."""

    size: int
    how: str
    #: What an operator could change to certify wider calls, and its price
    #: (empty: nothing known).
    hint: str = ""
    #: Every KV length up to the context checked and no op left out: past the
    #: whole-model probe's positions, the per-op check vouches alone.
    complete: bool = False


#: The floor every exact-mode worker sets, whatever its width: one value for all
#: of them, because a prompt chunk narrower than the floor takes the one-column
#: product and a wider one the tiled product, so two workers with other floors
#: would prefill some prompts otherwise, and a job replayed from one on the
#: other would diverge. Decode calls of up to 16 sequences stay under it; a
#: worker of more sequences gets 16 per call on K-quant weights (the op check
#: refuses 17). Prompt calls take the tiled product at every size (the engine's
#: run-time floor, LlamaEngine._kernels_for) where llama.cpp has one (patch 3).
EXACT_TILED_FLOOR = 17


def keep_decode_untiled() -> tuple[int, str]:
    """Set the tiled product's floor to :data:`EXACT_TILED_FLOOR` (before
    llama.cpp's first matrix product in this process, which reads it once; the
    check's child inherits it), so that every decode width up to 16 takes the
    one-column product and prompts the tiled one. An operator's own value is
    kept. The floor in force, and what to say about it."""
    given = os.environ.get(TILED_FLOOR)
    if given is not None:
        try:
            if int(given) > 0:
                return int(given), f"{TILED_FLOOR}={given}, the operator's"
        except ValueError:
            pass
        why = f"{TILED_FLOOR}={given!r} is not a whole number above 0 (llama.cpp ignores it): "
    else:
        why = ""
    os.environ[TILED_FLOOR] = str(EXACT_TILED_FLOOR)
    return EXACT_TILED_FLOOR, why + f"{TILED_FLOOR}={EXACT_TILED_FLOOR}"


#: The switch of flash attention's KV split in parkq's llama.cpp
#: (tools/llamapatch/0002-cpu-fa-split-kv-switch.patch; stock: always split).
FA_SPLIT_SWITCH = "GGML_CPU_FA_SPLIT_KV"


#: The switch of parkq's CUDA build that fixes every kernel choice and every
#: split of a sum that depends on the number of sequences in a call or on the
#: KV cells it spans (tools/llamapatch/0005-cuda-batch-invariant.patch; read once
#: per process; stock llama.cpp has none and ignores it).
CUDA_INVARIANT_SWITCH = "GGML_CUDA_BATCH_INVARIANT"
#: The first patch level that carries it.
CUDA_INVARIANT_PATCH = 5


def cuda_device(device: str) -> bool:
    """Whether ``device`` (:func:`jobs.engine.llama.device_key`) runs on
    llama.cpp's CUDA backend (NVIDIA's CUDA, or AMD's ROCm through it): the
    backend that reads :data:`CUDA_INVARIANT_SWITCH`."""
    return "CUDA" in device or "ROCm" in device


def _switch_on(value: str | None) -> bool:
    """A switch's value as llama.cpp reads it (``atoi(value) != 0``)."""
    match = re.match(r"\s*[+-]?\d+", value or "")
    return bool(match) and int(match.group()) != 0  # type: ignore[union-attr]


def keep_cuda_invariant(cuda: bool) -> tuple[bool, str]:
    """On llama.cpp's CUDA backend with parkq's build, set
    :data:`CUDA_INVARIANT_SWITCH` (before llama.cpp's first CUDA op in this
    process, which reads it once; the check's child inherits it), unless the
    operator set it off. Whether it is on, and what to say (for the log). The
    per-op check still decides the width: the switch makes kernels agree, the
    check proves it on the card."""
    if not cuda:
        return False, ""
    if patch_level() < CUDA_INVARIANT_PATCH:
        return False, (f"this llama.cpp has no {CUDA_INVARIANT_SWITCH} (python -m "
                       "tools.llamapatch ensure): CUDA chooses its kernels by the number of "
                       "sequences in a call")  # fmt: skip
    given = os.environ.get(CUDA_INVARIANT_SWITCH)
    if given is not None and not _switch_on(given):
        return False, f"{CUDA_INVARIANT_SWITCH}={given}, the operator's"
    if given is None:
        os.environ[CUDA_INVARIANT_SWITCH] = "1"
    return True, (f"{CUDA_INVARIANT_SWITCH}={os.environ[CUDA_INVARIANT_SWITCH]}: one CUDA "
                  "kernel and one split of each sum for every width and KV length, where "
                  "the switch reaches (the op check names what it does not)")  # fmt: skip


def keep_attention_unsplit(gpu: bool, cuda: bool = True) -> tuple[bool, str]:
    """Whether an exact worker may run flash attention: on a CPU with parkq's
    llama.cpp, whose switch turns off the split of a lone sequence's KV cells
    across threads (set here before llama.cpp's first attention in this
    process; the check's child inherits it); on a GPU where
    :func:`keep_cuda_invariant` turned CUDA's switch on (its flash attention
    then takes one kernel and a fixed split at every width and KV length). Not
    on a stock build, and not where the operator set a switch otherwise. The
    per-op check still has the last word. Whether, and why (for the log)."""
    if gpu:
        on = _switch_on(os.environ.get(CUDA_INVARIANT_SWITCH))
        if cuda and on and patch_level() >= CUDA_INVARIANT_PATCH:
            return True, (f"flash attention on, {CUDA_INVARIANT_SWITCH}=1 (one kernel and a "
                          "fixed split of each sequence's cells)")  # fmt: skip
        return False, "flash attention off: exact mode on this GPU build keeps the plain attention"
    if patch_level() < 2:
        return False, "flash attention off: this llama.cpp cannot turn its KV split off"
    given = os.environ.get(FA_SPLIT_SWITCH)
    if given is not None and given.strip() != "0":
        return False, f"flash attention off: {FA_SPLIT_SWITCH}={given} (the operator's)"
    os.environ[FA_SPLIT_SWITCH] = "0"
    return True, f"flash attention on, {FA_SPLIT_SWITCH}=0 (no split of one sequence's cells)"


def worker_attention(settings: Settings) -> bool:
    """Whether a worker with ``settings`` runs flash attention (what the bench's
    peer is given): ``PARKQ_EXACT=0`` lets llama.cpp choose (on, on a CPU); an
    exact worker with parkq's llama.cpp runs it where its check certifies it
    (on a CPU the usual case; on a GPU with CUDA's switch on; the worker's log
    says when not)."""
    from jobs.engine.llama import device_key

    device = device_key(settings.n_gpu_layers)
    on_gpu = device != "CPU"
    if not settings.exact:
        return not on_gpu
    if on_gpu:
        return (cuda_device(device) and patch_level() >= CUDA_INVARIANT_PATCH
                and _switch_on(os.environ.get(CUDA_INVARIANT_SWITCH, "1")))  # fmt: skip
    return patch_level() >= 2 and os.environ.get(FA_SPLIT_SWITCH, "0") == "0"


def patch_level() -> int:
    """Which of parkq's llama.cpp patches this process's llama.cpp carries
    (tools/llamapatch: ``0.3.36+parkq.N`` carries the first N; 0: stock)."""
    from jobs.engine.llama import build_info

    version = build_info().split(";", 1)[0]
    _, _, level = version.partition("+parkq.")
    return int(level) if level.isdigit() else 0


def opcheck_command(model: str, widths: int, n_ctx: int, threads: int | None,
                    gpu: bool, flash: bool = False, prompts: int = 0) -> list[str]:  # fmt: skip
    """The per-op check in a fresh interpreter (llama.cpp reads its kernel switches
    once per process); ``prompts``: the check of prompt calls of ``n_batch``
    ``prompts`` rows instead."""
    cmd = [sys.executable, "-m", "jobs.engine.opcheck", model, "--widths", str(widths),
           "--ctx", str(n_ctx), "--json"]  # fmt: skip
    if threads:
        cmd += ["--threads", str(threads)]
    if flash:
        cmd += ["--flash-attn"]
    if prompts:
        cmd += ["--prompts", "--batch", str(prompts)]
    return [*cmd, "--gpu"] if gpu else cmd


def prompt_floors(gpu: bool) -> bool:
    """Whether an exact worker runs its prompt calls on the tiled paths and its
    decode calls on the one-row paths (LlamaEngine's ``prompt_floors``): on a
    CPU with parkq's llama.cpp from patch 3 on, every exact worker does, so
    that a prompt computes the same wherever it runs, alone or batched with
    others (a job replayed on another worker agrees)."""
    return not gpu and patch_level() >= 3


def prompts_together(engine: LlamaEngine, width: int, cache_dir: str | None) -> tuple[bool, str]:
    """:meth:`LlamaEngine.probe_prefill` (``width`` prompts together against
    alone, on the whole model), checked once and cached as
    :func:`invariant_batch_size` is: whether they agreed, and what it found."""
    path = _engine_cache(engine, f"prefill {width} floors {engine.prompt_floors}", cache_dir)
    try:
        cached = json.loads(path.read_text())
        return bool(cached["together"]), f"cached: {cached['how']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ok, how = engine.probe_prefill(width)
    _remember(path, {"together": ok, "how": how})
    return ok, f"checked: {how}"


def cpu_only_build() -> bool:
    """Whether this llama.cpp has no GPU backend: a GPU build takes a prompt
    pass of 32 rows or more to the GPU even with no layers there (llama.cpp's
    op offload), so its prompt calls are not the CPU's kernels alone."""
    from jobs.engine.llama import gpu_layers

    return gpu_layers(None) == 0


def exact_prompts(
    settings: Settings,
    n_ctx: int,
    *,
    flash: bool,
    timeout: float = OPCHECK_TIMEOUT_SECONDS,
) -> OpChoice:
    """Certify, op by op, that prompt calls of up to ``max_seqs`` sequences and
    ``n_batch`` tokens give each prompt row its value alone, on the CPU at the
    prompt floors (:func:`jobs.engine.opcheck.check_prompts`, in a child, cached
    as :func:`exact_kernels` is): the most prompts one call may take (1: each
    alone, as before)."""
    from jobs.engine.llama import build_info, device_key
    from jobs.engine.opcheck import VERSION

    limit = settings.max_seqs or 1
    model = settings.model or ""
    threads = settings.n_threads or len(os.sched_getaffinity(0))
    # A pass of a call is at most n_ubatch rows: the engine's chunk, or its sequences.
    rows = max(settings.n_batch, limit + (settings.parked_seqs or 0))
    command = opcheck_command(model, limit, n_ctx, threads, False, flash, rows)
    shape = (f"opcheck {VERSION} prompts {limit} batch {rows} ctx {n_ctx} "
             f"threads {threads} flash {flash} env {kernel_environment()}")  # fmt: skip
    key = _cache_key(model, f"{build_info()}\n{device_key(settings.n_gpu_layers)}\n{shape}")
    verdict = _opcheck(command, _cache_path(settings.cache_dir, key), timeout)
    size = max(1, min(limit, int(verdict.get("size", 1))))
    return OpChoice(size, _described(verdict), "", bool(verdict.get("complete")))


def _opcheck(command: Sequence[str], cache: Path, timeout: float) -> dict[str, Any]:
    """The check's JSON verdict, cached; an empty verdict (size 1) when it fails."""
    try:
        return dict(json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    try:
        done = subprocess.run(list(command), stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"size": 1, "error": f"the op check did not finish in {timeout:.0f} s"}
    except OSError as exc:
        return {"size": 1, "error": f"the op check could not start ({exc})"}
    try:
        verdict = dict(json.loads(done.stdout.decode().strip().splitlines()[-1]))
        int(verdict["size"])
    except (ValueError, IndexError, KeyError, TypeError):
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        return {"size": 1, "error": f"the op check failed (status {done.returncode}) {why[0]}"}
    _remember(cache, verdict)
    return verdict


def _described(verdict: dict[str, Any]) -> str:
    """The check's own words for its verdict (or why there is none)."""
    return str(verdict.get("error") or verdict["describe"])


def _tiled_culprit(verdict: dict[str, Any]) -> bool:
    size = int(verdict.get("size", 1))
    return any(
        op["first_differs"] == size + 1 and op["name"].split()[:2][-1] in TILED_TYPES
        for op in verdict.get("ops", [])
        if op["name"].startswith("mul_mat")
    )


def exact_kernels(
    settings: Settings,
    n_ctx: int,
    *,
    gpu: bool,
    flash: bool = False,
    timeout: float = OPCHECK_TIMEOUT_SECONDS,
) -> OpChoice:
    """Certify, op by op, how many sequences one decode call may take for every
    KV length up to ``n_ctx`` (:mod:`jobs.engine.opcheck`, in a child process
    with this process's environment, cached per llama.cpp build, CPU, model
    file, shape and kernel environment).

    Where llama.cpp's tiled K-quant product (from 8 columns, another summation
    order than one column) is what limits the width, the choice says so: with
    ``GGML_CPU_TILED_MM=0`` one call takes more sequences, but K-quant weights
    then prefill with the one-column product, several times slower on models
    made mostly of them (docs/benchmarks.md), so it is the operator's call."""
    from jobs.engine.llama import build_info, device_key
    from jobs.engine.opcheck import VERSION

    limit = settings.max_seqs or 1
    model = settings.model or ""
    threads = settings.n_threads or len(os.sched_getaffinity(0))  # what the engine takes
    command = opcheck_command(model, limit, n_ctx, threads, gpu, flash)
    shape = (f"opcheck {VERSION} widths {limit} ctx {n_ctx} threads {threads} "
             f"flash {flash} env {kernel_environment()}")  # fmt: skip
    key = _cache_key(model, f"{build_info()}\n{device_key(settings.n_gpu_layers)}\n{shape}")
    verdict = _opcheck(command, _cache_path(settings.cache_dir, key), timeout)
    size = max(1, min(limit, int(verdict.get("size", 1))))
    hint = ""
    if size < limit and not gpu and _tiled_culprit(verdict):
        hint = (f"llama.cpp's tiled K-quant product is what differs at width {size + 1}; "
                f"the llama.cpp parkq installs (python -m tools.llamapatch ensure, which "
                f"./scripts/test and ./scripts/demo run) keeps it for prompts only; on "
                f"this build {TILED_SWITCH}=0 turns it off so that one call takes more "
                "sequences, and makes the prefill of K-quant weights slower "
                "(docs/benchmarks.md, \"Exact at full speed\")")  # fmt: skip
    return OpChoice(size, _described(verdict), hint, bool(verdict.get("complete")))


def _run_probe(model: str, n_gpu_layers: int | None) -> None:
    """The child: load with extra buffers on, prefill a few tokens, decode a few."""
    import numpy as np

    from jobs.engine.llama import LlamaEngine

    engine = LlamaEngine(model, n_ctx=256, n_batch=64, n_threads=None, extra_buffers=True,
                         n_gpu_layers=n_gpu_layers)  # fmt: skip
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog.")[:32]
    logits = engine.eval(prompt, 0)
    pos = len(prompt)
    for _ in range(PROBE_DECODE_STEPS):
        if not np.isfinite(logits).all():
            raise SystemExit("non-finite logits with extra buffers on")
        logits = engine.eval([int(np.argmax(logits))], pos)
        pos += 1
    engine.close()


def _serve(extra_buffers: bool, argv: list[str]) -> None:
    """llama-cpp-python's server with the given kernel path (the bench's peer)."""
    import runpy

    from jobs.engine.llama import set_llama_extra_buffers

    set_llama_extra_buffers(extra_buffers)
    sys.argv = ["llama_cpp.server", *argv]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        layers = sys.argv[3] if len(sys.argv) > 3 else ""
        _run_probe(sys.argv[2], int(layers) if layers else None)
    elif sys.argv[1] == "serve":
        _serve(sys.argv[2] == "on", sys.argv[3:])
    else:
        raise SystemExit("usage: python -m jobs.engine.kernels probe MODEL | serve on|off ARGS...")
