"""Drive one generation on the engine: chunked prefill, then one token per step.

:func:`generate` is the generation as a coroutine: it yields each engine call
it needs (:class:`Eval`: tokens at positions) and is sent the logits back, so
a worker can interleave several generations on one engine (their decode steps
batched in one call, each prefill chunk in a call of its own). :func:`drive`
runs one generation alone.

``emit(payloads)`` writes a step's events and returns the job's control flags,
or returns a :class:`Deferred` write: the generation yields it, and whoever
drives it (the worker: all of a step's sequences' writes in one Redis round
trip) sends the flags back before the generation goes on. The runner checks
the flags between prefill chunks and between decode steps, which is where a
running job can be cancelled or parked.

A generation starts fresh, resumes from a KV checkpoint (its positions are
restored, the pending token decoded), or replays: the same engine calls as
the original run (prompt chunks, then one generated token at a time), so the
KV and the logits are bit-identical and the generation continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import numpy as np

from jobs.engine.llama import Engine
from jobs.worker.generation import Generation

__all__ = [
    "CANCEL",
    "PREEMPT",
    "Deferred",
    "Eval",
    "Outcome",
    "Run",
    "Source",
    "Start",
    "Yielded",
    "drive",
    "generate",
    "run_alone",
]

CANCEL = 1
PREEMPT = 2

R = TypeVar("R")


@dataclass(frozen=True)
class Eval:
    """One engine call a generation needs: ``tokens`` at positions ``pos...`` of
    its sequence; the logits after the last one are sent back."""

    tokens: list[int]
    pos: int


class Deferred:
    """A step write the caller of the generation makes (with other sequences'
    writes, in one round trip): yielded by the generation, which is sent the
    flags back (CANCEL, PREEMPT) before it goes on. What an ``emit`` returns
    instead of the flags when it leaves the write to the caller."""


#: ``emit(payloads)``: the flags, or a :class:`Deferred` write that gives them.
Emit = Callable[[list[str]], "int | Deferred"]
#: What a generation yields: an engine call (sent its logits) or a deferred
#: write (sent its flags).
Yielded = Eval | Deferred
#: A generation in progress.
Run = Generator[Yielded, Any, "Outcome"]


@dataclass(frozen=True)
class Outcome:
    state: str  # "finished", "cancelled" or "parked"
    payloads: list[str]
    #: Whether the engine's KV holds the generation's positions (a park in the
    #: middle of a replay does not: it is parked without a checkpoint).
    kv_valid: bool = True


class Source(Enum):
    """Where a generation's KV comes from as it (re)starts on a sequence."""

    #: Nothing: the prompt is prefilled.
    FRESH = "fresh"
    #: A checkpoint of its ``n_past`` positions is loaded.
    CHECKPOINT = "checkpoint"
    #: The sequence still holds them (parked in place).
    IN_PLACE = "in_place"
    #: None is left: the same engine calls as the original run rebuild them.
    REPLAY = "replay"
    #: A cached prompt prefix's KV, cut to ``keep`` positions; the rest is prefilled.
    PREFIX = "prefix"
    #: A sibling choice's whole prompt, with the logits after its last token.
    SIBLING = "sibling"


@dataclass(frozen=True)
class Start:
    """How a generation starts: its KV's source and what that source needs."""

    source: Source
    kv: bytes | memoryview | None = None
    keep: int = 0
    logits: np.ndarray | None = None

    @classmethod
    def fresh(cls) -> Start:
        return cls(Source.FRESH)

    @classmethod
    def checkpoint(cls, kv: bytes | memoryview) -> Start:
        return cls(Source.CHECKPOINT, kv)

    @classmethod
    def in_place(cls) -> Start:
        return cls(Source.IN_PLACE)

    @classmethod
    def replay(cls) -> Start:
        return cls(Source.REPLAY)

    @classmethod
    def prefix(cls, kv: bytes | memoryview, keep: int) -> Start:
        return cls(Source.PREFIX, kv, keep)

    @classmethod
    def sibling(cls, kv: bytes | memoryview, logits: np.ndarray) -> Start:
        return cls(Source.SIBLING, kv, logits=logits)

    @property
    def resumed(self) -> bool:
        """A parked or moved job continuing (not a new one)."""
        return self.source in (Source.CHECKPOINT, Source.IN_PLACE, Source.REPLAY)


def _flags(emitted: int | Deferred) -> Generator[Yielded, Any, int]:
    """The flags of an emit: at once, or from the deferred write's caller."""
    if isinstance(emitted, Deferred):
        flags: int = yield emitted
        return flags
    return emitted


def _replay(gen: Generation, n_batch: int, emit: Emit) -> Generator[Yielded, Any, int]:
    """Rebuild the KV of a generation without a checkpoint.

    Returns 0, or the flags (CANCEL, PREEMPT) that stopped it: the replay
    checks them (and the worker beats) after every prefill chunk and every
    token, like a run does; a job asked to park is parked again, without a
    checkpoint.
    """
    ids = gen.request.prompt_ids
    for start in range(0, gen.n_prefilled, n_batch):
        yield Eval(ids[start : min(start + n_batch, gen.n_prefilled)], start)
        if flags := (yield from _flags(emit([]))) & (CANCEL | PREEMPT):
            return flags
    pos = gen.n_prefilled
    for token in gen.generated[:-1] if gen.pending is not None else []:
        yield Eval([token], pos)
        pos += 1
        # Every token: a slow model's replay must keep the heartbeat going (the
        # worker writes at most once per write interval).
        if flags := (yield from _flags(emit([]))) & (CANCEL | PREEMPT):
            return flags
    return 0


def drive(
    engine: Engine, gen: Generation, emit: Emit, n_batch: int, start: Start | None = None
) -> Outcome:
    """Run ``gen`` alone on sequence 0 of ``engine`` (see :func:`generate`)."""
    return run_alone(engine, generate(engine, gen, emit, n_batch, start or Start.fresh()), 0)


def run_alone(engine: Engine, run: Generator[Yielded, Any, R], seq: int) -> R:
    """Serve a generation's engine calls one by one on sequence ``seq`` (its
    emits write themselves: nothing is deferred)."""
    try:
        call = next(run)
        while True:
            assert isinstance(call, Eval), "run_alone serves emits that write at once"
            call = run.send(engine.eval(call.tokens, call.pos, seq))
    except StopIteration as stop:
        result: R = stop.value
        return result


def generate(
    engine: Engine,
    gen: Generation,
    emit: Emit,
    n_batch: int,
    start: Start,
    seq: int = 0,
    ready: Callable[[], None] | None = None,
    prefilled: Callable[[np.ndarray], None] | None = None,
) -> Run:
    """Run ``gen`` on sequence ``seq`` from ``start`` until it finishes, is
    cancelled or is asked to park. The KV bookkeeping (clear, restore,
    truncate) is done on ``engine`` at once; the decode calls are yielded.

    ``ready`` is called once the KV cache holds the start's positions;
    ``prefilled`` is given the prompt's last logits when this run computes them.
    """
    ids = gen.request.prompt_ids
    if start.source is Source.PREFIX:
        gen.n_prefilled = start.keep
    elif start.source is Source.SIBLING:
        gen.n_prefilled = len(ids)
    if start.source is not Source.IN_PLACE:
        engine.clear(seq)
        if start.kv is not None:
            engine.load_seq(start.kv, seq)
            if start.source is Source.PREFIX:
                engine.truncate(start.keep, seq)
        elif start.source is Source.REPLAY and (flags := (yield from _replay(gen, n_batch, emit))):
            if flags & CANCEL:
                return Outcome("cancelled", [])
            return Outcome("parked", [], kv_valid=False)
    if ready is not None:
        ready()
    logits = start.logits
    while not gen.prefilled:
        at = gen.n_prefilled
        chunk = ids[at : at + n_batch]
        logits = yield Eval(chunk, at)
        gen.n_prefilled = at + len(chunk)
        if not gen.prefilled:
            flags = yield from _flags(emit([]))
            if flags & CANCEL:
                return Outcome("cancelled", [])
            if flags & PREEMPT:
                return Outcome("parked", [])
        if gen.prefilled and prefilled is not None:
            prefilled(logits)
    pos = gen.n_past
    pending = gen.pending
    if pending is not None:
        logits = yield Eval([pending], pos)
        pos += 1
    assert logits is not None, "empty prompt"
    while True:
        if pos >= engine.n_ctx:
            payloads = gen.stop_at_context_end()
            break
        token = gen.next_token(logits)
        payloads = gen.accept(token, logits)
        if gen.done:
            break
        flags = yield from _flags(emit(payloads))
        if flags & CANCEL:
            return Outcome("cancelled", [])
        if flags & PREEMPT:
            return Outcome("parked", [])
        logits = yield Eval([token], pos)
        pos += 1
    return Outcome("finished", payloads + gen.final_payloads())
