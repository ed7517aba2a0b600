"""A fake engine and vocabulary: bytes are tokens, logits come from a hash."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

EOS = 256
N_VOCAB = 257


class FakeVocab:
    n_vocab = N_VOCAB
    n_ctx_train = 256

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]:
        return list(text.encode())

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + "<assistant>", ["</s>"]

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == EOS else bytes([token])

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def constraint(self, grammar: str) -> Any:
        raise NotImplementedError("the fake engine follows no grammar (tests with llama.cpp do)")

    def is_control(self, token: int) -> bool:
        return token == EOS

    def control_texts(self) -> frozenset[str]:
        return frozenset()  # EOS has no spelling

    def control_strips(self) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(), frozenset()


class FakeEngine(FakeVocab):
    """Follows a script when given one, else picks tokens from a hash of the context.

    With a script, the logits after the prompt (``prompt_len`` tokens) and after
    each generated token favour the script's next token, then end-of-sequence.
    """

    def __init__(
        self, n_ctx: int = 256, script: Sequence[int] | None = None, prompt_len: int = 1
    ) -> None:
        self.n_ctx = n_ctx
        self.script = list(script or [])
        self.prompt_len = prompt_len
        self.context: list[int] = []
        self.calls: list[tuple[int, int]] = []  # (n tokens, pos)

    def clear(self, seq: int = 0) -> None:
        self.context = []

    def truncate(self, pos: int, seq: int = 0) -> None:
        self.context = self.context[:pos]

    def save_seq(self, seq: int = 0) -> bytes:
        return bytes(json.dumps(self.context), "ascii")

    def load_seq(self, data: bytes | memoryview, seq: int = 0) -> None:
        self.context = json.loads(bytes(data))

    def decode(self, steps: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        """One token each of several sequences: the fake has one, so one step."""
        return [self.eval([token], pos, seq) for seq, token, pos in steps]

    #: One context: each prompt chunk in a call of its own.
    max_prefill = 1

    def prefill(self, chunks: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        return [self.eval(tokens, pos, seq) for seq, tokens, pos in chunks]

    def eval(self, tokens: Sequence[int], pos: int, seq: int = 0) -> np.ndarray:
        assert pos == len(self.context), "positions must continue the context"
        self.calls.append((len(tokens), pos))
        self.context.extend(tokens)
        logits = np.zeros(N_VOCAB, dtype=np.float32)
        step = len(self.context)
        if self.script:
            i = step - self.prompt_len
            token = self.script[i] if i < len(self.script) else EOS
            logits[token] = 10.0
        else:
            rng = np.random.default_rng(hash(tuple(self.context[-4:])) & 0xFFFFFFFF)
            logits[:] = rng.standard_normal(N_VOCAB)
            logits[EOS] = -10.0
        return logits
