"""Where the KV of this worker's jobs lives: the engine's sequences (free, in
use, or keeping a parked job's KV in place), the RAM checkpoint store, the
prefix cache, and the prompts sibling choices (``n`` > 1) share.

A parked job's KV stays in its sequence while a spare one is left (nothing
copied); the oldest is copied out to the checkpoint store when a sequence is
needed. A checkpoint is used only by the execution that parked it at the
positions it holds (its fencing token and ``n_past``), else discarded.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from jobs.engine.checkpoints import Checkpoint, CheckpointStore, PrefixCache
from jobs.engine.llama import Engine
from jobs.engine.request import GenerationRequest

__all__ = ["SHARED_PROMPTS", "InPlace", "Kept", "Sequences", "SharedPrompt"]

log = logging.getLogger(__name__)

#: Shared prompts kept at once (each holds one prompt's KV).
SHARED_PROMPTS = 8


@dataclass(frozen=True)
class InPlace:
    """A parked job whose KV stays in its engine sequence (nothing copied)."""

    exec_token: str
    n_past: int
    seq: int


@dataclass
class SharedPrompt:
    """A prompt's KV and last logits, computed by one choice of a request with
    ``n`` > 1, for its siblings that start on this worker: they skip the prefill
    (a copy of KV the same engine calls computed, so nothing changes)."""

    tokens: tuple[int, ...]
    kv: bytes
    logits: np.ndarray
    #: Siblings that may still take it.
    left: int


@dataclass(frozen=True)
class Kept:
    """A job's KV found on this worker: its sequence and, unless the sequence
    already holds it (``in_place``), the checkpoint to load into it."""

    seq: int
    in_place: bool
    kv: bytes | memoryview | None


class Sequences:
    """The engine's sequences and the KV this worker keeps for its jobs."""

    def __init__(
        self, engine: Engine, n_seqs: int, n_slots: int, checkpoint_bytes: int, prefix_bytes: int
    ) -> None:
        self.engine = engine
        #: The lowest is taken first: running sequences stay a run of consecutive
        #: ids, which llama.cpp decodes in one pass (see LlamaEngine.decode).
        self.free = list(range(n_seqs))
        self.in_place: OrderedDict[str, InPlace] = OrderedDict()
        self.in_place_max = n_seqs - n_slots
        self.checkpoints = CheckpointStore(checkpoint_bytes)
        self.prefixes = PrefixCache(prefix_bytes)
        self.shared: OrderedDict[str, SharedPrompt] = OrderedDict()
        #: Requests (response ids) with a choice prefilling its prompt here.
        self.prefilling: dict[str, int] = {}

    # -- sequences -------------------------------------------------------------

    def acquire(self) -> int:
        if not self.free:  # every spare sequence keeps a parked job: copy one out
            self.swap_out()
        seq = min(self.free)
        self.free.remove(seq)
        return seq

    def release(self, seq: int) -> None:
        self.engine.clear(seq)
        self.free.append(seq)

    def swap_out(self) -> None:
        """Copy the oldest job parked in place to the checkpoint store; free its
        sequence."""
        job_id, entry = self.in_place.popitem(last=False)
        kv = self.engine.save_seq(entry.seq)
        self.checkpoints.put(job_id, Checkpoint(entry.exec_token, entry.n_past, bytes(kv)))
        self.release(entry.seq)
        log.info("job %s: parked KV copied out of the engine (%d bytes)", job_id, len(kv))

    # -- a job's KV ------------------------------------------------------------

    def take(self, job_id: str, exec_token: str | None, n_past: int) -> Kept:
        """A sequence for ``job_id``: the one keeping its KV in place, else a free
        one with its checkpoint (if any), when they are of the execution
        ``exec_token`` that parked it at ``n_past`` positions."""
        entry = self.in_place.pop(job_id, None)
        if entry is not None:
            if entry.exec_token == exec_token and entry.n_past == n_past:
                return Kept(entry.seq, True, None)
            log.warning("job %s: stale in-place checkpoint discarded", job_id)
            self.release(entry.seq)
        seq = self.acquire()
        checkpoint = self.checkpoints.take(job_id)
        if checkpoint is None:
            return Kept(seq, False, None)
        if checkpoint.exec_token != exec_token or checkpoint.n_past != n_past:
            log.warning("job %s: stale checkpoint discarded", job_id)
            return Kept(seq, False, None)
        return Kept(seq, False, checkpoint.kv)

    def park(self, job_id: str, exec_token: str, n_past: int, seq: int) -> int:
        """Keep a parked job's KV: in its sequence while a spare one is left
        (returns 0, nothing copied), else copied to the checkpoint store (returns
        its size; the caller frees the sequence)."""
        if self.in_place_max > 0:
            self.in_place[job_id] = InPlace(exec_token, n_past, seq)
            while len(self.in_place) > self.in_place_max:
                self.swap_out()
            return 0
        kv = bytes(self.engine.save_seq(seq))
        self.checkpoints.put(job_id, Checkpoint(exec_token, n_past, kv))
        return len(kv)

    def held(self) -> list[str]:
        """The jobs whose KV this worker keeps (in place or copied out)."""
        return [*self.checkpoints.job_ids(), *self.in_place]

    def drop(self, job_id: str) -> None:
        """Forget a job's kept KV (it ended, or resumed elsewhere)."""
        self.checkpoints.drop(job_id)
        entry = self.in_place.pop(job_id, None)
        if entry is not None:
            self.release(entry.seq)

    # -- a request's choices share its prompt --------------------------------

    def take_shared(self, request: GenerationRequest) -> SharedPrompt | None:
        shared = self.shared.get(request.response_id)
        if shared is None or shared.tokens != tuple(request.prompt_ids):
            return None
        shared.left -= 1
        if shared.left <= 0:
            del self.shared[request.response_id]
        return shared

    def sibling_prefilling(self, request: GenerationRequest) -> bool:
        return bool(self.prefilling.get(request.response_id))

    def prefill_started(self, response_id: str) -> None:
        self.prefilling[response_id] = self.prefilling.get(response_id, 0) + 1

    def prefill_ended(self, response_id: str) -> None:
        left = self.prefilling.pop(response_id, 1) - 1
        if left > 0:
            self.prefilling[response_id] = left

    def share(self, request: GenerationRequest, seq: int, logits: np.ndarray) -> None:
        """``seq`` holds ``request``'s whole prompt: keep it for the siblings."""
        kv = bytes(self.engine.save_seq(seq))
        tokens = tuple(request.prompt_ids)
        left = request.choices - 1
        self.shared[request.response_id] = SharedPrompt(tokens, kv, logits.copy(), left)
        while len(self.shared) > SHARED_PROMPTS:
            self.shared.popitem(last=False)
