"""The per-op batch-invariance check: each operation a model's decode step runs,
at its real weight types and shapes, on the device and build the worker uses,
compared bit for bit between one sequence alone and the same sequence beside
others.

A whole-model probe (:meth:`LlamaEngine.probe_invariance`) says *that* a
sequence's logits changed; this check says *which* kernel changed them, and it
covers every width and every KV length in seconds, where the whole-model probe
needs minutes per position range. It drives ggml directly through its C API
(``ggml_backend_*``, the same kernels llama.cpp's decode calls), so it needs no
header and no compiler, and the same code checks a CUDA build.

What it checks:

- **matrix products** (``mul_mat``): for every distinct (weight type, rows,
  columns) of the model file, the real weights times 1..N activation columns;
  column ``j`` of the N-wide product must equal the product of column ``j``
  alone. On a CPU this is where llama.cpp changes kernels by width (the tiled
  K-quant product from 8 columns, repacked weights from 4, llamafile's sgemm from
  2); on CUDA the quantized matrix-vector kernels up to 8 columns and the
  matrix-matrix ones past them.
- **attention** (no flash attention, as parkq's exact mode runs it): Q·Kᵀ,
  the masked softmax and the product with the transposed V cache, at the model's
  head sizes, for a sequence of length L alone (KV cells padded to 256, as
  llama.cpp pads them) and in calls that pad it further: beside one longer
  sequence reaching each multiple of 256 cells up to the context, and beside
  2..N-1 others reaching the context's end (one KV stream per sequence, as
  parkq's engine keeps them), for lengths across every 256-cell boundary.

It does not check the model's other ops (norms, rope, element-wise ops: one
output per element, no reduction across the batch) nor how llama.cpp builds the
graph; the whole-model probe stays the end-to-end check at a few positions.

Run as ``python -m jobs.engine.opcheck MODEL [--widths N] [--ctx C] [--gpu]``:
it prints one line per op and a JSON verdict.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["OpResult", "OpVerdict", "check_model", "check_ops", "main", "weight_shapes"]

#: llama.cpp pads a sequence's KV cells to a multiple of this.
KV_PAD = 256
#: ggml's type ids (ggml.h) that the check names; others print as numbers.
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
              21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 30: "BF16"}  # fmt: skip
F32, F16 = 0, 1
_CPU, _GPU = 0, 1  # enum ggml_backend_dev_type


@dataclass(frozen=True)
class OpResult:
    """One op, checked at every width (and KV length) it was asked for."""

    #: What it is: ``mul_mat Q4_K 1024x640 (blk.*.attn_output.weight, 18)``.
    name: str
    #: The widths checked (sequences beside each other in one call).
    widths: int
    #: The first width at which some column differed from the same column alone
    #: (None: every width agreed).
    first_differs: int | None = None
    #: Where: the column (sequence) and, for attention, the KV cells and length.
    where: str = ""
    max_abs_diff: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class OpVerdict:
    """The check's answer: the widest call in which every op agrees with alone."""

    device: str
    widths: int
    n_ctx: int
    ops: list[OpResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def size(self) -> int:
        """The most sequences one call may take (every width up to it agreed)."""
        firsts = [op.first_differs for op in self.ops if op.first_differs is not None]
        return min(firsts, default=self.widths + 1) - 1

    def culprits(self) -> list[OpResult]:
        """The ops that differed at the narrowest failing width."""
        size = self.size
        return [op for op in self.ops if op.first_differs == size + 1]

    def describe(self) -> str:
        head = (f"{len(self.ops)} ops on {self.device}, widths 1..{self.widths}, KV up to "
                f"{self.n_ctx} cells, {self.seconds:.1f} s: ")  # fmt: skip
        if self.size >= self.widths:
            return head + f"every width up to {self.widths} agrees with one sequence alone"
        bad = "; ".join(f"{op.name} differs at width {op.first_differs} ({op.where}, max "
                        f"difference {op.max_abs_diff:.3g})" for op in self.culprits())  # fmt: skip
        return head + f"widths up to {self.size} agree; {bad}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "size": self.size}


# -- ggml through ctypes ----------------------------------------------------------


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]  # fmt: skip


class _Ggml:
    """The few ggml entry points the check calls, from the libraries llama-cpp-python
    loaded (the same build the worker decodes with)."""

    def __init__(self, lib_dir: Path) -> None:
        mode = getattr(os, "RTLD_GLOBAL", 0)
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        ggml = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=mode)
        cpu_path = lib_dir / "libggml-cpu.so"
        cpu = ctypes.CDLL(str(cpu_path), mode=mode) if cpu_path.exists() else None
        p, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t

        def fn(lib: ctypes.CDLL, name: str, res: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.init = fn(base, "ggml_init", p, _InitParams)
        self.free = fn(base, "ggml_free", None, p)
        self.tensor_overhead = fn(base, "ggml_tensor_overhead", sz)
        self.graph_overhead = fn(base, "ggml_graph_overhead", sz)
        self.new_4d = fn(base, "ggml_new_tensor_4d", p, p, ctypes.c_int, i64, i64, i64, i64)
        self.mul_mat = fn(base, "ggml_mul_mat", p, p, p, p)
        self.soft_max_ext = fn(base, "ggml_soft_max_ext", p, p, p, p, ctypes.c_float,
                               ctypes.c_float)  # fmt: skip
        self.permute = fn(base, "ggml_permute", p, p, p, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int)  # fmt: skip
        self.view_4d = fn(base, "ggml_view_4d", p, p, p, i64, i64, i64, i64, sz, sz, sz, sz)
        self.row_size = fn(base, "ggml_row_size", sz, ctypes.c_int, i64)
        self.new_graph = fn(base, "ggml_new_graph", p, p)
        self.expand = fn(base, "ggml_build_forward_expand", None, p, p)
        self.alloc_tensors = fn(base, "ggml_backend_alloc_ctx_tensors", p, p, p)
        self.buffer_free = fn(base, "ggml_backend_buffer_free", None, p)
        self.tensor_set = fn(base, "ggml_backend_tensor_set", None, p, p, sz, sz)
        self.tensor_get = fn(base, "ggml_backend_tensor_get", None, p, p, sz, sz)
        self.nbytes = fn(base, "ggml_nbytes", sz, p)
        self.graph_compute = fn(base, "ggml_backend_graph_compute", ctypes.c_int, p, p)
        self.backend_free = fn(base, "ggml_backend_free", None, p)
        self.backend_name = fn(base, "ggml_backend_name", ctypes.c_char_p, p)
        self.init_by_type = fn(ggml, "ggml_backend_init_by_type", p, ctypes.c_int, p)
        self.set_threads = (fn(cpu, "ggml_backend_cpu_set_n_threads", None, p, ctypes.c_int)
                            if cpu is not None else None)  # fmt: skip


class _Device:
    """One ggml backend (the CPU, or the first GPU) and tensors allocated on it."""

    def __init__(self, ggml: _Ggml, gpu: bool, threads: int) -> None:
        self.g = ggml
        self.backend = ggml.init_by_type(_GPU if gpu else _CPU, None)
        if not self.backend:
            raise RuntimeError(f"this llama.cpp build has no {'GPU' if gpu else 'CPU'} backend")
        self.name = (ggml.backend_name(self.backend) or b"?").decode()
        if not gpu and ggml.set_threads is not None:
            ggml.set_threads(self.backend, threads)
            self.name += f" ({threads} threads)"

    def close(self) -> None:
        self.g.backend_free(self.backend)

    def context(self, tensors: int) -> int:
        params = _InitParams(self.g.tensor_overhead() * tensors + self.g.graph_overhead(), None,
                             True)  # fmt: skip
        ctx = self.g.init(params)
        if not ctx:
            raise MemoryError("ggml_init failed")
        return int(ctx)

    def upload(self, ctx: int) -> int:
        buf = self.g.alloc_tensors(ctx, self.backend)
        if not buf:
            raise MemoryError("cannot allocate the check's tensors on the device")
        return int(buf)

    def put(self, tensor: int, data: np.ndarray | bytes | memoryview) -> None:
        view = np.ascontiguousarray(np.frombuffer(data, dtype=np.uint8)
                                    if not isinstance(data, np.ndarray) else data)  # fmt: skip
        n = self.g.nbytes(tensor)
        if view.nbytes != n:
            raise ValueError(f"{view.nbytes} bytes for a tensor of {n}")
        self.g.tensor_set(tensor, view.ctypes.data, 0, n)

    def get(self, tensor: int, shape: Sequence[int]) -> np.ndarray:
        out = np.empty(shape, dtype=np.float32)
        self.g.tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        return out

    def compute(self, ctx: int, result: int) -> None:
        graph = self.g.new_graph(ctx)
        self.g.expand(graph, result)
        status = self.g.graph_compute(self.backend, graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned {status}")


# -- the model's shapes -----------------------------------------------------------


@dataclass(frozen=True)
class WeightShape:
    """A distinct matrix product of the model: its weight type and shape, and the
    tensor whose bytes stand for all of them."""

    ggml_type: int
    cols: int  # ne0: the reduction length
    rows: int  # ne1: outputs
    example: str
    count: int

    @property
    def name(self) -> str:
        kind = TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))
        where = self.example.split(".", 2)
        pattern = f"blk.*.{where[2]}" if where[0] == "blk" and len(where) == 3 else self.example
        return f"mul_mat {kind} {self.cols}x{self.rows} ({pattern}, {self.count})"


@dataclass(frozen=True)
class AttentionShape:
    head_dim_k: int
    head_dim_v: int
    n_head: int
    n_head_kv: int


def weight_shapes(model: str) -> tuple[list[WeightShape], AttentionShape, Any]:
    """The distinct matrix products of ``model`` (2-D weights, norms excluded), its
    attention's shape, and the reader that holds the tensors' bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    seen: dict[tuple[int, int, int], WeightShape] = {}
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]
        if len(shape) != 2 or not t.name.endswith(".weight") or shape[1] == 1:
            continue
        if t.name == "token_embd.weight" and any(x.name == "output.weight" for x in reader.tensors):
            continue  # a lookup table only: the output matrix is its own tensor
        key = (int(t.tensor_type), shape[0], shape[1])
        old = seen.get(key)
        seen[key] = WeightShape(*key, old.example if old else t.name, (old.count if old else 0) + 1)
    arch = _field(reader, "general.architecture")
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    dk = int(_field(reader, f"{arch}.attention.key_length", n_embd // n_head))
    dv = int(_field(reader, f"{arch}.attention.value_length", dk))
    return list(seen.values()), AttentionShape(dk, dv, n_head, n_head_kv), reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"the model has no {key}")
        return default
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    if f.types and f.types[0].name == "ARRAY":
        return int(np.max(value))  # per-layer head counts: the largest
    return value[0]


# -- the checks -------------------------------------------------------------------


def _first_difference(alone: np.ndarray, together: np.ndarray) -> tuple[int, float] | None:
    """The first column (axis 0) where ``together`` differs bit for bit from
    ``alone``, and the largest difference there."""
    same = (alone.view(np.uint32) == together.view(np.uint32)).reshape(len(alone), -1)
    bad = np.flatnonzero(~same.all(axis=1))
    if not len(bad):
        return None
    j = int(bad[0])
    return j, float(np.nanmax(np.abs(alone[j].astype(np.float64) - together[j])))


def check_matmul(dev: _Device, w: WeightShape, data: Any, widths: int,
                 rng: np.random.Generator) -> OpResult:  # fmt: skip
    """``w``'s product with 1..``widths`` columns against each column alone."""
    g, t0 = dev.g, time.perf_counter()
    wctx = dev.context(1)
    weight = g.new_4d(wctx, w.ggml_type, w.cols, w.rows, 1, 1)
    wbuf = dev.upload(wctx)
    try:
        dev.put(weight, np.asarray(data).reshape(-1).view(np.uint8))
        x = rng.standard_normal((widths, w.cols)).astype(np.float32)
        alone = np.stack([_product(dev, weight, w, x[j : j + 1])[0] for j in range(widths)])
        for n in range(2, widths + 1):
            found = _first_difference(alone[:n], _product(dev, weight, w, x[:n]))
            if found is not None:
                j, diff = found
                return OpResult(w.name, widths, n, f"column {j}", diff,
                                time.perf_counter() - t0)  # fmt: skip
    finally:
        g.buffer_free(wbuf)
        g.free(wctx)
    return OpResult(w.name, widths, None, "", 0.0, time.perf_counter() - t0)


def _product(dev: _Device, weight: int, w: WeightShape, x: np.ndarray) -> np.ndarray:
    g = dev.g
    ctx = dev.context(3)
    try:
        src = g.new_4d(ctx, F32, w.cols, len(x), 1, 1)
        out = g.mul_mat(ctx, weight, src)
        buf = dev.upload(ctx)
        try:
            dev.put(src, x)
            dev.compute(ctx, out)
            return dev.get(out, (len(x), w.rows))
        finally:
            g.buffer_free(buf)
    finally:
        g.free(ctx)


def _lengths(n_ctx: int) -> list[int]:
    """The sequence lengths the attention check puts first: short, across each
    padding boundary, and the context's end."""
    out = [1, 37]
    out += [m + d for m in range(KV_PAD, n_ctx, KV_PAD) for d in (-1, 1)]
    out.append(n_ctx)
    return sorted({x for x in out if 1 <= x <= n_ctx})


def _pad(n: int) -> int:
    return -(-n // KV_PAD) * KV_PAD


def check_attention(dev: _Device, a: AttentionShape, n_ctx: int, widths: int,
                    rng: np.random.Generator) -> OpResult:  # fmt: skip
    """Stream 0's attention output alone (cells padded to its length) against the
    same stream in calls that pad it further: beside one other stream reaching
    each multiple of 256 cells up to the context (every KV length), and beside
    2..``widths``-1 others reaching the context's end (every width), at every
    length of :func:`_lengths` (the widths at the shortest two and the longest)."""
    t0 = time.perf_counter()
    name = (f"attention K·Q, softmax, V (head {a.head_dim_k}/{a.head_dim_v}, {a.n_head} heads, "
            f"{a.n_head_kv} KV heads, F16 cache)")  # fmt: skip
    kv_size = _pad(n_ctx)
    # One stream's cache and query, reused in every arrangement.
    k = (rng.standard_normal((kv_size, a.n_head_kv, a.head_dim_k)) * 0.5).astype(np.float16)
    v = (rng.standard_normal((a.n_head_kv, a.head_dim_v, kv_size))).astype(np.float16)
    q = rng.standard_normal((a.n_head, a.head_dim_k)).astype(np.float32)
    lengths = _lengths(n_ctx)
    for i, length in enumerate(lengths):
        alone = _attend(dev, a, k, v, q, [length], kv_size)[0]
        arrangements = [[length, other] for other in range(_pad(length) + 1, n_ctx + 1, KV_PAD)]
        if widths >= 2 and (i < 2 or i == len(lengths) - 1):
            arrangements += [[length] + [n_ctx] * (n - 1) for n in range(2, widths + 1)]
        for lengths_now in arrangements:
            got = _attend(dev, a, k, v, q, lengths_now, kv_size)[0]
            found = _first_difference(alone[None], got[None])
            if found is not None:
                n = len(lengths_now)
                where = f"length {length} beside {n - 1} of length {lengths_now[-1]}"
                return OpResult(name, widths, n, where, found[1], time.perf_counter() - t0)
    return OpResult(name, widths, None, "", 0.0, time.perf_counter() - t0)


def _attend(dev: _Device, a: AttentionShape, k: np.ndarray, v: np.ndarray, q: np.ndarray,
            lengths: Sequence[int], kv_size: int) -> np.ndarray:  # fmt: skip
    """One decode call's attention for ``len(lengths)`` streams (one token each),
    llama.cpp's non-flash graph: the caches' views over ``n_kv`` cells (the longest
    length, padded), a mask hiding each stream's cells past its length."""
    g = dev.g
    ns = len(lengths)
    n_kv = min(kv_size, _pad(max(lengths)))
    ctx = dev.context(12)
    try:
        dk, dv, nh, nkv = a.head_dim_k, a.head_dim_v, a.n_head, a.n_head_kv
        kc = g.new_4d(ctx, F16, dk * nkv, kv_size, ns, 1)  # [embd_k_gqa, kv_size, stream]
        vc = g.new_4d(ctx, F16, kv_size, dv * nkv, ns, 1)  # transposed: [kv_size, embd_v_gqa]
        qt = g.new_4d(ctx, F32, dk, nh, 1, ns)  # [head, n_head, tokens, stream]
        mask = g.new_4d(ctx, F32, n_kv, 1, 1, ns)
        h = 2  # sizeof(f16)
        kview = g.view_4d(ctx, kc, dk, nkv, n_kv, ns, dk * h, dk * nkv * h,
                          dk * nkv * kv_size * h, 0)  # fmt: skip
        kp = g.permute(ctx, kview, 0, 2, 1, 3)  # [dk, n_kv, nkv, ns]
        qp = g.permute(ctx, qt, 0, 2, 1, 3)  # [dk, 1, nh, ns]
        kq = g.mul_mat(ctx, kp, qp)  # [n_kv, 1, nh, ns]
        kq = g.soft_max_ext(ctx, kq, mask, 1.0 / float(np.sqrt(dk)), 0.0)
        vview = g.view_4d(ctx, vc, n_kv, dv, nkv, ns, kv_size * h, kv_size * dv * h,
                          kv_size * dv * nkv * h, 0)  # fmt: skip
        out = g.mul_mat(ctx, vview, kq)  # [dv, 1, nh, ns]
        buf = dev.upload(ctx)
        try:
            kdata = np.broadcast_to(k.reshape(kv_size, nkv * dk), (ns, kv_size, nkv * dk))
            dev.put(kc, np.ascontiguousarray(kdata))
            vdata = np.broadcast_to(v.reshape(nkv * dv, kv_size), (ns, nkv * dv, kv_size))
            dev.put(vc, np.ascontiguousarray(vdata))
            dev.put(qt, np.ascontiguousarray(np.broadcast_to(q, (ns, nh, dk))))
            m = np.zeros((ns, n_kv), dtype=np.float32)
            for s, length in enumerate(lengths):
                m[s, length:] = -np.inf
            dev.put(mask, m)
            dev.compute(ctx, out)
            return dev.get(out, (ns, nh, dv))
        finally:
            g.buffer_free(buf)
    finally:
        g.free(ctx)


def library_dir() -> Path:
    """Where the llama.cpp libraries the worker loads live (LLAMA_CPP_LIB_PATH or
    llama-cpp-python's own)."""
    from jobs.engine.llama import library_dir as where

    return where()


def check_ops(
    weights: Sequence[tuple[WeightShape, Any]],
    attention: AttentionShape | None,
    *,
    widths: int,
    n_ctx: int,
    gpu: bool = False,
    threads: int | None = None,
    seed: int = 0,
) -> OpVerdict:
    """Check ``weights`` (each with its bytes) and ``attention`` at widths
    1..``widths`` and KV lengths up to ``n_ctx`` on the CPU (or the first GPU)."""
    t0 = time.perf_counter()
    dev = _Device(_Ggml(library_dir()), gpu, threads or len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(seed)
    try:
        ops = [check_matmul(dev, w, data, widths, rng) for w, data in weights]
        if attention is not None:
            ops.append(check_attention(dev, attention, n_ctx, widths, rng))
    finally:
        dev.close()
    return OpVerdict(dev.name, widths, n_ctx, ops, time.perf_counter() - t0)


def _tensor_bytes(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t.data
    raise KeyError(name)


def check_model(model: str, *, widths: int, n_ctx: int, gpu: bool = False,
                threads: int | None = None) -> OpVerdict:  # fmt: skip
    """:func:`check_ops` over the products and attention of the model file ``model``."""
    shapes, attention, reader = weight_shapes(model)
    if n_ctx <= 0:  # the model's own context, as llama.cpp takes n_ctx 0
        arch = _field(reader, "general.architecture")
        n_ctx = int(_field(reader, f"{arch}.context_length"))
    weights = [(w, _tensor_bytes(reader, w.example)) for w in shapes]
    return check_ops(weights, attention, widths=widths, n_ctx=n_ctx, gpu=gpu, threads=threads)


def _lines(verdict: OpVerdict) -> Iterator[str]:
    for op in verdict.ops:
        state = ("same at every width" if op.first_differs is None
                 else f"DIFFERS at width {op.first_differs} ({op.where}, "
                 f"max {op.max_abs_diff:.3g})")  # fmt: skip
        yield f"{op.name:<78} {state}  [{op.seconds:.2f} s]"
    yield verdict.describe()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.engine.opcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("model")
    ap.add_argument("--widths", type=int, default=8, help="sequences per call to check (1..N)")
    ap.add_argument(
        "--ctx",
        type=int,
        default=4096,
        help="KV cells per sequence to reach (0: the model's training context)",
    )
    ap.add_argument("--gpu", action="store_true", help="check the first GPU, not the CPU")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print only the JSON verdict")
    args = ap.parse_args(argv)
    verdict = check_model(args.model, widths=args.widths, n_ctx=args.ctx, gpu=args.gpu,
                          threads=args.threads)  # fmt: skip
    if not args.json:
        for line in _lines(verdict):
            print(line)
    print(json.dumps(verdict.to_json()))
    return 0 if verdict.size >= verdict.widths else 1


if __name__ == "__main__":
    sys.exit(main())
