"""ggml's C API through ctypes, as much as the per-op check needs
(jobs/engine/opcheck.py): contexts, tensors, a few ops, a backend (the CPU or
the first GPU) and its buffers. It loads the libraries llama-cpp-python loaded
(the worker's own build), so it needs no header and no compiler.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PREC_F32", "Device", "Floors", "Ggml", "library"]

F32, F16 = 0, 1
#: enum ggml_prec: accumulate in F32 (what llama.cpp asks of its attention)
PREC_F32 = 10
#: enum ggml_backend_dev_type
_CPU, _GPU, _IGPU = 0, 1, 2


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]  # fmt: skip


def library(lib_dir: Path, stem: str) -> Path:
    """The file of ``stem`` in ``lib_dir`` that the libraries load each other by:
    its soname (``libggml-cpu.so.0``), where the wheel holds one. llama-cpp-python's
    wheel holds ``libggml-cpu.so`` and ``libggml-cpu.so.0`` as two copies, not
    links, and a process that opens both has two CPU backends: a setting made
    in one is not seen by the one that computes."""
    versioned = sorted(lib_dir.glob(f"{stem}.so.*"), key=lambda p: (len(p.name), p.name))
    return versioned[0] if versioned else lib_dir / f"{stem}.so"


class Ggml:
    """The few ggml entry points the check calls, from the libraries llama-cpp-python
    loaded (the same build the worker decodes with)."""

    def __init__(self, lib_dir: Path) -> None:
        mode = getattr(os, "RTLD_GLOBAL", 0)
        base = ctypes.CDLL(str(library(lib_dir, "libggml-base")), mode=mode)
        ggml = ctypes.CDLL(str(library(lib_dir, "libggml")), mode=mode)
        cpu_path = library(lib_dir, "libggml-cpu")
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
        f = ctypes.c_float
        self.flash_attn_ext = fn(base, "ggml_flash_attn_ext", p, p, p, p, p, p, f, f, f)
        self.prec_set_acc = fn(base, "ggml_prec_set_acc", ctypes.c_bool, p, ctypes.c_int)
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
        self.floors = Floors.of(cpu)


class Floors:
    """The run-time floors of the CPU's row-count-picked kernels, in parkq's
    llama.cpp (tools/llamapatch/0003-cpu-run-time-tiled-floors.patch): the fewest
    rows that take the tiled K-quant product and the tiled flash attention (0:
    llama.cpp's own, from its environment or its default). The library is the
    one this process already loaded, so the values are the ones its llama.cpp
    computes with."""

    def __init__(self, cpu: ctypes.CDLL) -> None:
        i64 = ctypes.c_int64
        self._set_mm = cpu.ggml_cpu_set_tiled_mm_min_rows
        self._get_mm = cpu.ggml_cpu_get_tiled_mm_min_rows
        self._set_fa = cpu.ggml_cpu_set_fa_tiled_min_rows
        self._get_fa = cpu.ggml_cpu_get_fa_tiled_min_rows
        for setter in (self._set_mm, self._set_fa):
            setter.restype, setter.argtypes = None, [i64]
        for getter in (self._get_mm, self._get_fa):
            getter.restype, getter.argtypes = i64, []

    @classmethod
    def of(cls, cpu: ctypes.CDLL | None) -> Floors | None:
        """The floors of ``cpu`` (libggml-cpu), or None where it has none (stock)."""
        if cpu is None or not hasattr(cpu, "ggml_cpu_set_fa_tiled_min_rows"):
            return None
        return cls(cpu)

    @classmethod
    def load(cls, lib_dir: Path) -> Floors | None:
        """The floors of the CPU library in ``lib_dir`` (llama-cpp-python's), the
        copy its llama.cpp computes with (:func:`library`)."""
        path = library(lib_dir, "libggml-cpu")
        if not path.exists():
            return None
        return cls.of(ctypes.CDLL(str(path), mode=getattr(os, "RTLD_GLOBAL", 0)))

    def set(self, matmul: int, attention: int) -> None:
        self._set_mm(matmul)
        self._set_fa(attention)

    def get(self) -> tuple[int, int]:
        return int(self._get_mm()), int(self._get_fa())


class Device:
    """One ggml backend (the CPU, or the first GPU) and tensors allocated on it."""

    def __init__(self, ggml: Ggml, gpu: bool, threads: int) -> None:
        self.g = ggml
        self.gpu = gpu
        self.backend = ggml.init_by_type(_GPU if gpu else _CPU, None)
        if not self.backend and gpu:  # an integrated GPU is a device type of its own
            self.backend = ggml.init_by_type(_IGPU, None)
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
