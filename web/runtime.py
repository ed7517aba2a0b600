"""What the web app holds for its whole life: settings, Redis, the vocabulary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobs.rqjobs import RQBridge
from jobs.store import Store
from scheduler.settings import Settings

__all__ = ["Runtime", "VocabLike"]


class VocabLike(Protocol):
    n_vocab: int
    n_ctx_train: int

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]: ...


@dataclass
class Runtime:
    settings: Settings
    store: Store
    rq: RQBridge
    vocab: VocabLike
    model_name: str
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def n_ctx(self) -> int:
        return self.settings.n_ctx or self.vocab.n_ctx_train
