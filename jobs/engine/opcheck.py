"""The per-op batch-invariance check: each operation a model's decode step runs,
at its real weight types and shapes, on the device and build the worker uses,
compared bit for bit between one sequence alone and the same sequence beside
others.

A whole-model probe (:meth:`LlamaEngine.probe_invariance`) says *that* a
sequence's logits changed; this check says *which* kernel changed them, and it
covers every width and (for a 4,096-cell context, in seconds) every KV length,
where the whole-model probe needs minutes per position range. It drives ggml
directly through its C API (jobs/engine/ggmlapi.py: the same kernels
llama.cpp's decode calls), so it needs no header and no compiler, and the same
code checks a CUDA build.

What it checks:

- **matrix products** (``mul_mat``): for every distinct (weight type, rows,
  columns) of the model file, the real weights times 1..N activation columns;
  column ``j`` of the N-wide product must equal the product of column ``j``
  alone. On a CPU this is where llama.cpp changes kernels by width (the tiled
  K-quant product from 8 columns, repacked weights from 4, llamafile's sgemm from
  2); on CUDA the quantized matrix-vector kernels up to 8 columns and the
  matrix-matrix ones past them.
- **attention** as the engine runs it: without flash attention, Q·Kᵀ, the
  masked softmax and the product with the transposed V cache; with it
  (``--flash-attn``), llama.cpp's ``flash_attn_ext`` over the untransposed
  caches. At the model's head sizes, one KV stream per sequence (as parkq's engine keeps them), each
  stream with data of its own. Every sequence of a call is compared with itself
  alone (its cells padded to its own length, to 256 as llama.cpp pads them): a
  length on each side of every 256-cell boundary beside a sequence reaching
  the next boundary and one reaching twice as far, a short sequence beside one
  reaching each multiple of 256 (every KV length a call can span), and 3 and N
  sequences at each of those lengths, every width at the shortest
  (:func:`attention_arrangements`). Its cost
  grows with the square of the context, so it runs in increasing order of the
  cells a call spans for ``--seconds`` (30) and says how far it got.

It does not check the model's other ops (norms, rope, element-wise ops: each
output from one sequence's values), weights of 3 or more dimensions (a mixture
of experts' stacks: named in the verdict as not checked), the fused kernels a
GPU backend may take for one sequence alone, nor how llama.cpp builds the
graph; the whole-model probe stays the end-to-end check at a few positions.

Run as ``python -m jobs.engine.opcheck MODEL [--widths N] [--ctx C] [--gpu]``:
it prints one line per op and a JSON verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from jobs.engine.ggmlapi import F16, F32, PREC_F32, Device, Ggml

__all__ = [
    "VERSION",
    "OpResult",
    "OpVerdict",
    "check_model",
    "check_ops",
    "flash_unchecked",
    "main",
    "weight_shapes",
]

#: Part of every cached verdict's key: a verdict of an older check is not reused.
VERSION = 3
#: llama.cpp pads a sequence's KV cells to a multiple of this.
KV_PAD = 256
#: The attention check's time, by default: it checks KV lengths in increasing
#: order and says how far it got (cost grows with the square of the context).
ATTENTION_SECONDS = 30.0
#: ggml's type ids (ggml.h) that the check names; others print as numbers.
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
              21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 30: "BF16"}  # fmt: skip


@dataclass(frozen=True)
class OpResult:
    """One op, checked at every width (and KV length) it was asked for."""

    #: What it is: ``mul_mat Q4_K 1024x640 (blk.*.attn_output.weight, 18)``.
    name: str
    #: The widths checked (sequences beside each other in one call).
    widths: int
    #: The narrowest width at which some column differed from the same column
    #: alone (None: every width agreed).
    first_differs: int | None = None
    #: Where: the column (sequence) and, for attention, the lengths.
    where: str = ""
    max_abs_diff: float = 0.0
    seconds: float = 0.0
    #: For attention: every arrangement up to this many KV cells was checked
    #: (None: not a KV-length op).
    cells: int | None = None


@dataclass(frozen=True)
class OpVerdict:
    """The check's answer: the widest call in which every op agrees with alone,
    and what it did not cover."""

    device: str
    widths: int
    n_ctx: int
    ops: list[OpResult] = field(default_factory=list)
    seconds: float = 0.0
    #: What the check has no op for (weights it skipped), in words.
    uncovered: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        """The most sequences one call may take (every width up to it agreed)."""
        firsts = [op.first_differs for op in self.ops if op.first_differs is not None]
        return min(firsts, default=self.widths + 1) - 1

    @property
    def cells(self) -> int:
        """KV lengths covered: every arrangement up to this many cells."""
        return min((op.cells for op in self.ops if op.cells is not None), default=0)

    @property
    def complete(self) -> bool:
        """Every KV length up to the context checked, and nothing left out."""
        return self.cells >= self.n_ctx and not self.uncovered

    def culprits(self) -> list[OpResult]:
        """The ops that differed at the narrowest failing width."""
        size = self.size
        return [op for op in self.ops if op.first_differs == size + 1]

    def describe(self) -> str:
        head = (f"{len(self.ops)} ops on {self.device}, widths 1..{self.widths}, KV lengths up "
                f"to {self.cells} of {self.n_ctx} cells, {self.seconds:.1f} s: ")  # fmt: skip
        if self.size >= self.widths:
            head += f"every width up to {self.widths} agrees with one sequence alone"
        else:
            bad = "; ".join(f"{op.name} differs at width {op.first_differs} ({op.where}, "
                            f"max difference {op.max_abs_diff:.3g})"
                            for op in self.culprits())  # fmt: skip
            head += f"widths up to {self.size} agree; {bad}"
        if self.uncovered:
            head += "; not checked: " + "; ".join(self.uncovered)
        return head

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "size": self.size, "cells": self.cells,
                "complete": self.complete, "describe": self.describe()}  # fmt: skip


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


@dataclass(frozen=True)
class ModelShapes:
    """What the check takes from a model file."""

    weights: list[WeightShape]
    attention: AttentionShape
    n_ctx_train: int
    #: Weights the check has no product for (3-D: a mixture of experts' stacks).
    skipped: list[str]
    reader: Any


def weight_shapes(model: str) -> ModelShapes:
    """The distinct matrix products of ``model`` (2-D weights, norms excluded), its
    attention's shape, its training context, the weights left out, and the reader
    that holds the tensors' bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    seen: dict[tuple[int, int, int], WeightShape] = {}
    skipped = []
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]
        if len(shape) > 2 and t.name.endswith(".weight"):
            skipped.append(t.name)
            continue
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
    n_ctx_train = int(_field(reader, f"{arch}.context_length"))
    attention = AttentionShape(dk, dv, n_head, n_head_kv)
    return ModelShapes(list(seen.values()), attention, n_ctx_train, skipped, reader)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ValueError(f"the model has no {key}")
        return default
    if f.types and f.types[0].name == "ARRAY":  # per-layer counts: the largest
        return max(int(f.parts[i][0]) for i in f.data)
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value[0]


def flash_unchecked(model: str) -> list[str]:
    """What the flash attention check does not build and llama.cpp would run for
    ``model`` (the check passes no logit softcap, ALiBi bias or attention sinks,
    assumes plain K and V heads, and llama.cpp runs its own attention instead of
    flash attention for a KQ bias, as in Grok): empty where it checks the model's
    flash attention as llama.cpp builds it."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = _field(reader, "general.architecture")
    found = []
    for key, what in ((f"{arch}.attn_logit_softcapping", "a logit softcap"),
                      (f"{arch}.attention.max_alibi_bias", "an ALiBi bias"),
                      (f"{arch}.attention.kv_lora_rank", "compressed (MLA) K and V")):  # fmt: skip
        f = reader.fields.get(key)
        if f is not None and float(f.parts[f.data[0]][0]) != 0.0:
            found.append(what)
    if any("attn_sinks" in t.name for t in reader.tensors):
        found.append("attention sinks")
    if arch == "grok":
        found.append("a KQ bias (Grok)")
    return found


# -- the checks -------------------------------------------------------------------


def _first_difference(alone: np.ndarray, together: np.ndarray) -> tuple[int, float] | None:
    """The first row (axis 0) where ``together`` differs bit for bit from
    ``alone``, and the largest difference there."""
    same = (alone.view(np.uint32) == together.view(np.uint32)).reshape(len(alone), -1)
    bad = np.flatnonzero(~same.all(axis=1))
    if not len(bad):
        return None
    j = int(bad[0])
    return j, float(np.nanmax(np.abs(alone[j].astype(np.float64) - together[j])))


@contextlib.contextmanager
def _weight(dev: Device, w: WeightShape, data: Any) -> Iterator[int]:
    """``w``'s tensor on the device, holding ``data`` (the model's bytes)."""
    g = dev.g
    wctx = dev.context(1)
    try:
        weight = g.new_4d(wctx, w.ggml_type, w.cols, w.rows, 1, 1)
        wbuf = dev.upload(wctx)
        try:
            dev.put(weight, np.asarray(data).reshape(-1).view(np.uint8))
            yield weight
        finally:
            g.buffer_free(wbuf)
    finally:
        g.free(wctx)


def check_matmul(dev: Device, w: WeightShape, data: Any, widths: int,
                 rng: np.random.Generator) -> OpResult:  # fmt: skip
    """``w``'s product with 1..``widths`` columns against each column alone."""
    t0 = time.perf_counter()
    with _weight(dev, w, data) as weight:
        x = rng.standard_normal((widths, w.cols)).astype(np.float32)
        alone = np.stack([_product(dev, weight, w, x[j : j + 1])[0] for j in range(widths)])
        for n in range(2, widths + 1):
            found = _first_difference(alone[:n], _product(dev, weight, w, x[:n]))
            if found is not None:
                return OpResult(w.name, widths, n, f"column {found[0]}", found[1],
                                time.perf_counter() - t0)  # fmt: skip
    return OpResult(w.name, widths, None, "", 0.0, time.perf_counter() - t0)


def _product(dev: Device, weight: int, w: WeightShape, x: np.ndarray) -> np.ndarray:
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


def _pad(n: int) -> int:
    return -(-n // KV_PAD) * KV_PAD


def attention_arrangements(n_ctx: int, widths: int) -> list[list[int]]:
    """The calls the attention check makes, as the lengths of their sequences
    (the first is the one compared; every one is compared with itself alone),
    in increasing order of the KV cells the call spans:

    - each length across every 256-cell boundary (m - 1, m + 1) and the shortest
      ones, beside one sequence reaching the next boundary and beside one
      reaching twice as far (the padding a longer neighbour adds);
    - a short sequence (37) beside one reaching each multiple of 256 (every KV
      length a call can span);
    - 3 and ``widths`` sequences at each of those lengths (all of one length, and
      one beside the others at the next boundary), and every width from 3 to
      ``widths`` at the shortest two lengths."""
    lengths = sorted(
        {1, 37, n_ctx} | {m + d for m in range(KV_PAD, n_ctx, KV_PAD) for d in (-1, 1)}
    )
    lengths = [x for x in lengths if 1 <= x <= n_ctx]
    out: list[list[int]] = [[x] for x in lengths]  # alone, and their own repeatability
    for x in lengths if widths >= 2 else []:
        for other in (_pad(x) + KV_PAD, 2 * _pad(x)):
            if other <= n_ctx:
                out.append([x, other])
    out += [[37, m] for m in range(KV_PAD, n_ctx + 1, KV_PAD) if widths >= 2]
    for x in lengths:
        nxt = min(n_ctx, _pad(x) + KV_PAD)
        for n in (
            range(3, widths + 1) if x in (1, 37) else sorted({3, widths} & {*range(3, widths + 1)})
        ):
            out.append([x] * n)
            out.append([x] + [nxt] * (n - 1))
    unique = {tuple(a) for a in out}
    return sorted((list(a) for a in unique), key=lambda a: (_pad(max(a)), len(a), a))


class _Streams:
    """Each stream's own K, V and query (a stream's data differs from every other
    one's: a kernel that reads another stream's data cannot pass)."""

    def __init__(self, a: AttentionShape, n_ctx: int, rng: np.random.Generator) -> None:
        cells = self.cells = _pad(n_ctx)
        self.k = (rng.standard_normal((cells, a.n_head_kv * a.head_dim_k)) * 0.5).astype(np.float16)
        self.v = rng.standard_normal((a.n_head_kv * a.head_dim_v, cells)).astype(np.float16)
        self.q = rng.standard_normal((a.n_head, a.head_dim_k)).astype(np.float32)

    def k_of(self, s: int, cells: int) -> np.ndarray:
        return np.roll(self.k, 3 * s, axis=1)[:cells]

    def v_of(self, s: int, cells: int) -> np.ndarray:
        return np.roll(self.v, 5 * s, axis=0)[:, :cells]

    def q_of(self, s: int) -> np.ndarray:
        return np.roll(self.q, 7 * s, axis=1)


def check_attention(
    dev: Device,
    a: AttentionShape,
    n_ctx: int,
    widths: int,
    rng: np.random.Generator,
    seconds: float = ATTENTION_SECONDS,
    flash: bool = False,
) -> OpResult:
    """Every sequence of every arrangement (:func:`attention_arrangements`)
    against the same sequence alone (its cells padded to its own length), bit for
    bit, in increasing order of the cells a call spans until ``seconds`` run out:
    the narrowest width that differed, and the KV cells up to which every
    arrangement was checked."""
    t0 = time.perf_counter()
    kind = "flash attention" if flash else "attention K·Q, softmax, V"
    name = (f"{kind} (head {a.head_dim_k}/{a.head_dim_v}, {a.n_head} heads, "
            f"{a.n_head_kv} KV heads, F16 cache)")  # fmt: skip
    data = _Streams(a, n_ctx, rng)
    groups: dict[int, list[list[int]]] = {}
    for lengths in attention_arrangements(n_ctx, widths):
        groups.setdefault(_pad(max(lengths)), []).append(lengths)
    alone: dict[tuple[int, int], np.ndarray] = {}
    first: tuple[int, str, float] | None = None
    cells = 0
    for span in sorted(groups):
        if cells and time.perf_counter() - t0 > seconds:
            break  # out of time: every arrangement up to ``cells`` was checked
        for lengths in groups[span]:
            got = _attend(dev, a, data, lengths, range(len(lengths)), flash=flash)
            for s, length in enumerate(lengths):
                if (s, length) not in alone:
                    alone[(s, length)] = _attend(dev, a, data, [length], [s], flash=flash)[0]
                found = _first_difference(alone[(s, length)][None], got[s][None])
                if found is not None and (first is None or len(lengths) < first[0]):
                    where = f"sequence {s} of length {length} in a call of lengths {lengths}"
                    first = (len(lengths), where, found[1])
        cells = min(span, n_ctx)
    took = time.perf_counter() - t0
    if first is not None:
        return OpResult(name, widths, first[0], first[1], first[2], took, cells)
    return OpResult(name, widths, None, "", 0.0, took, cells)


def _attend(dev: Device, a: AttentionShape, data: _Streams, lengths: Sequence[int],
            streams: Sequence[int], *, flash: bool = False) -> np.ndarray:  # fmt: skip
    """One decode call's attention for ``len(lengths)`` sequences (one token each,
    one KV stream each, stream ``streams[i]``'s data), llama.cpp's graph without
    flash attention (or with it: ``flash``): the caches' views over ``n_kv``
    cells (the longest length, padded), a mask hiding each stream's cells past
    its length."""
    if flash:
        return _attend_flash(dev, a, data, lengths, streams)
    g = dev.g
    ns = len(lengths)
    n_kv = _pad(max(lengths))
    # On a CPU every row is computed alone, so a cache of exactly the cells the
    # call spans does; a GPU backend may pick kernels by the views' strides, so
    # there the cache is the context's, as llama.cpp's is.
    kv_size = data.cells if dev.gpu else n_kv
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
            dev.put(kc, np.stack([data.k_of(s, kv_size) for s in streams]))
            dev.put(vc, np.stack([data.v_of(s, kv_size) for s in streams]))
            dev.put(qt, np.stack([data.q_of(s) for s in streams]))
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


def _attend_flash(dev: Device, a: AttentionShape, data: _Streams, lengths: Sequence[int],
                  streams: Sequence[int]) -> np.ndarray:  # fmt: skip
    """:func:`_attend` as llama.cpp builds it with flash attention
    (``build_attn_mha``): one ``flash_attn_ext`` over the K and V caches' views
    (V not transposed), an F16 mask, F32 accumulation."""
    g = dev.g
    ns = len(lengths)
    n_kv = _pad(max(lengths))
    kv_size = data.cells if dev.gpu else n_kv
    ctx = dev.context(12)
    try:
        dk, dv, nh, nkv = a.head_dim_k, a.head_dim_v, a.n_head, a.n_head_kv
        h = 2  # sizeof(f16)
        kc = g.new_4d(ctx, F16, dk * nkv, kv_size, ns, 1)
        vc = g.new_4d(ctx, F16, dv * nkv, kv_size, ns, 1)
        qt = g.new_4d(ctx, F32, dk, nh, 1, ns)
        mask = g.new_4d(ctx, F16, n_kv, 1, 1, ns)
        kview = g.view_4d(ctx, kc, dk, nkv, n_kv, ns, dk * h, dk * nkv * h,
                          dk * nkv * kv_size * h, 0)  # fmt: skip
        vview = g.view_4d(ctx, vc, dv, nkv, n_kv, ns, dv * h, dv * nkv * h,
                          dv * nkv * kv_size * h, 0)  # fmt: skip
        kp = g.permute(ctx, kview, 0, 2, 1, 3)  # [dk, n_kv, nkv, ns]
        vp = g.permute(ctx, vview, 0, 2, 1, 3)  # [dv, n_kv, nkv, ns]
        qp = g.permute(ctx, qt, 0, 2, 1, 3)  # [dk, 1, nh, ns]
        out = g.flash_attn_ext(ctx, qp, kp, vp, mask, 1.0 / float(np.sqrt(dk)), 0.0, 0.0)
        g.prec_set_acc(out, PREC_F32)
        buf = dev.upload(ctx)
        try:
            dev.put(kc, np.stack([data.k_of(s, kv_size) for s in streams]))
            dev.put(vc, np.stack([data.v_of(s, kv_size).T for s in streams]))
            dev.put(qt, np.stack([data.q_of(s) for s in streams]))
            m = np.zeros((ns, n_kv), dtype=np.float16)
            for s, length in enumerate(lengths):
                m[s, length:] = -np.inf
            dev.put(mask, m)
            dev.compute(ctx, out)
            return dev.get(out, (ns, nh, dv))  # [dv, nh, 1, ns]
        finally:
            g.buffer_free(buf)
    finally:
        g.free(ctx)


# -- prompt calls ------------------------------------------------------------------
#
# A prompt call holds several sequences' prompt chunks (the engine's batched
# prefill). llama.cpp splits such a call into passes of equal rows per sequence
# (``split_equal``), so a chunk's rows land in passes of other sizes than alone;
# a row is exact only if its result depends on nothing but its own sequence. The
# engine runs every prompt call with both run-time floors at 1 (every row on
# the tiled paths, jobs/engine/kernels.py), and the check runs at those floors.

#: The floors of a prompt call: every row on the tiled product and the tiled
#: flash attention.
PROMPT_FLOOR = 1
#: Rows of a prompt pass the attention check takes per stream (and the pass's
#: size, n_ubatch, and two less: a lone sequence's remainder).
PROMPT_ROWS = (1, 2, 5, 16, 17, 63, 64, 65, 130)


def prompt_widths(n_batch: int, top: int | None = None) -> list[int]:
    """The columns of the prompt products the check multiplies: every width to
    17, each side of the tiled product's 16-column bands and 256-column windows,
    and ``n_batch`` (at most ``top``: the output matrix sees one column per
    sequence)."""
    widths = set(range(1, 18)) | {31, 33, 64, 65, 255, 257, n_batch}
    cap = min(n_batch, top) if top is not None else n_batch
    return sorted(w for w in widths if w <= cap)


def _sampled(n: int) -> list[int]:
    """The columns (rows) of an ``n``-wide call compared with alone: all up to
    17, else each side of the 16-row bands at both ends, the middle, the last."""
    if n <= 17:
        return list(range(n))
    return sorted({0, 1, 15, 16, 17, n // 2, n - 17, n - 16, n - 2, n - 1})


def _output(w: WeightShape) -> bool:
    return w.example in ("output.weight", "token_embd.weight")


def check_matmul_prompts(dev: Device, w: WeightShape, data: Any, widths: Sequence[int],
                         seqs: int, rng: np.random.Generator) -> OpResult:  # fmt: skip
    """``w``'s product with each of ``widths`` columns against each (sampled)
    column alone, at the prompt floors; a difference at any width refuses
    prompt calls of more than one sequence (reported as width 2)."""
    t0 = time.perf_counter()
    with _weight(dev, w, data) as weight:
        x = rng.standard_normal((max(widths), w.cols)).astype(np.float32)
        alone: dict[int, np.ndarray] = {}
        for n in widths:
            got = _product(dev, weight, w, x[:n])
            cols = _sampled(n)
            for j in cols:
                if j not in alone:
                    alone[j] = _product(dev, weight, w, x[j : j + 1])[0]
            found = _first_difference(np.stack([alone[j] for j in cols]), got[cols])
            if found is not None:
                return OpResult(w.name, seqs, 2, f"column {cols[found[0]]} of {n}",
                                found[1], time.perf_counter() - t0)  # fmt: skip
    return OpResult(w.name, seqs, None, "", 0.0, time.perf_counter() - t0)


def prompt_arrangements(n_ctx: int, seqs: int, n_batch: int) -> list[tuple[int, list[int]]]:
    """The prompt passes the attention check makes: ``(rows, starts)``, a pass of
    ``rows`` query rows per stream (equal for every stream, as llama.cpp's
    passes are) with stream ``i``'s first row at position ``starts[i]``: each
    row count alone at the start, across a 256-cell boundary and at the end of
    the context; beside a stream at the context's end and one at the start; and
    ``seqs`` streams at staggered starts. In increasing order of the cells a
    pass spans."""
    out: set[tuple[int, tuple[int, ...]]] = set()
    for rows in sorted({*PROMPT_ROWS, n_batch - 2, n_batch}):
        if not 0 < rows <= min(n_ctx, n_batch):
            continue
        last = n_ctx - rows
        ends = sorted(x for x in {0, 1, max(0, KV_PAD - rows // 2), last} if x <= last)
        for start in ends:
            out.add((rows, (start,)))
        for n in sorted({2, 3, seqs}):
            if n > seqs or n * rows > n_batch:
                continue
            for i in range(len(ends)):
                starts = [ends[(i + k) % len(ends)] for k in range(n)]
                out.add((rows, tuple(starts)))
    return sorted(((r, list(st)) for r, st in out),
                  key=lambda a: (_pad(max(a[1]) + a[0]), len(a[1]), a))  # fmt: skip


class _Rows(_Streams):
    """:class:`_Streams` with a query of its own at every position."""

    def q_at(self, s: int, pos: int) -> np.ndarray:
        return np.roll(self.q, 7 * s + 13 * pos, axis=1) * (1.0 + (pos % 5) / 8)


def check_attention_prompts(
    dev: Device,
    a: AttentionShape,
    n_ctx: int,
    seqs: int,
    n_batch: int,
    rng: np.random.Generator,
    seconds: float = ATTENTION_SECONDS,
    flash: bool = False,
) -> OpResult:
    """Every (sampled) row of every prompt pass (:func:`prompt_arrangements`)
    against the same row alone (one row, its stream's cells up to its own
    position), bit for bit, at the prompt floors, in increasing order of the
    cells a pass spans until ``seconds`` run out."""
    t0 = time.perf_counter()
    kind = "flash attention" if flash else "attention K·Q, softmax, V"
    name = (f"{kind} of prompt rows (head {a.head_dim_k}/{a.head_dim_v}, {a.n_head} heads, "
            f"{a.n_head_kv} KV heads, F16 cache)")  # fmt: skip
    data = _Rows(a, n_ctx, rng)
    alone: dict[tuple[int, int], np.ndarray] = {}
    first: tuple[int, str, float] | None = None
    cells = 0
    for rows, starts in prompt_arrangements(n_ctx, seqs, n_batch):
        span = _pad(max(starts) + rows)
        if cells and span > cells and time.perf_counter() - t0 > seconds:
            break
        got = _attend_rows(dev, a, data, rows, starts, range(len(starts)), flash)
        for s, start in enumerate(starts):
            for r in _sampled(rows):
                key = (s, start + r)
                if key not in alone:
                    alone[key] = _attend_rows(dev, a, data, 1, [start + r], [s], flash)[0][:, 0]
                found = _first_difference(alone[key][None], got[s][:, r][None])
                if found is not None and (first is None or len(starts) < first[0]):
                    where = (f"row {r} of {rows} of a stream from position {start} in a "
                             f"pass of starts {starts}")  # fmt: skip
                    first = (2, where, found[1])
        cells = max(cells, min(span, n_ctx))
    took = time.perf_counter() - t0
    if first is not None:
        return OpResult(name, seqs, first[0], first[1], first[2], took, cells)
    return OpResult(name, seqs, None, "", 0.0, took, cells)


def _attend_rows(dev: Device, a: AttentionShape, data: _Rows, rows: int, starts: Sequence[int],
                 streams: Sequence[int], flash: bool) -> np.ndarray:  # fmt: skip
    """One prompt pass's attention: ``rows`` query rows per stream, stream ``i``'s
    rows at positions ``starts[i]...``, each seeing its stream's cells up to its
    own position (llama.cpp's causal mask), as :func:`_attend` builds it with or
    without flash attention. Returns ``(streams, heads, rows, dv)``."""
    g = dev.g
    ns = len(starts)
    n_kv = _pad(max(starts) + rows)
    kv_size = data.cells if dev.gpu else n_kv
    ctx = dev.context(12)
    try:
        dk, dv, nh, nkv = a.head_dim_k, a.head_dim_v, a.n_head, a.n_head_kv
        h = 2  # sizeof(f16)
        kc = g.new_4d(ctx, F16, dk * nkv, kv_size, ns, 1)
        qt = g.new_4d(ctx, F32, dk, nh, rows, ns)  # [head, n_head, tokens, stream]
        kview = g.view_4d(ctx, kc, dk, nkv, n_kv, ns, dk * h, dk * nkv * h,
                          dk * nkv * kv_size * h, 0)  # fmt: skip
        kp = g.permute(ctx, kview, 0, 2, 1, 3)  # [dk, n_kv, nkv, ns]
        qp = g.permute(ctx, qt, 0, 2, 1, 3)  # [dk, rows, nh, ns]
        m = np.zeros((ns, rows, n_kv), dtype=np.float32)
        for s, start in enumerate(starts):
            for r in range(rows):
                m[s, r, start + r + 1 :] = -np.inf
        if flash:
            vc = g.new_4d(ctx, F16, dv * nkv, kv_size, ns, 1)
            mask = g.new_4d(ctx, F16, n_kv, rows, 1, ns)
            vview = g.view_4d(ctx, vc, dv, nkv, n_kv, ns, dv * h, dv * nkv * h,
                              dv * nkv * kv_size * h, 0)  # fmt: skip
            vp = g.permute(ctx, vview, 0, 2, 1, 3)  # [dv, n_kv, nkv, ns]
            out = g.flash_attn_ext(ctx, qp, kp, vp, mask, 1.0 / float(np.sqrt(dk)), 0.0, 0.0)
            g.prec_set_acc(out, PREC_F32)  # out: [dv, nh, rows, ns]
        else:
            vc = g.new_4d(ctx, F16, kv_size, dv * nkv, ns, 1)  # transposed
            mask = g.new_4d(ctx, F32, n_kv, rows, 1, ns)
            kq = g.mul_mat(ctx, kp, qp)  # [n_kv, rows, nh, ns]
            kq = g.soft_max_ext(ctx, kq, mask, 1.0 / float(np.sqrt(dk)), 0.0)
            vview = g.view_4d(ctx, vc, n_kv, dv, nkv, ns, kv_size * h, kv_size * dv * h,
                              kv_size * dv * nkv * h, 0)  # fmt: skip
            out = g.mul_mat(ctx, vview, kq)  # [dv, rows, nh, ns]
        buf = dev.upload(ctx)
        try:
            dev.put(kc, np.stack([data.k_of(s, kv_size) for s in streams]))
            if flash:
                dev.put(vc, np.stack([data.v_of(s, kv_size).T for s in streams]))
            else:
                dev.put(vc, np.stack([data.v_of(s, kv_size) for s in streams]))
            q = np.stack([np.stack([data.q_at(s, start + r) for r in range(rows)])
                          for s, start in zip(streams, starts, strict=True)])  # fmt: skip
            dev.put(qt, q.astype(np.float32))
            dev.put(mask, m.astype(np.float16) if flash else m)
            dev.compute(ctx, out)
            if flash:
                return dev.get(out, (ns, rows, nh, dv)).transpose(0, 2, 1, 3)
            return dev.get(out, (ns, nh, rows, dv))
        finally:
            g.buffer_free(buf)
    finally:
        g.free(ctx)


def check_prompts(
    weights: Sequence[tuple[WeightShape, Any]],
    attention: AttentionShape | None,
    *,
    seqs: int,
    n_ctx: int,
    n_batch: int,
    threads: int | None = None,
    seed: int = 0,
    seconds: float = ATTENTION_SECONDS,
    uncovered: Sequence[str] = (),
    flash: bool = False,
    floors: tuple[int, int] = (PROMPT_FLOOR, PROMPT_FLOOR),
) -> OpVerdict:
    """Whether prompt calls of up to ``seqs`` sequences (``n_batch`` rows) give
    every row its result alone, on the CPU at the prompt floors (``floors``:
    others, for the tests; 0 is llama.cpp's own): ``size`` ``seqs`` if so, 1
    if not (prompts then run alone). A llama.cpp without run-time floors gets
    size 1 and says why."""
    from jobs.engine.llama import library_dir

    t0 = time.perf_counter()
    ggml = Ggml(library_dir())
    dev = Device(ggml, False, threads or len(os.sched_getaffinity(0)))
    if ggml.floors is None:
        dev.close()
        missing = OpResult("run-time kernel floors", seqs, 2,
                           "this llama.cpp has none (parkq's patch 0003)")  # fmt: skip
        return OpVerdict(dev.name, seqs, n_ctx, [missing], time.perf_counter() - t0)
    ggml.floors.set(*floors)
    rng = np.random.default_rng(seed)
    try:
        ops = [check_matmul_prompts(dev, w, data,
                                    prompt_widths(n_batch, max(seqs, 17) if _output(w) else None),
                                    seqs, rng)
               for w, data in weights]  # fmt: skip
        if attention is not None:
            ops.append(check_attention_prompts(dev, attention, n_ctx, seqs, n_batch, rng,
                                               seconds, flash))  # fmt: skip
    finally:
        ggml.floors.set(0, 0)  # the process's: given back
        dev.close()
    return OpVerdict(dev.name, seqs, n_ctx, ops, time.perf_counter() - t0, list(uncovered))


def check_ops(
    weights: Sequence[tuple[WeightShape, Any]],
    attention: AttentionShape | None,
    *,
    widths: int,
    n_ctx: int,
    gpu: bool = False,
    threads: int | None = None,
    seed: int = 0,
    seconds: float = ATTENTION_SECONDS,
    uncovered: Sequence[str] = (),
    flash: bool = False,
) -> OpVerdict:
    """Check ``weights`` (each with its bytes) and ``attention`` at widths
    1..``widths`` and KV lengths up to ``n_ctx`` (within ``seconds``) on the CPU
    (or the first GPU)."""
    from jobs.engine.llama import library_dir

    t0 = time.perf_counter()
    dev = Device(Ggml(library_dir()), gpu, threads or len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(seed)
    try:
        ops = [check_matmul(dev, w, data, widths, rng) for w, data in weights]
        if attention is not None:
            ops.append(check_attention(dev, attention, n_ctx, widths, rng, seconds, flash))
    finally:
        dev.close()
    return OpVerdict(dev.name, widths, n_ctx, ops, time.perf_counter() - t0, list(uncovered))


def _tensor_bytes(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t.data
    raise KeyError(name)


def check_model(
    model: str,
    *,
    widths: int,
    n_ctx: int,
    gpu: bool = False,
    threads: int | None = None,
    seconds: float = ATTENTION_SECONDS,
    flash: bool = False,
    prompts: bool = False,
    n_batch: int = 512,
    floors: tuple[int, ...] = (PROMPT_FLOOR, PROMPT_FLOOR),
) -> OpVerdict:
    """:func:`check_ops` over the products and attention of the model file ``model``
    (``n_ctx`` 0: its training context, as llama.cpp takes 0; ``flash``: the
    attention as flash attention); ``prompts``: :func:`check_prompts` instead,
    prompt calls of up to ``widths`` sequences and ``n_batch`` rows."""
    shapes = weight_shapes(model)
    weights = [(w, _tensor_bytes(shapes.reader, w.example)) for w in shapes.weights]
    uncovered = []
    if shapes.skipped:
        uncovered.append(f"{len(shapes.skipped)} weights of 3 or more dimensions (experts' "
                         f"stacks: {shapes.skipped[0]}...)")  # fmt: skip
    if gpu:
        uncovered.append("the fused kernels a GPU backend may take for one sequence")
    # llama.cpp pads each sequence's context to a multiple of 256: check all of it.
    n_ctx = _pad(n_ctx or shapes.n_ctx_train)
    if prompts:
        return check_prompts(weights, shapes.attention, seqs=widths, n_ctx=n_ctx,
                             n_batch=n_batch, threads=threads, seconds=seconds,
                             uncovered=uncovered, flash=flash,
                             floors=(floors[0], floors[1]))  # fmt: skip
    return check_ops(weights, shapes.attention, widths=widths, n_ctx=n_ctx, gpu=gpu,
                     threads=threads, seconds=seconds, uncovered=uncovered,
                     flash=flash)  # fmt: skip


def _lines(verdict: OpVerdict) -> Iterator[str]:
    for op in verdict.ops:
        state = ("same at every width" if op.first_differs is None
                 else f"DIFFERS at width {op.first_differs} ({op.where}, "
                 f"max {op.max_abs_diff:.3g})")  # fmt: skip
        span = f", KV lengths up to {op.cells}" if op.cells is not None else ""
        yield f"{op.name:<78} {state}{span}  [{op.seconds:.2f} s]"
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
    ap.add_argument("--flash-attn", action="store_true",
                    help="check flash attention (as an exact worker runs it: on a CPU with "
                    "GGML_CPU_FA_SPLIT_KV=0 unless it is set)")  # fmt: skip
    ap.add_argument("--prompts", action="store_true",
                    help="check prompt calls of up to --widths sequences (batched prefill) "
                    "at the prompt floors, on the CPU")  # fmt: skip
    ap.add_argument("--batch", type=int, default=512, help="rows of a prompt call (n_batch)")
    ap.add_argument("--prompt-floors", default=f"{PROMPT_FLOOR},{PROMPT_FLOOR}",
                    help="with --prompts: the product's and the attention's floors to check "
                    "at (the tests' 0,0: llama.cpp's own)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--seconds",
        type=float,
        default=ATTENTION_SECONDS,
        help="the attention check's time (it says how far it got)",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON verdict")
    args = ap.parse_args(argv)
    if args.flash_attn and not args.gpu and "GGML_CPU_FA_SPLIT_KV" not in os.environ:
        # As an exact worker runs it (jobs.engine.kernels.keep_attention_unsplit):
        # a lone row's cells not split across threads. Set the switch to 1 to
        # check llama.cpp's own split (which a lone row's result depends on).
        os.environ["GGML_CPU_FA_SPLIT_KV"] = "0"
    if args.gpu and "GGML_CUDA_BATCH_INVARIANT" not in os.environ:
        # As an exact worker runs a CUDA build (jobs.engine.kernels.keep_cuda_invariant):
        # set it to 0 to check stock llama.cpp's choices by width and length.
        os.environ["GGML_CUDA_BATCH_INVARIANT"] = "1"
    verdict = check_model(args.model, widths=args.widths, n_ctx=args.ctx, gpu=args.gpu,
                          threads=args.threads, seconds=args.seconds,
                          flash=args.flash_attn, prompts=args.prompts,
                          n_batch=args.batch,
                          floors=tuple(int(x) for x in args.prompt_floors.split(",")))  # fmt: skip
    if not args.json:
        for line in _lines(verdict):
            print(line)
    print(json.dumps(verdict.to_json()))
    return 0 if verdict.size >= verdict.widths else 1


if __name__ == "__main__":
    sys.exit(main())
