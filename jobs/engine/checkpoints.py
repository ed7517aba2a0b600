"""KV checkpoints of parked jobs, in the worker's RAM, within a byte budget.

Least recently stored goes first when the budget is exceeded. A job whose KV
is gone resumes by replaying its prompt and generated tokens instead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["Checkpoint", "CheckpointStore"]


@dataclass(frozen=True)
class Checkpoint:
    #: The execution token of the run that parked: the Redis state must match.
    exec_token: str
    #: KV positions held.
    n_past: int
    kv: bytes | memoryview


class CheckpointStore:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[str, Checkpoint] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def job_ids(self) -> list[str]:
        return list(self._items)

    def put(self, job_id: str, checkpoint: Checkpoint) -> None:
        self.drop(job_id)
        if len(checkpoint.kv) > self.budget:
            return
        self._items[job_id] = checkpoint
        self.bytes += len(checkpoint.kv)
        while self.bytes > self.budget:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old.kv)

    def take(self, job_id: str) -> Checkpoint | None:
        """Remove and return a job's checkpoint (each is used once)."""
        checkpoint = self._items.pop(job_id, None)
        if checkpoint is not None:
            self.bytes -= len(checkpoint.kv)
        return checkpoint

    def drop(self, job_id: str) -> None:
        self.take(job_id)


@dataclass(frozen=True)
class Prefix:
    #: The prompt token ids at positions 0.. of the saved KV.
    tokens: tuple[int, ...]
    kv: bytes | memoryview


class PrefixCache:
    """KV of finished jobs' prompts, for requests that start the same way
    (a chat's next turn, another question about the same document).

    Only whole prefill chunks are reused: the reused positions were computed
    by exactly the engine calls a cold run makes, so a hit changes no logit.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._items: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()
        self.bytes = 0

    def put(self, tokens: list[int], kv: bytes | memoryview) -> None:
        key = tuple(tokens)
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old.kv)
        if len(kv) > self.budget:
            return
        self._items[key] = Prefix(key, kv)
        self.bytes += len(kv)
        while self.bytes > self.budget:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= len(evicted.kv)

    def best(self, prompt: list[int], chunk: int) -> tuple[Prefix, int] | None:
        """The entry sharing the most whole chunks with ``prompt``, and how many
        positions to keep (at least one prompt token is left to prefill)."""
        limit = (len(prompt) - 1) // chunk * chunk
        found: tuple[Prefix, int] | None = None
        head = tuple(prompt[:limit])
        for entry in self._items.values():
            usable = 0  # whole chunks in common, compared a chunk at a time (in C)
            while (
                usable + chunk <= min(limit, len(entry.tokens))
                and entry.tokens[usable : usable + chunk] == head[usable : usable + chunk]
            ):
                usable += chunk
            if usable >= chunk and (found is None or usable > found[1]):
                found = (entry, usable)
        if found is not None:
            self._items.move_to_end(found[0].tokens)
        return found
