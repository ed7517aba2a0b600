"""What model a process serves, so the web and the workers can tell they agree.

Token ids only mean something for the vocabulary they were made with, and an
answer only means something from the model that was asked. Every worker
announces its :class:`ModelIdentity` with its heartbeat; the web process
computes its own from the model file it tokenizes with, refuses requests (and
reports itself unhealthy) when no live worker serves that model, and stamps
each job with the model's digest so that only a matching worker claims it.

Invariant: two identities are the same model exactly when their ``digest``
(the SHA-256 of the GGUF file's bytes) is equal; ``vocab_digest`` tells apart
"same vocabulary, other weights" from "another vocabulary" in messages.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Protocol

from scheduler.settings import cache_root

__all__ = ["ModelIdentity", "file_digest", "identify", "vocab_digest"]


class _Vocabulary(Protocol):
    n_vocab: int

    def piece(self, token: int) -> bytes: ...


@dataclass(frozen=True)
class ModelIdentity:
    """A model as the processes announce it to each other."""

    name: str
    digest: str  # SHA-256 of the model file
    n_ctx: int
    n_vocab: int
    vocab_digest: str  # SHA-256 over every token's bytes, in id order
    #: Where the worker computes (``CPU``, ``CUDA0 (NVIDIA H200, 140 GiB)``...):
    #: the same weights give other logits, bit for bit, on another device.
    device: str = "CPU"
    #: What the worker's batching checks certified (how many sequences one decode
    #: call takes, up to which KV length, what was compared), in words; empty
    #: from a process that decodes nothing (the web's own identity).
    exactness: str = ""
    #: What decides a worker's tokens, as a short hash (OpenAI's
    #: ``system_fingerprint``): the model file, the device, the llama.cpp build
    #: and the kernels parkq chose; empty from a process that decodes nothing.
    fingerprint: str = ""

    def fields(self) -> dict[str, str]:
        """The Redis hash fields that announce it (prefixed ``model_``)."""
        return {f"model_{k}": str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> ModelIdentity | None:
        """The identity announced in ``raw`` (a worker's hash), or None."""
        try:
            return cls(
                name=raw["model_name"],
                digest=raw["model_digest"],
                n_ctx=int(raw["model_n_ctx"]),
                n_vocab=int(raw["model_n_vocab"]),
                vocab_digest=raw["model_vocab_digest"],
                device=raw.get("model_device", "CPU"),
                exactness=raw.get("model_exactness", ""),
                fingerprint=raw.get("model_fingerprint", ""),
            )
        except (KeyError, ValueError):
            return None

    def describe(self) -> str:
        """``name (sha256 0123456789ab, 262144 tokens)`` for messages."""
        return f"{self.name} (sha256 {self.digest[:12]}, {self.n_vocab} tokens)"

    def difference(self, other: ModelIdentity) -> str:
        """Why ``other`` cannot serve requests tokenized for this model."""
        if self.vocab_digest == other.vocab_digest:
            return "the same vocabulary but other weights"
        return "another vocabulary, so its token ids mean other text"


def file_digest(path: str, cache_dir: str | None = None) -> str:
    """The SHA-256 of a file, cached per (real path, size, mtime) under ``cache_dir``."""
    st = os.stat(path)
    key_text = f"{os.path.realpath(path)}\n{st.st_size}\n{st.st_mtime_ns}"
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    base = cache_root(cache_dir)
    cached = base / "digests" / f"{key}.json"
    try:
        return str(json.loads(cached.read_text())["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": os.path.realpath(path), "sha256": digest}))
        tmp.replace(cached)
    except OSError:
        pass  # a read-only home: hash again next time
    return digest


def vocab_digest(vocab: _Vocabulary) -> str:
    """A digest of the vocabulary: every token's bytes, length-prefixed, in id order."""
    h = hashlib.sha256(str(vocab.n_vocab).encode())
    for token in range(vocab.n_vocab):
        piece = vocab.piece(token)
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    return h.hexdigest()


def identify(
    name: str,
    path: str,
    vocab: _Vocabulary,
    n_ctx: int,
    cache_dir: str | None = None,
    device: str = "CPU",
    exactness: str = "",
    kernels: str = "",
) -> ModelIdentity:
    """The identity of the model file ``path`` as loaded into ``vocab`` (on
    ``device``); ``kernels``: what else decides its tokens (the llama.cpp build
    and the kernels chosen), hashed with the file and the device into its
    fingerprint (none without it)."""
    digest = file_digest(path, cache_dir)
    return ModelIdentity(
        name=name,
        digest=digest,
        n_ctx=n_ctx,
        n_vocab=vocab.n_vocab,
        vocab_digest=vocab_digest(vocab),
        device=device,
        exactness=exactness,
        fingerprint=fingerprint(digest, device, kernels) if kernels else "",
    )


def fingerprint(digest: str, device: str, kernels: str) -> str:
    """``fp_`` and 12 hex digits of a hash of what decides a worker's tokens."""
    h = hashlib.sha256(f"{digest}\0{device}\0{kernels}".encode()).hexdigest()
    return f"fp_{h[:12]}"
