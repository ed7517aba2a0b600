"""How many sequences a worker serves when nobody says: batching on by default.

A worker generates up to ``PARKQ_MAX_SEQS`` jobs at once and keeps up to
``PARKQ_PARKED_SEQS`` parked jobs' KV in place. Unset, both are chosen here
from the model and the machine: 8 generating sequences on a CPU, 16 on a GPU
(where one decode call of 16 costs little more than one of 1), and 1 parked
sequence on a CPU, 4 on a GPU (copying a parked job's KV out of VRAM costs
tens of milliseconds, docs/gpu.md); fewer when their KV memory would take more
than half of the memory there is. Each sequence reserves ``n_ctx`` positions
of KV: per position, every layer's K and V rows (f16), read from the model's
metadata (sliding-window layers are counted in full: an upper bound).

Whether batching pays on this machine is measured when the worker starts (the
decode time of each batch size, jobs/engine/llama.py ``plan_batching``) and logged;
the choice stands even where it does not raise throughput, because eight
people then all start within a step instead of queueing behind each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.settings import Settings

__all__ = [
    "SequencePlan",
    "available_memory",
    "kv_bytes_per_position",
    "plan_sequences",
    "sequence_plan",
    "sequence_plan_elsewhere",
]

#: Generating and parked sequences per worker when unset, by where the model runs.
DEFAULTS = {"cpu": (8, 1), "gpu": (16, 4)}
#: At most this share of the memory there is goes to the sequences' KV.
KV_SHARE = 0.5
_F16 = 2


@dataclass(frozen=True)
class SequencePlan:
    max_seqs: int
    parked_seqs: int
    #: Why, in words (``parkq up`` and the worker print it).
    reason: str


def kv_bytes_per_position(metadata: dict[str, Any]) -> int | None:
    """K and V bytes one position of one sequence takes (f16), from a GGUF
    model's metadata; None when the metadata does not say."""
    arch = metadata.get("general.architecture")
    if not arch:
        return None

    def number(key: str) -> int | None:
        value = metadata.get(f"{arch}.{key}")
        try:
            return int(str(value)) if value is not None else None
        except ValueError:
            return None

    layers, embd = number("block_count"), number("embedding_length")
    heads = number("attention.head_count")
    kv_heads = number("attention.head_count_kv") or heads
    head_dim = embd // heads if embd and heads else None
    k_len = number("attention.key_length") or head_dim
    v_len = number("attention.value_length") or head_dim
    if not (layers and kv_heads and k_len and v_len):
        return None
    return layers * kv_heads * (k_len + v_len) * _F16


def available_memory(on_gpu: bool, gpu_free: int | None = None) -> int | None:
    """Bytes free for the KV: the GPU's free memory (given), or the memory
    available to this process (MemAvailable, capped by a cgroup's limit)."""
    if on_gpu:
        return gpu_free
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    limit = _cgroup_room()
    return min(avail, limit) if limit is not None else avail


def _cgroup_room() -> int | None:
    """A cgroup memory limit's room (limit - usage), v2 or v1, or None."""
    base = Path("/sys/fs/cgroup")
    for limit_file, usage_file in (
        (base / "memory.max", base / "memory.current"),
        (base / "memory" / "memory.limit_in_bytes", base / "memory" / "memory.usage_in_bytes"),
    ):
        try:
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # v1 says "none" with a huge number
                return None
            return max(0, int(limit) - int(usage_file.read_text()))
        except (OSError, ValueError):
            continue
    return None


def plan_sequences(
    max_seqs: int | None,
    parked_seqs: int | None,
    *,
    on_gpu: bool,
    n_ctx: int,
    kv_per_position: int | None,
    memory: int | None,
    model_bytes: int = 0,
    workers: int = 1,
) -> SequencePlan:
    """The sequences one worker serves: the settings where given, else the
    defaults for ``on_gpu``, fewer where ``workers`` workers' KV would take
    more than :data:`KV_SHARE` of ``memory`` (less the model when it loads into
    that memory)."""
    where = "gpu" if on_gpu else "cpu"
    gen_default, park_default = DEFAULTS[where]
    chosen = max_seqs is not None, parked_seqs is not None
    want = max_seqs if max_seqs is not None else gen_default
    parked = parked_seqs if parked_seqs is not None else park_default
    per_seq = kv_per_position * n_ctx if kv_per_position else None
    if all(chosen):
        return SequencePlan(want, parked, "as set (PARKQ_MAX_SEQS, PARKQ_PARKED_SEQS)")
    dev = "GPU" if on_gpu else "CPU"
    if per_seq is None or memory is None:
        return SequencePlan(
            want, parked, f"the default on a {dev} (KV size or free memory unknown)"
        )
    # Each worker loads its own copy of the model on a GPU; on a CPU the file is
    # mapped once and shared through the page cache.
    models = model_bytes * (max(1, workers) if on_gpu else 1)
    budget = max(0.0, (memory - models) * KV_SHARE / max(1, workers))
    fits = int(budget // per_seq)
    if not chosen[1]:
        parked = max(0, min(parked, fits - want))
    if not chosen[0]:
        want = max(1, min(want, fits - parked))
    total = (want + parked) * per_seq
    why = (
        f"the default on a {dev}, {_mib(per_seq)} of KV each ({n_ctx} positions); "
        f"{want + parked} take {_mib(total)} of {_mib(memory)} free"
    )
    if not chosen[0] and want < gen_default:
        why = f"{dev} default {gen_default} cut to fit: " + why
    return SequencePlan(want, parked, why)


def _mib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def sequence_plan(settings: Settings, workers: int = 1) -> SequencePlan:
    """:func:`plan_sequences` for ``settings``' model on this machine (the model's
    metadata is read without loading its weights)."""
    from jobs.engine.llama import Vocab, devices, gpu_layers

    if settings.max_seqs is not None and settings.parked_seqs is not None:
        return plan_sequences(settings.max_seqs, settings.parked_seqs, on_gpu=False, n_ctx=0,
                              kv_per_position=None, memory=None)  # fmt: skip
    model = settings.model or ""
    vocab = Vocab(model)
    gpus = [d for d in devices() if d.kind in ("gpu", "igpu")]
    on_gpu = bool(gpus) and gpu_layers(settings.n_gpu_layers) != 0
    try:
        model_bytes = Path(model).stat().st_size
    except OSError:
        model_bytes = 0
    gpu_free = gpus[0].free_bytes if gpus and gpus[0].free_bytes else None
    return plan_sequences(
        settings.max_seqs,
        settings.parked_seqs,
        on_gpu=on_gpu,
        n_ctx=settings.n_ctx or vocab.n_ctx_train,
        kv_per_position=kv_bytes_per_position(vocab.metadata),
        memory=available_memory(on_gpu, gpu_free),
        model_bytes=model_bytes,
        workers=workers,
    )


def sequence_plan_elsewhere(settings: Settings, workers: int = 1) -> SequencePlan:
    """:func:`sequence_plan` computed in a child process: asking a GPU for its
    free memory creates a driver context that would stay with the caller
    (`parkq up` lives as long as the stack; its workers need that memory)."""
    import json
    import subprocess
    import sys

    given = {"settings": settings.model_dump(mode="json"), "workers": workers}
    run = subprocess.run(
        [sys.executable, "-m", "jobs.engine.capacity"],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "failed")
    plan = json.loads(run.stdout)
    return SequencePlan(int(plan["max_seqs"]), int(plan["parked_seqs"]), str(plan["reason"]))


def _main() -> None:
    """The child of :func:`sequence_plan_elsewhere`: settings in, a plan out (JSON)."""
    import json
    import sys
    from dataclasses import asdict

    from scheduler.settings import Settings

    given = json.loads(sys.stdin.read())
    plan = sequence_plan(Settings(**given["settings"]), int(given["workers"]))
    print(json.dumps(asdict(plan)))


if __name__ == "__main__":
    _main()
