"""A tiny, deterministic, random-weight llama GGUF for tests and demos.

2 layers, 64-dim, f32 (or its matrices quantized to Q8_0 or Q4_0, so the
quantized and repacked kernels that real models take are exercised), a
~600-token SentencePiece-style vocabulary with the 256 byte tokens, so any
UTF-8 round-trips through tokenize/detokenize. The same
seed always writes the same file, and greedy decoding of it is reproducible.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

__all__ = [
    "CHAT_TEMPLATE",
    "GEMMA_CONTROL_TOKENS",
    "GEMMA_TEMPLATE",
    "QUANTS",
    "SHAPES",
    "Shape",
    "write_kquant_model",
    "write_shaped_model",
    "write_test_model",
]

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX_TRAIN = 4096

#: Weight types ``write_test_model`` can write: (tensor type of the matrices, file type).
#: K-quants need rows of 256 values; this model's rows are 64 or 128 wide.
QUANTS: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}

#: A plain role-tagged template, so chat requests exercise the model's own template.
#: Gemma's published chat template, whose turns are control tokens (for a tiny
#: model that speaks in turns as real chat models do).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA_CONTROL_TOKENS = ("<start_of_turn>", "<end_of_turn>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "you",
    "was",
    "with",
    "on",
    "as",
    "have",
    "be",
    "at",
    "not",
    "this",
    "but",
    "by",
    "from",
    "they",
    "we",
    "say",
    "her",
    "she",
    "or",
    "an",
    "will",
    "my",
    "one",
    "all",
    "would",
    "there",
    "their",
    "what",
    "so",
    "up",
    "out",
    "if",
    "about",
    "who",
    "get",
    "which",
    "go",
    "me",
    "when",
    "make",
    "can",
    "like",
    "time",
    "no",
    "just",
    "him",
    "know",
    "take",
    "people",
    "into",
    "year",
    "your",
    "good",
    "some",
    "could",
    "them",
    "see",
    "other",
    "than",
    "then",
    "now",
    "look",
    "only",
    "come",
    "its",
    "over",
    "think",
    "also",
    "hello",
    "world",
    "park",
    "queue",
    "token",
    "model",
    "job",
    "long",
    "short",
    "answer",
    "question",
]


def _vocab(
    extra_words: Sequence[str] = (), control: Sequence[str] = ()
) -> tuple[list[bytes], list[float], list[int]]:
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>", *(c.encode() for c in control)]
    scores: list[float] = [0.0] * len(tokens)
    types: list[int] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.CONTROL] * len(control)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    pieces: list[str] = ["\u2581"]
    pieces += list(string.ascii_letters + string.digits + string.punctuation)
    pieces += ["\u2581" + c for c in string.ascii_lowercase]
    # Every prefix of each word piece, so that SentencePiece's pairwise merges reach it.
    words = [*_WORDS, *extra_words]
    pieces += ["\u2581" + w[:n] for w in words for n in range(1, len(w) + 1)]
    seen: set[str] = set()
    for piece in pieces:
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece.encode())
        # SentencePiece merges prefer higher scores: longer pieces win.
        scores.append(-1000.0 + 10.0 * len(piece))
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


@dataclass(frozen=True)
class Shape:
    """The dimensions of a random-weight model of the llama architecture."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int  # padded with filler tokens up to this size
    n_ctx_train: int


#: Real shapes for measuring speed (random weights, written straight in their
#: quantized form, so a 1 B model takes seconds): ``small`` for a CPU dry run,
#: ``1b`` the shape of Llama 3.2 1B (tied embeddings, 128,256 tokens).
SHAPES: dict[str, Shape] = {
    "small": Shape(n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=768, n_vocab=32_000,
                   n_ctx_train=8192),
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=128_256,
                n_ctx_train=8192),
}  # fmt: skip

#: Bytes per block of 32 weights and the spread of a block's quantized values
#: (uniform random bytes), for the quantized types a shaped model can take.
_BLOCK = {"q8_0": (34, 73.0), "q4_0": (18, 4.6)}


def _random_quantized(rng: np.random.Generator, rows: int, cols: int, quant: str,
                      std: float) -> np.ndarray:  # fmt: skip
    """Random weights of standard deviation ``std`` in ``quant``'s block layout
    (an f16 scale, then the packed values), as GGUFWriter takes raw data."""
    size, spread = _BLOCK[quant]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(std / spread).tobytes(), dtype=np.uint8)
    blocks[:, :, 0:2] = scale
    return blocks.reshape(rows, (cols // 32) * size)


def _writer(
    path: Path,
    name: str,
    dims: Shape,
    file_type: gguf.LlamaFileType,
    vocab: tuple[list[bytes], list[float], list[int]],
    chat_template: str,
    rope_freq_base: float | None = None,
) -> gguf.GGUFWriter:
    """A GGUF writer with a llama model's metadata and SentencePiece vocabulary."""
    tokens, scores, types = vocab
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(dims.n_ctx_train)
    w.add_embedding_length(dims.n_embd)
    w.add_feed_forward_length(dims.n_ff)
    w.add_block_count(dims.n_layer)
    w.add_head_count(dims.n_head)
    w.add_head_count_kv(dims.n_head_kv)
    w.add_rope_dimension_count(dims.n_embd // dims.n_head)
    if rope_freq_base is not None:
        w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(file_type)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(chat_template)
    return w


def write_kquant_model(path: str | Path, seed: int = 0) -> Path:
    """The ``small`` shape quantized by llama.cpp itself to Q4_K_M: Q4_K and Q6_K
    products, the K-quant kernels real models take (llama.cpp's tiled CPU product
    among them, which the 64-dim test model's rows are too short for)."""
    from jobs.engine.llama import quantize_model

    path = Path(path)
    source = write_shaped_model(path.with_suffix(".q8_0.gguf"), "small", "q8_0", seed)
    try:
        return quantize_model(source, path, "Q4_K_M")
    finally:
        source.unlink()


def write_shaped_model(path: str | Path, shape: str, quant: str = "q8_0", seed: int = 0) -> Path:
    """A random-weight model of a real shape (``SHAPES``), weights ``q8_0`` or
    ``q4_0``: for speed and exactness on real kernels, not for text."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, not {shape!r}")
    if quant not in _BLOCK:
        raise ValueError(f"a shaped model's quant must be one of {', '.join(_BLOCK)}")
    dims = SHAPES[shape]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    filler = dims.n_vocab - len(tokens)
    tokens += [f"\u2581w{i:06d}".encode() for i in range(filler)]
    scores += [-2000.0] * filler
    types += [gguf.TokenType.NORMAL] * filler
    qtype, file_type = QUANTS[quant]
    head_dim = dims.n_embd // dims.n_head
    vocab = (tokens, scores, types)
    w = _writer(path, f"parkq-{shape}-{seed}-{quant}", dims, file_type, vocab, CHAT_TEMPLATE,
                rope_freq_base=500_000.0)  # fmt: skip

    def matrix(name: str, rows: int, cols: int, std: float) -> None:
        data = _random_quantized(rng, rows, cols, quant, std)
        w.add_tensor(name, data, raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(dims.n_embd, dtype=np.float32))

    kv = dims.n_head_kv * head_dim
    matrix("token_embd.weight", dims.n_vocab, dims.n_embd, 1.0)
    norm("output_norm.weight")
    # Logits of a few units' spread: greedy text varies, sampling has choices.
    matrix("output.weight", dims.n_vocab, dims.n_embd, 3.0 / dims.n_embd**0.5)
    for i in range(dims.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", dims.n_embd, dims.n_embd, 0.05)
        matrix(p + "attn_k.weight", kv, dims.n_embd, 0.05)
        matrix(p + "attn_v.weight", kv, dims.n_embd, 0.05)
        matrix(p + "attn_output.weight", dims.n_embd, dims.n_embd, 0.02)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", dims.n_ff, dims.n_embd, 0.02)
        matrix(p + "ffn_up.weight", dims.n_ff, dims.n_embd, 0.02)
        matrix(p + "ffn_down.weight", dims.n_embd, dims.n_ff, 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_test_model(
    path: str | Path,
    seed: int = 0,
    quant: str = "f32",
    extra_words: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
    control_tokens: Sequence[str] = (),
) -> Path:
    """Write the tiny model to ``path`` (weights of type ``quant``) and return the path.

    ``extra_words`` grow the vocabulary: a model with another vocabulary.
    ``control_tokens`` are added as control tokens (e.g. GEMMA_CONTROL_TOKENS,
    with ``chat_template=GEMMA_TEMPLATE``).
    """
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    qtype, file_type = QUANTS[quant]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab(extra_words, control_tokens)
    n_vocab = len(tokens)

    name = f"parkq-tiny-{seed}" + ("" if quant == "f32" else f"-{quant}")
    dims = Shape(n_embd=N_EMBD, n_layer=N_LAYER, n_head=N_HEAD, n_head_kv=N_HEAD, n_ff=N_FF,
                 n_vocab=n_vocab, n_ctx_train=N_CTX_TRAIN)  # fmt: skip
    w = _writer(path, name, dims, file_type, (tokens, scores, types), chat_template)

    def rand(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    add_f32 = w.add_tensor

    def add_matrix(name: str, data: np.ndarray) -> None:
        # The same random draws at every type: a quantized model is the f32 one, rounded.
        if qtype == gguf.GGMLQuantizationType.F32:
            add_f32(name, data)
        else:
            add_f32(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add_matrix("token_embd.weight", rand(n_vocab, N_EMBD, std=1.0))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    out = rand(n_vocab, N_EMBD, std=0.5)
    out[2] *= 0.25  # make end-of-sequence rare, so generations run long by default
    # Make bytes 0x80-0xFF rare too: the output stays mostly valid UTF-8 text.
    out[3 + 0x80 : 3 + 0x100] *= 0.1
    add_matrix("output.weight", out)
    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        add_matrix(p + "attn_q.weight", rand(N_EMBD, N_EMBD))
        add_matrix(p + "attn_k.weight", rand(N_EMBD, N_EMBD))
        add_matrix(p + "attn_v.weight", rand(N_EMBD, N_EMBD))
        add_matrix(p + "attn_output.weight", rand(N_EMBD, N_EMBD))
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        add_matrix(p + "ffn_gate.weight", rand(N_FF, N_EMBD))
        add_matrix(p + "ffn_up.weight", rand(N_FF, N_EMBD))
        add_matrix(p + "ffn_down.weight", rand(N_EMBD, N_FF))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
