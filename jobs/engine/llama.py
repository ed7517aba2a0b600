"""llama.cpp through llama-cpp-python: the only module that imports ``llama_cpp``.

:class:`Vocab` loads a model's vocabulary only (the web process uses it to
tokenize and to apply chat templates); :class:`LlamaEngine` loads the weights
and owns one context that the worker drives one step at a time.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import llama_cpp
import numpy as np
from llama_cpp import _internals, llama_chat_format

from jobs.engine.constraints import Constraint

__all__ = [
    "Device",
    "Engine",
    "EngineError",
    "LlamaEngine",
    "Mismatch",
    "NotRepeatable",
    "ProbeVerdict",
    "Vocab",
    "build_info",
    "device_key",
    "devices",
    "gpu_layers",
    "library_dir",
    "quantize_model",
    "reference_generate",
    "set_llama_extra_buffers",
]


#: Decode steps the batching probe compares at each of its checkpoints.
PROBE_STEPS = 4
#: The batching probe's time: it checks positions in increasing order, up to the
#: context a worker serves, and stops here (saying how far it got).
PROBE_SECONDS = 30.0
#: llama.cpp pads a sequence's KV cells to multiples of 256, and its kernels can
#: change at those lengths (seen on CUDA: 4 sequences per call agree with alone up
#: to position 511 and differ at 512): the probe's checkpoints straddle each one.
PROBE_STRIDE = 256


@dataclass(frozen=True)
class Mismatch:
    """Where a sequence decoded in a batch first got other logits than alone."""

    step: int
    seq: int
    position: int
    max_abs_diff: float


class EngineError(RuntimeError):
    """llama.cpp refused a step (e.g. ``llama_decode`` failed)."""


class NotRepeatable(EngineError):
    """The same step of one sequence, run twice, gave other logits: no park on this
    build can resume bit-exactly."""


@dataclass(frozen=True)
class ProbeVerdict:
    """What the batching probe found (:meth:`LlamaEngine.probe_invariance`)."""

    #: The most sequences one decode call may take, each getting its logits alone.
    size: int
    #: The positions checked: every checkpoint up to here agreed for ``size``.
    horizon: int
    #: The context a worker serves (positions per sequence).
    n_ctx: int
    #: For each size that differed, the first place it did.
    failed: dict[int, Mismatch]
    seconds: float

    @property
    def complete(self) -> bool:
        """Checked up to the end of the context (not stopped by the time budget)."""
        return self.horizon >= self.n_ctx - PROBE_STRIDE // 2 or self.size == 1

    def describe(self) -> str:
        reach = (f"positions checked up to {self.horizon} of {self.n_ctx}"
                 + ("" if self.complete else f" (stopped at {PROBE_SECONDS:.0f} s)"))  # fmt: skip
        bad = min(self.failed) if self.failed else None
        if bad is None:
            return f"{reach}, in {self.seconds:.1f} s"
        m = self.failed[bad]
        return (f"{bad} per call first differed at position {m.position} (sequence {m.seq}, "
                f"max {m.max_abs_diff:.3g}); {reach}, in {self.seconds:.1f} s")  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "horizon": self.horizon, "n_ctx": self.n_ctx,
                "seconds": round(self.seconds, 2),
                "failed": {str(k): vars(v) for k, v in self.failed.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProbeVerdict:
        failed = {int(k): Mismatch(**v) for k, v in dict(data.get("failed") or {}).items()}
        return cls(int(data["size"]), int(data["horizon"]), int(data["n_ctx"]), failed,
                   float(data.get("seconds", 0.0)))  # fmt: skip


class Engine(Protocol):
    """What the worker needs from an engine (a fake one serves unit tests)."""

    n_ctx: int
    n_vocab: int
    #: The most sequences :meth:`prefill` takes in one call.
    max_prefill: int

    def is_eog(self, token: int) -> bool: ...
    def constraint(self, grammar: str) -> Constraint: ...
    def token_bytes(self, token: int) -> bytes: ...
    def clear(self, seq: int = 0) -> None: ...
    def truncate(self, pos: int, seq: int = 0) -> None: ...
    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray: ...
    def decode(self, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]: ...
    def prefill(self, chunks: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]: ...
    def save_seq(self, seq: int = 0) -> bytes | memoryview: ...
    def load_seq(self, data: bytes | memoryview, seq: int = 0) -> None: ...


def _quiet() -> None:
    """Silence llama.cpp's own logging (it writes to stderr from C)."""
    llama_cpp.llama_log_set(_NULL_LOG, ctypes.c_void_p(0))


def _null_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


_NULL_LOG: Any = llama_cpp.llama_log_callback(_null_log)


def build_info() -> str:
    """llama.cpp's build and the CPU features it uses here (its system info line)."""
    info: bytes = llama_cpp.llama_print_system_info()
    return f"llama-cpp-python {llama_cpp.__version__}; " + info.decode(errors="replace")


def library_dir() -> Path:
    """The folder of the llama.cpp libraries this process loaded (``libllama.so``
    and its ggml libraries: ``LLAMA_CPP_LIB_PATH``'s, or llama-cpp-python's own)."""
    return Path(llama_cpp.llama_cpp._lib._name).parent


def quantize_model(source: str | Path, target: str | Path, ftype: str = "Q4_K_M") -> Path:
    """llama.cpp's own quantization of the model file ``source`` to ``ftype``
    (``LLAMA_FTYPE_MOSTLY_<ftype>``: K-quant mixes such as ``Q4_K_M`` included)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = len(os.sched_getaffinity(0))
    _quiet()
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(params)
    )
    if rc != 0:
        raise EngineError(f"llama_model_quantize returned {rc}")
    return Path(target)


@dataclass(frozen=True)
class Device:
    """A compute device llama.cpp's backends registered (``CUDA0``, ``CPU``...)."""

    name: str
    description: str
    kind: str  # "cpu", "gpu", "igpu", "accel"
    memory_bytes: int
    #: Free when asked (what the backend reports; 0 when it does not say).
    free_bytes: int = 0

    def describe(self) -> str:
        gib = f", {self.memory_bytes / 2**30:.0f} GiB" if self.kind != "cpu" else ""
        return f"{self.name} ({self.description}{gib})"


_DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


def devices() -> list[Device]:
    """Every device of llama.cpp's build here (ggml's backend registry)."""
    from llama_cpp._ggml import libggml

    lib: Any = libggml
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(dev))
        out.append(
            Device(
                name=(lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
                description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                kind=_DEVICE_KINDS[kind] if 0 <= kind < len(_DEVICE_KINDS) else str(kind),
                memory_bytes=int(total.value),
                free_bytes=int(free.value),
            )
        )
    return out


def gpu_layers(setting: int | None) -> int:
    """The ``n_gpu_layers`` llama.cpp is given for the setting: unset or -1 means
    every layer (-1) where llama.cpp can offload to a GPU, else 0."""
    if setting is None or setting < 0:
        return -1 if llama_cpp.llama_supports_gpu_offload() else 0
    return setting


def device_key(n_gpu_layers: int | None) -> str:
    """Where a model loaded with ``n_gpu_layers`` (the setting) would run, for
    cache keys: the GPU devices and the layer setting, or ``CPU``."""
    layers = gpu_layers(n_gpu_layers)
    gpus = [d.describe() for d in devices() if d.kind in ("gpu", "igpu")]
    if layers == 0 or not gpus:
        return "CPU"
    return f"{' + '.join(gpus)}; n_gpu_layers {layers}"


def set_llama_extra_buffers(on: bool) -> None:
    """Make llama-cpp-python's own ``Llama`` (and its server) in this process load
    models with extra buffer types ``on`` or off: the bench's peers then run the
    same kernels as parkq's engine. ``Llama`` has no parameter for it."""
    from llama_cpp import llama_cpp as low_level

    default = llama_cpp.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = on
        return p

    low_level.llama_model_default_params = params


def reference_generate(
    model: str,
    prompt: str,
    tokens: int,
    n_ctx: int,
    n_batch: int,
    n_threads: int,
    temperature: float = 0.0,
) -> tuple[float, float]:
    """llama-cpp-python's own loop (``Llama.generate``): what the benchmarks
    compare parkq against; greedy, or at ``temperature`` over the whole
    distribution (top_k 0, top_p 1, min_p 0). Returns (seconds to the first
    token, seconds for the ``tokens - 1`` after it)."""
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                          n_threads_batch=n_threads, verbose=False)  # fmt: skip
    ids = llm.tokenize(prompt.encode())
    if temperature > 0:
        draws = llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, reset=True)
    else:
        draws = llm.generate(ids, temp=0.0, top_k=1, reset=True)
    t0 = first = time.perf_counter()
    for n, _ in enumerate(draws, start=1):
        if n == 1:
            first = time.perf_counter()
        if n >= tokens:
            break
    rest = time.perf_counter() - first
    llm.close()
    return first - t0, rest


def _load_model(
    path: str, vocab_only: bool, extra_buffers: bool = True, n_gpu_layers: int = 0
) -> _internals.LlamaModel:
    _quiet()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = 0 if vocab_only else n_gpu_layers
    # Extra buffer types repack weights for the CPU's fastest kernels (AMX, AVX-512
    # repacks); on some machines those kernels crash: jobs/engine/kernels.py decides.
    params.use_extra_bufts = extra_buffers
    return _internals.LlamaModel(path_model=path, params=params, verbose=False)


class Vocab:
    """Tokenizer, detokenizer and chat template of one GGUF model."""

    def __init__(
        self,
        path: str,
        chat_format: str | None = None,
        *,
        vocab_only: bool = True,
        extra_buffers: bool = True,
        n_gpu_layers: int = 0,
    ):
        self.model = _load_model(path, vocab_only, extra_buffers, n_gpu_layers)
        self.path = path
        self.extra_buffers = extra_buffers
        self._vocab = self.model.vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(self.model.n_ctx_train())
        self.bos = int(self.model.token_bos())
        self.eos = int(self.model.token_eos())
        self.add_bos = bool(self.model.add_bos_token())
        self.metadata = self.model.metadata()
        self._lock = threading.Lock()
        self._piece_cache: dict[int, bytes] = {}
        self._grammar_tokenizer: Any = None
        self._control_texts: tuple[frozenset[str], frozenset[str], frozenset[str]] | None = None
        self._formatter = self._chat_formatter(chat_format)

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]:
        bos = self.add_bos if add_bos is None else add_bos
        data = text.encode()
        # One pass with room for every token (llama-cpp-python's own sizes its buffer
        # by the training context and tokenizes a longer text twice). No lock:
        # llama.cpp's tokenizer only reads the vocabulary, and ctypes lets go of the
        # GIL, so a long prompt holds up no other request's tokenization.
        room = 2 * len(data) + 8
        while True:
            buf = (llama_cpp.llama_token * room)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, room, bos, special)
            if n >= 0:
                return buf[:n]
            room = -n

    def piece(self, token: int) -> bytes:
        """A token's bytes with control tokens spelled out (uncached: for digests)."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return bytes(buf.raw[: max(n, 0)])

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token's piece (control tokens give b'')."""
        piece = self._piece_cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(256)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = bytes(buf.raw[: max(n, 0)])
            self._piece_cache[token] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def constraint(self, grammar: str) -> Constraint:
        """A matcher of ``grammar`` (see jobs/engine/constraints.py) over this vocabulary.
        The grammar engine's view of the vocabulary is built at the first call
        (about 3 s for a 262k-token vocabulary) and kept."""
        with self._lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = self._grammar_vocabulary()
        return Constraint(self._grammar_tokenizer, grammar, self.n_vocab)

    def _grammar_vocabulary(self) -> Any:
        """The vocabulary as the grammar engine sees it: each token's bytes as
        parkq streams them (:meth:`token_bytes`); a token that streams nothing
        (control, unknown) is marked special (a 0xFF prefix), so no grammar
        can count it as text."""
        from llguidance import LLTokenizer

        tokens = []
        for t in range(self.n_vocab):
            text = self.token_bytes(t)
            tokens.append(text if text else b"\xff" + (self.piece(t) or b"<special>"))
        eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
        tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        return LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]  # not in its stubs
            tokens=tokens, vocab_ptr=self._vocab, tokenize_fptr=tokenize, eos_token=eog
        )

    def is_control(self, token: int) -> bool:
        """Whether special-token parsing makes this token (control, user-defined, unknown)."""
        kinds = (
            llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
            | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
            | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
        )
        return bool(llama_cpp.llama_vocab_get_attr(self._vocab, token) & kinds)

    def control_texts(self) -> frozenset[str]:
        """The spellings that only special-token parsing turns into their token
        (control and unknown tokens; user-defined ones, such as runs of spaces, are
        parsed in plain text too): what no client text may produce."""
        return self._controls()[0]

    def control_strips(self) -> tuple[frozenset[str], frozenset[str]]:
        """The control spellings that strip the whitespace before them, and those
        that strip the whitespace after them (llama.cpp's LSTRIP and RSTRIP)."""
        _, left, right = self._controls()
        return left, right

    def _controls(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        if self._control_texts is None:
            kinds = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            found: tuple[set[str], set[str], set[str]] = (set(), set(), set())
            for t in range(self.n_vocab):
                attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
                if not attr & kinds:
                    continue
                piece = self.piece(t).decode("utf-8", errors="replace")
                if not piece:
                    continue
                found[0].add(piece)
                if attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                    found[1].add(piece)
                if attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
                    found[2].add(piece)
            self._control_texts = (frozenset(found[0]), frozenset(found[1]), frozenset(found[2]))
        return self._control_texts

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]:
        """Apply the chat template: the prompt text and the template's stop strings."""
        if self._formatter is None:
            raise ValueError("this model has no chat template; set PARKQ_CHAT_FORMAT")
        response = self._formatter(messages=messages, tools=tools)
        stop = response.stop
        stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        return response.prompt, stops

    def _chat_formatter(self, name: str | None) -> Any:
        if name is None:
            template = self.metadata.get("tokenizer.chat_template")
            if template is None:
                return None
            eos = self.model.token_get_text(self.eos) if self.eos != -1 else ""
            bos = self.model.token_get_text(self.bos) if self.bos != -1 else ""
            return llama_chat_format.Jinja2ChatFormatter(
                template=template, eos_token=eos, bos_token=bos, stop_token_ids=[self.eos]
            )
        handler = llama_chat_format.LlamaChatCompletionHandlerRegistry()  # type: ignore[no-untyped-call]
        try:
            completion_handler = handler.get_chat_completion_handler_by_name(name)
        except ValueError:
            raise ValueError(f"unknown chat format {name!r}") from None
        # Registered formats wrap a ChatFormatter; take it back out of the closure.
        for cell in getattr(completion_handler, "__closure__", None) or ():
            value = cell.cell_contents
            if callable(value) and getattr(value, "__name__", "").startswith("format_"):
                return value
        raise ValueError(f"chat format {name!r} has no plain formatter")


class LlamaEngine(Vocab):
    """A loaded model with one context, decoded one batch at a time.

    The context holds ``n_seq_max`` sequences of ``n_ctx`` positions each, in
    KV buffers of their own (``kv_unified`` off): a sequence's cells never move
    because of another one, and :meth:`decode` of one token for each of several
    sequences gives each the logits it would get alone (docs/design.md, "Exactness"; the
    tests check it on every kernel path parkq uses).
    """

    def __init__(
        self,
        path: str,
        *,
        n_ctx: int = 4096,
        n_batch: int = 256,
        n_threads: int | None = None,
        n_seq_max: int = 1,
        chat_format: str | None = None,
        extra_buffers: bool = True,
        n_gpu_layers: int | None = None,
        exact: bool = True,
        flash_attn: bool = False,
        prompt_floors: bool = False,
    ) -> None:
        #: Kernels that give a sequence the same logits alone and beside others
        #: (False: llama.cpp's fastest, flash attention included).
        self.exact = exact
        #: Prompt calls on the tiled paths, decode calls on the one-row paths
        #: (:meth:`_kernels_for`; needs parkq's llama.cpp, patch 3).
        self._floors = None
        if prompt_floors:
            from jobs.engine.ggmlapi import Floors

            self._floors = Floors.load(library_dir())
            if self._floors is None:
                raise ValueError("this llama.cpp has no run-time kernel floors (parkq's "
                                 "patch 0003: python -m tools.llamapatch ensure)")  # fmt: skip
        #: Flash attention in exact mode (where the worker's op check certified
        #: it, with llama.cpp's KV split off: jobs/engine/kernels.py).
        self.flash_attn = flash_attn or not exact
        #: The n_gpu_layers llama.cpp was given (-1: all) (see :func:`gpu_layers`).
        self.n_gpu_layers = gpu_layers(n_gpu_layers)
        super().__init__(path, chat_format, vocab_only=False, extra_buffers=extra_buffers,
                         n_gpu_layers=self.n_gpu_layers)  # fmt: skip
        self.n_layer = int(llama_cpp.llama_model_n_layer(self.model.model))
        params = llama_cpp.llama_context_default_params()
        per_seq = n_ctx or self.n_ctx_train
        params.n_ctx = per_seq * n_seq_max
        # One step decodes a token of every sequence, and one prefill call takes a
        # chunk of each (:meth:`prefill`): the batch holds them all. llama.cpp
        # runs a call in passes of at most n_ubatch tokens, the chunk size.
        params.n_ubatch = max(n_batch, n_seq_max)
        params.n_batch = params.n_ubatch * n_seq_max
        params.n_seq_max = n_seq_max
        params.kv_unified = False
        params.swa_full = True
        # Exact mode takes flash attention only when asked (``flash_attn``): for
        # one sequence decoded alone with 512 or more KV cells, stock llama.cpp's
        # CPU flash attention splits the cells into one chunk per thread and
        # merges the partial sums, which rounds otherwise than the unsplit path a
        # batch of sequences takes (and otherwise for each thread count); parkq's
        # build can turn the split off (GGML_CPU_FA_SPLIT_KV=0). The plain
        # attention gives a sequence the same logits alone, beside others and on
        # any number of threads (tests/integration/test_batching.py).
        fa = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)  # fmt: skip
        # PARKQ_EXACT off: the fastest llama.cpp picks.
        params.flash_attn_type = (fa[1] if flash_attn else fa[0]) if exact else fa[2]
        # llama.cpp's default (4 threads) oversubscribes small machines: use the cores.
        threads = n_threads or len(os.sched_getaffinity(0))
        params.n_threads = threads
        params.n_threads_batch = threads
        self.n_threads = threads
        self.ctx = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        #: Positions per sequence.
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx.ctx)) // n_seq_max
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self._capacity = max(n_batch, n_seq_max)
        #: The most sequences :meth:`decode` puts in one call, and for each number
        #: of sequences the sizes of its calls (see :meth:`probe_batching`).
        self.max_batch = 1
        #: The most sequences :meth:`prefill` puts in one call (1: each prompt
        #: alone; see :meth:`plan_prefill`).
        self.max_prefill = 1
        self._splits: list[list[int]] = []
        self._batch = llama_cpp.llama_batch_init(int(params.n_batch), 0, 1)
        self._memory = llama_cpp.llama_get_memory(self.ctx.ctx)

    @property
    def layers_on_gpu(self) -> int:
        """Repeating layers llama.cpp keeps on the GPU (the output layer goes
        too when ``n_gpu_layers`` exceeds them)."""
        if self.n_gpu_layers < 0:
            return self.n_layer
        return min(self.n_gpu_layers, self.n_layer)

    @property
    def device(self) -> str:
        """Where the layers run: ``CPU``, or the GPU devices that hold them. Part of
        the model identity and of the probe caches' keys: logits computed on one
        device are not those of another, bit for bit."""
        gpus = [d for d in devices() if d.kind in ("gpu", "igpu")]
        if self.layers_on_gpu == 0 or not gpus:
            return "CPU"
        where = " + ".join(d.describe() for d in gpus)
        if 0 <= self.n_gpu_layers <= self.n_layer:  # the output layer stays on the CPU
            return (f"{where}: {self.layers_on_gpu} of {self.n_layer} layers, the rest and "
                    "the output layer on CPU")  # fmt: skip
        return where

    def placement(self) -> str:
        """Where the layers went, for the worker's log."""
        gpus = [d for d in devices() if d.kind in ("gpu", "igpu")]
        if not gpus:
            return f"all {self.n_layer} layers on the CPU (llama.cpp has no GPU backend here)"
        if self.layers_on_gpu == 0:
            return f"all {self.n_layer} layers on the CPU (PARKQ_N_GPU_LAYERS=0)"
        output = " and the output layer" if self.n_gpu_layers < 0 or (
            self.n_gpu_layers > self.n_layer) else ""  # fmt: skip
        return (f"{self.layers_on_gpu} of {self.n_layer} layers{output} on "
                f"{' + '.join(d.describe() for d in gpus)}")  # fmt: skip

    def close(self) -> None:
        if self._floors is not None:  # process-wide: given back for whoever comes next
            self._kernels_for(False)
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.ctx.close()  # type: ignore[no-untyped-call]
        self.model.close()  # type: ignore[no-untyped-call]

    def clear(self, seq: int = 0) -> None:
        """Forget a sequence's positions (every sequence's with ``seq`` -1)."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)

    def truncate(self, pos: int, seq: int = 0) -> None:
        """Forget positions ``pos`` and later of ``seq``."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq, pos, -1)

    @property
    def prompt_floors(self) -> bool:
        """Whether prompt calls run on the tiled paths (:meth:`_kernels_for`)."""
        return self._floors is not None

    def _kernels_for(self, prompt: bool) -> None:
        """Set the CPU's row floors for the next call: a prompt call (two or more
        tokens of a sequence) takes the tiled product and the tiled flash
        attention at every size (floors 1), whose rows do not depend on how many
        share the call, so that prompts batched together, or split into passes
        by llama.cpp, give each row its value alone; a decode call (one token
        per sequence) takes llama.cpp's floors from its environment (the worker
        sets them: jobs/engine/kernels.py), so every decode width takes the
        one-row paths. Each kind of call so runs one set of kernels whatever
        shares it. Without floors (stock llama.cpp, or not asked) nothing."""
        if self._floors is None:
            return
        # Set at every call (two stores): the floors are the process's, and
        # nothing else may have left them as this engine last set them.
        self._floors.set(*((1, 1) if prompt else (0, 0)))

    def plan_prefill(self, width: int) -> None:
        """Let :meth:`prefill` put up to ``width`` sequences' chunks in one call
        (the worker's check certified it, or PARKQ_EXACT is off)."""
        self.max_prefill = max(1, min(width, self.n_seq_max))

    def prefill(self, chunks: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """Prompt chunks of several sequences in one call: ``(seq, tokens, pos)``
        each, at most :attr:`max_prefill` of them and ``n_batch`` tokens each,
        two tokens or more each where the floors are set (a lone token is a
        decode call's: :meth:`eval`); the logits after each chunk's last token,
        in order. Listed by increasing sequence id, as :meth:`decode` does."""
        n = len(chunks)
        total = sum(len(tokens) for _, tokens, _ in chunks)
        if not 0 < n <= self.max_prefill or any(
            not 0 < len(tokens) <= self.n_batch for _, tokens, _ in chunks
        ):
            raise ValueError(f"prefill takes 1..{self.max_prefill} chunks of 1..{self.n_batch} "
                             f"tokens, got {[len(t) for _, t, _ in chunks]}")  # fmt: skip
        if n == 1:
            seq, tokens, pos = chunks[0]
            return [self.eval(tokens, pos, seq)]
        if self._floors is not None and any(len(tokens) < 2 for _, tokens, _ in chunks):
            raise ValueError("a one-token chunk is a decode call's (eval)")
        self._kernels_for(True)
        order = sorted(range(n), key=lambda i: chunks[i][0])
        b = self._batch
        b.n_tokens = total
        last: dict[int, int] = {}
        i = 0
        for c in order:
            seq, tokens, pos = chunks[c]
            for k, tok in enumerate(tokens):
                b.token[i] = tok
                b.pos[i] = pos + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = k == len(tokens) - 1
                i += 1
            last[c] = i - 1
        rc = llama_cpp.llama_decode(self.ctx.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        out = []
        for c in range(n):
            ptr = llama_cpp.llama_get_logits_ith(self.ctx.ctx, last[c])
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out

    def prefill_lengths(self, width: int) -> list[int]:
        """The prompt lengths :meth:`probe_prefill` takes: with chunks of
        ``n_batch``, llama.cpp splits their shared calls into every kind of pass
        it makes (one row per sequence beside others, sequences of unequal
        chunks, a lone sequence's long remainder, two-token chunks)."""
        nb = self.n_batch
        base = [nb + nb // 2 + 1, 2, nb + 1, 37, nb, 3, 17, 65]
        out = [base[i] if i < len(base) else 5 + 11 * i for i in range(width)]
        return [max(2, min(x, self.n_ctx - 1)) for x in out]

    def probe_prefill(self, width: int) -> tuple[bool, str]:
        """End to end, what the op check of prompt calls vouches for op by op:
        ``width`` prompts (:meth:`prefill_lengths`) prefilled each alone, then
        together, the chunks of one index in one call; whether every logit
        after each prompt agreed bit for bit, and what differed. Clears every
        sequence."""
        width = max(1, min(width, self.n_seq_max))
        lengths = self.prefill_lengths(width)

        def chunks(s: int) -> list[tuple[int, list[int], int]]:
            out = []
            for a in range(0, lengths[s], self.n_batch):
                end = min(lengths[s], a + self.n_batch)
                out.append((s, [self._probe_token(s, p) for p in range(a, end)], a))
            return out

        self.clear(-1)
        alone = []
        for s in range(width):
            alone.append([self.eval(t, pos, s) for _, t, pos in chunks(s)][-1])
            self.clear(s)
        kept, self.max_prefill = self.max_prefill, width
        got: dict[int, np.ndarray] = {}
        try:
            for c in range(max(len(chunks(s)) for s in range(width))):
                group = [chunks(s)[c] for s in range(width) if c < len(chunks(s))]
                ones = [g for g in group if len(g[1]) == 1]
                wide = [g for g in group if len(g[1]) > 1]
                results = [self.eval(t, pos, s) for s, t, pos in ones]
                results += self.prefill(wide) if wide else []
                for (s, _, _), out in zip(ones + wide, results, strict=True):
                    got[s] = out
        finally:
            self.max_prefill = kept
            self.clear(-1)
        for s in range(width):
            if not np.array_equal(alone[s], got[s]):
                diff = float(np.max(np.abs(alone[s] - got[s])))
                why = (f"a prompt of {lengths[s]} tokens beside prompts of {lengths} got "
                       f"other logits than alone (max difference {diff:.3g})")  # fmt: skip
                return False, why
        return True, f"{width} prompts of {min(lengths)} to {max(lengths)} tokens as alone"

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        """Decode ``tokens`` at positions ``pos...`` of ``seq``; logits of the last one."""
        n = len(tokens)
        if not 0 < n <= self.n_batch:
            raise ValueError(f"eval takes 1..{self.n_batch} tokens, got {n}")
        self._kernels_for(n > 1)
        b = self._batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = False
        b.logits[n - 1] = True
        rc = llama_cpp.llama_decode(self.ctx.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        ptr = llama_cpp.llama_get_logits_ith(self.ctx.ctx, n - 1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _probe_token(self, seq: int, pos: int) -> int:
        """The probe's text for ``seq`` at ``pos``: one sentence, each sequence
        starting elsewhere in it."""
        text = self._probe_text
        return text[(7 * seq + pos) % len(text)]

    @property
    def _probe_text(self) -> list[int]:
        text = getattr(self, "_probe_text_ids", None)
        if text is None:
            text = self.tokenize("parkq checks that batching changes nothing in any sequence. ")
            self._probe_text_ids = text
        return text

    def _probe_checkpoints(self) -> list[int]:
        """Where the probe's steps start: early, then across every multiple of
        PROBE_STRIDE the context reaches, then its end."""
        last = self.n_ctx - PROBE_STEPS - 4
        points = [p for p in (24,) if p <= last]
        points += [m - 2 for m in range(PROBE_STRIDE, last + 4, PROBE_STRIDE) if m - 2 <= last]
        if points and last - points[-1] > PROBE_STRIDE // 2:
            points.append(last)
        return points

    def _probe_fill(self, seq: int, have: int, want: int) -> None:
        """Make ``seq`` hold its probe text at positions 0..want-1."""
        if want <= have:
            self.truncate(want, seq)
            return
        for start in range(have, want, self.n_batch):
            end = min(want, start + self.n_batch)
            self.eval([self._probe_token(seq, p) for p in range(start, end)], start, seq)

    def _probe_alone(self, seq: int, length: int) -> list[np.ndarray]:
        """PROBE_STEPS one-token calls of ``seq`` from ``length`` (its text fed,
        not sampled); leaves the sequence at ``length``."""
        out = [self.eval([self._probe_token(seq, p)], p, seq)
               for p in range(length, length + PROBE_STEPS)]  # fmt: skip
        self.truncate(length, seq)
        return out

    def _probe_together(
        self, seqs: Sequence[int], length: dict[int, int], alone: dict[int, list[np.ndarray]]
    ) -> Mismatch | None:
        """PROBE_STEPS calls of ``seqs`` together; the first logits that differ
        from ``alone``. Leaves every sequence at its length."""
        miss = None
        for step in range(PROBE_STEPS):
            calls = [(s, self._probe_token(s, length[s] + step), length[s] + step) for s in seqs]
            for s, got in zip(seqs, self._decode(calls), strict=True):
                want = alone[s][step]
                if miss is None and not np.array_equal(got, want):
                    diff = float(np.max(np.abs(got - want)))
                    miss = Mismatch(step, s, length[s] + step, diff)
            if miss is not None:
                break
        for s in seqs:
            self.truncate(length[s], s)
        return miss

    def probe_invariance(
        self,
        limit: int | None = None,
        seconds: float = PROBE_SECONDS,
        every_size: bool = False,
        clock: Any = time.monotonic,
    ) -> ProbeVerdict:
        """How many sequences (up to ``limit``) one decode call may take with every
        sequence getting, bit for bit, the logits it gets alone, over the whole
        context a worker serves.

        At each checkpoint (:meth:`_probe_checkpoints`: short, then across every
        multiple of 256 cells, then the context's end) every probe sequence is
        filled with its text to about that length, runs PROBE_STEPS steps alone,
        and then with others in each size still certified, in two arrangements:
        the lowest sequence ids, of about the same length, and the highest
        (parked ones' included), which hold the one sequence that stays short
        (a short sequence beside long ones: a call takes its KV length from the
        longest). The first checkpoint spreads the lengths. A size
        that differs anywhere is not certified, nor any larger one (``every_size``:
        the larger ones are still checked, for the report). Some kernels change
        with the cells' length (CUDA at 512), others only now and then (a rounding
        that flips an activation's quantized value: on a CPU, the demo model's
        logits changed with 8 sequences a few steps past 400 positions).

        A step that differs when one sequence runs it twice alone raises
        :class:`NotRepeatable`. Checkpoints stop after ``seconds``; the verdict
        says how far it got. Clears every sequence."""
        limit = max(1, min(limit or self.n_seq_max, self.n_seq_max))
        ids = sorted(set(range(limit)) | set(range(self.n_seq_max - limit, self.n_seq_max)))
        self.clear(-1)
        t0 = clock()
        length = dict.fromkeys(ids, 0)
        failed: dict[int, Mismatch] = {}
        horizon = 0
        points = self._probe_checkpoints()
        if not points:  # a context too short to check: one sequence per call
            return ProbeVerdict(1, 0, self.n_ctx, {}, 0.0)
        short = ids[-1] if len(ids) > 1 else None
        for n, point in enumerate(points):
            if n and clock() - t0 > seconds:
                break
            for i, s in enumerate(ids):
                # The first checkpoint spreads the lengths; the others keep them
                # together, but for the highest id, which stays short: a call
                # takes its KV length from its longest sequence, so a short one
                # beside long ones is a case of its own.
                if n == 0:
                    want = min(point + 16 * i, points[-1])
                elif s == short:
                    want = points[0] + n % PROBE_STEPS
                else:
                    want = point - i % 2
                self._probe_fill(s, length[s], want)
                length[s] = want
            alone = {s: self._probe_alone(s, length[s]) for s in ids}
            again = self._probe_alone(ids[0], length[ids[0]])
            for step, (a, b) in enumerate(zip(alone[ids[0]], again, strict=True)):
                if not np.array_equal(a, b):
                    self.clear(-1)
                    raise NotRepeatable(
                        f"sequence {ids[0]} got other logits when the same step ran twice "
                        f"(position {length[ids[0]] + step}, max difference "
                        f"{float(np.max(np.abs(a - b))):.3g})"
                    )
            for size in range(2, limit + 1):
                if size in failed or (not every_size and failed and size > min(failed)):
                    continue
                for group in (ids[:size], ids[-size:]):
                    miss = self._probe_together(group, length, alone)
                    if miss is not None:
                        failed[size] = miss
                        break
            horizon = max(length.values()) + PROBE_STEPS
            if not every_size and failed and min(failed) == 2:
                break  # nothing left to certify: only repeatability, checked
        self.clear(-1)
        size = min(failed, default=limit + 1) - 1
        return ProbeVerdict(max(size, 1), horizon, self.n_ctx, failed, clock() - t0)

    def invariant_batch_size(self, limit: int | None = None) -> int:
        """:meth:`probe_invariance`'s size."""
        return self.probe_invariance(limit).size

    def plan_batching(self, invariant: int) -> None:
        """Time one decode call of each size up to ``invariant`` and plan, for each
        number of sequences, the split into calls that takes least time
        (:meth:`decode` follows it). Clears every sequence."""
        invariant = max(1, min(invariant, self.n_seq_max))
        cost = {k: self._time_step(k) for k in range(1, invariant + 1)}
        best: list[tuple[float, list[int]]] = [(0.0, [])]
        for n in range(1, self.n_seq_max + 1):
            best.append(
                min(
                    ((best[n - k][0] + cost[k], [*best[n - k][1], k]) for k in cost if k <= n),
                    key=lambda c: c[0],
                )
            )
        self._splits = [sorted(sizes, reverse=True) for _, sizes in best]
        self._planned = [seconds for seconds, _ in best]
        self.max_batch = invariant
        self.clear(-1)

    def probe_batching(self, limit: int | None = None) -> int:
        """:meth:`invariant_batch_size`, then :meth:`plan_batching`; the size."""
        size = self.invariant_batch_size(limit)
        self.plan_batching(size)
        return size

    def speedup(self, n: int) -> float:
        """Tokens per second of ``n`` sequences stepping together over one alone,
        by the timings :meth:`plan_batching` measured (1.0 before it ran)."""
        planned = getattr(self, "_planned", None)
        if not planned or n >= len(planned) or not planned[n]:
            return 1.0
        return float(n * planned[1] / planned[n])

    def splits_described(self) -> str:
        return ", ".join(
            f"{n}: {'+'.join(map(str, s))}" for n, s in enumerate(self._splits) if n > 1
        )

    def _time_step(self, size: int, repeat: int = 3) -> float:
        """Best-of-``repeat`` seconds of one decode call of ``size`` sequences."""
        self.clear(-1)
        token = max(self.bos, 0)
        for s in range(size):
            self.eval([token], 0, s)
        best = float("inf")
        for i in range(repeat):
            t0 = time.perf_counter()
            if size == 1:
                self.eval([token], 1 + i, 0)
            else:
                self._decode([(s, token, 1 + i) for s in range(size)])
            best = min(best, time.perf_counter() - t0)
        return best

    def decode(self, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        """One decode step of several sequences: ``(seq, token, pos)`` each; the
        logits after each, in order. Split into calls as :meth:`probe_batching`
        planned (one call each until it has run).

        Each call lists its sequences by increasing id: with a KV stream per
        sequence, llama.cpp puts into one pass (ubatch) only sequences whose ids
        follow each other in the batch (``split_equal``, sequential), so the
        same eight sequences listed as 3, 0, 5, 1... cost several passes, as
        much as several calls."""
        n = len(steps)
        sizes = self._splits[n] if n < len(self._splits) else [1] * n
        order = sorted(range(n), key=lambda i: steps[i][0])
        out: list[np.ndarray | None] = [None] * n
        start = 0
        for size in sizes:
            part = order[start : start + size]
            start += size
            if len(part) == 1:
                seq, tok, pos = steps[part[0]]
                out[part[0]] = self.eval([tok], pos, seq)
            else:
                for i, logits in zip(part, self._decode([steps[i] for i in part]), strict=True):
                    out[i] = logits
        done = [x for x in out if x is not None]
        assert len(done) == n, "every step gets its logits"
        return done

    def _decode(self, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        n = len(steps)
        if not 0 < n <= self._capacity:
            raise ValueError(f"decode takes 1..{self._capacity} steps, got {n}")
        self._kernels_for(False)
        b = self._batch
        b.n_tokens = n
        for i, (seq, tok, pos) in enumerate(steps):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = True
        rc = llama_cpp.llama_decode(self.ctx.ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc}")
        out = []
        for i in range(n):
            ptr = llama_cpp.llama_get_logits_ith(self.ctx.ctx, i)
            out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return out

    def save_seq(self, seq: int = 0) -> memoryview:
        """The KV state of one sequence, not the logits (docs/design.md, "What
        llama.cpp does here")."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx.ctx, seq)
        # Uninitialised memory that llama.cpp writes straight into: one copy, no zero-fill.
        out = np.empty(size, dtype=np.uint8)
        n = llama_cpp.llama_state_seq_get_data(
            self.ctx.ctx, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq
        )
        return out[:n].data

    def load_seq(self, data: bytes | memoryview, seq: int = 0) -> None:
        view = np.frombuffer(data, dtype=np.uint8)
        ptr = view.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_seq_set_data(self.ctx.ctx, ptr, len(view), seq) == 0:
            raise EngineError("llama_state_seq_set_data failed")
