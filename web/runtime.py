"""What the web app holds for its whole life: settings, Redis, the vocabulary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from jobs.store.identity import ModelIdentity
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import Store
from scheduler.settings import Settings
from web.slots import Slots

__all__ = ["Fleet", "Runtime", "VocabLike", "current"]

#: How long the web trusts its last read of what the workers serve.
FLEET_SECONDS = 1.0


class VocabLike(Protocol):
    n_vocab: int
    n_ctx_train: int

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def is_control(self, token: int) -> bool: ...
    def control_texts(self) -> frozenset[str]: ...
    def control_strips(self) -> tuple[frozenset[str], frozenset[str]]: ...
    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]: ...


@dataclass(frozen=True)
class Fleet:
    """The live workers at one moment, split by whether they serve our model."""

    matching: dict[str, ModelIdentity | None]
    others: dict[str, ModelIdentity]

    @property
    def mismatch(self) -> bool:
        """Workers are up, and none of them can run the jobs we make."""
        return bool(self.others) and not self.matching


@dataclass
class Runtime:
    settings: Settings
    store: Store
    rq: RQBridge
    vocab: VocabLike
    model_name: str
    #: The model the vocabulary came from (None when a test passes a vocabulary).
    identity: ModelIdentity | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    #: Open streams and waiting requests (PARKQ_MAX_STREAMS).
    slots: Slots = field(default_factory=lambda: Slots(512))
    _fleet: tuple[float, Fleet] | None = field(default=None, repr=False)

    def fleet(self, fresh: bool = False) -> Fleet:
        """What the live workers serve (on the request path, read at most once a second)."""
        now = time.time()
        cached = self._fleet
        if not fresh and cached is not None and now - cached[0] < FLEET_SECONDS:
            return cached[1]
        matching: dict[str, ModelIdentity | None] = {}
        others: dict[str, ModelIdentity] = {}
        for worker, model in self.store.workers.models(now).items():
            if model is None or self.identity is None or model.digest == self.identity.digest:
                matching[worker] = model
            else:
                others[worker] = model
        fleet = Fleet(matching, others)
        self._fleet = (now, fleet)
        return fleet

    def fingerprint(self, worker: str | None = None) -> str | None:
        """``system_fingerprint``: what the live worker ``worker`` (a sequence's
        name, or its process's) announces, else the one every live worker
        serving our model announces; None when unknown or when they differ."""
        try:
            fleet = self.fleet()
        except redis.RedisError:
            return None
        if worker:
            for name in (worker, worker.rsplit("/", 1)[0]):
                model = fleet.matching.get(name)
                if model is not None and model.fingerprint:
                    return model.fingerprint
        prints = {m.fingerprint for m in fleet.matching.values() if m is not None}
        return prints.pop() if len(prints) == 1 and "" not in prints else None

    @property
    def n_ctx(self) -> int:
        """The context a request may fill: ours, or the smallest a matching worker has."""
        own = self.settings.n_ctx or self.vocab.n_ctx_train
        try:
            fleet = self.fleet()
        except redis.RedisError:
            return own  # the request fails at the queue, with the right error
        sizes = [m.n_ctx for m in fleet.matching.values() if m is not None]
        return min(sizes) if sizes else own


def current() -> Runtime:
    """The runtime of the app handling the current request."""
    from flask import current_app

    runtime: Runtime = current_app.extensions["parkq"]
    return runtime
