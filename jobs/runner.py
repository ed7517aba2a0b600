"""Drive one generation on the engine: chunked prefill, then one token per step.

:func:`generate` is the generation as a coroutine: it yields each engine call
it needs (:class:`Eval`: tokens at positions) and is sent the logits back, so
a worker can interleave several generations on one engine (their decode steps
batched in one call, each prefill chunk in a call of its own). :func:`drive`
runs one generation alone.

``emit(payloads)`` writes a step's events and returns the job's control flags;
the runner checks them between prefill chunks and between decode steps, which
is where a running job can be cancelled or parked.

A generation starts fresh, resumes from a KV checkpoint (its positions are
restored, the pending token decoded), or replays: the same engine calls as
the original run (prompt chunks, then one generated token at a time), so the
KV and the logits are bit-identical and the generation continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from jobs.engine import Engine
from jobs.generation import Generation

__all__ = ["CANCEL", "PREEMPT", "Eval", "Outcome", "Run", "drive", "generate", "run_alone"]

CANCEL = 1
PREEMPT = 2

Emit = Callable[[list[str]], int]
R = TypeVar("R")


@dataclass(frozen=True)
class Eval:
    """One engine call a generation needs: ``tokens`` at positions ``pos...`` of
    its sequence; the logits after the last one are sent back."""

    tokens: list[int]
    pos: int


#: A generation in progress: yields engine calls, is sent their logits.
Run = Generator[Eval, np.ndarray, "Outcome"]


@dataclass(frozen=True)
class Outcome:
    state: str  # "finished", "cancelled" or "parked"
    payloads: list[str]
    #: Whether the engine's KV holds the generation's positions (a park in the
    #: middle of a replay does not: it is parked without a checkpoint).
    kv_valid: bool = True


def _replay(gen: Generation, n_batch: int, emit: Emit) -> Generator[Eval, np.ndarray, int]:
    """Rebuild the KV of a generation without a checkpoint.

    Returns 0, or the flags (CANCEL, PREEMPT) that stopped it: the replay
    checks them (and the worker beats) after every prefill chunk and every
    token, like a run does; a job asked to park is parked again, without a
    checkpoint.
    """
    ids = gen.request.prompt_ids
    for start in range(0, gen.n_prefilled, n_batch):
        yield Eval(ids[start : min(start + n_batch, gen.n_prefilled)], start)
        if flags := emit([]) & (CANCEL | PREEMPT):
            return flags
    pos = gen.n_prefilled
    for token in gen.generated[:-1] if gen.pending is not None else []:
        yield Eval([token], pos)
        pos += 1
        # Every token: a slow model's replay must keep the heartbeat going (the
        # worker writes at most once per write interval).
        if flags := emit([]) & (CANCEL | PREEMPT):
            return flags
    return 0


def drive(
    engine: Engine,
    gen: Generation,
    emit: Emit,
    n_batch: int,
    kv: bytes | memoryview | None = None,
    resume: bool = False,
    ready: Callable[[], None] | None = None,
    keep: int | None = None,
) -> Outcome:
    """Run ``gen`` alone on sequence 0 of ``engine`` (see :func:`generate`)."""
    return run_alone(engine, generate(engine, gen, emit, n_batch, kv, resume, ready, keep), 0)


def run_alone(engine: Engine, run: Generator[Eval, np.ndarray, R], seq: int) -> R:
    """Serve a generation's engine calls one by one on sequence ``seq``."""
    try:
        call = next(run)
        while True:
            call = run.send(engine.eval(call.tokens, call.pos, seq))
    except StopIteration as stop:
        result: R = stop.value
        return result


def generate(
    engine: Engine,
    gen: Generation,
    emit: Emit,
    n_batch: int,
    kv: bytes | memoryview | None = None,
    resume: bool = False,
    ready: Callable[[], None] | None = None,
    keep: int | None = None,
    seq: int = 0,
    in_place: bool = False,
    prompt_logits: np.ndarray | None = None,
    prefilled: Callable[[np.ndarray], None] | None = None,
) -> Run:
    """Run ``gen`` on sequence ``seq`` until it finishes, is cancelled or is asked
    to park. The KV bookkeeping (clear, restore, truncate) is done on ``engine``
    at once; the decode calls are yielded.

    ``kv`` restores a checkpoint of ``gen.n_past`` positions; with ``resume``
    and no ``kv`` the positions are replayed first. ``keep`` truncates a
    restored ``kv`` (a cached prompt prefix); ``in_place``: the sequence still
    holds them (parked in place). ``ready`` is called once the KV cache holds
    the positions. ``kv`` of the whole prompt with its last logits,
    ``prompt_logits``, starts a generation without a prefill (a sibling
    choice's prompt); ``prefilled`` is given the prompt's last logits when this
    run computes them.
    """
    ids = gen.request.prompt_ids
    if not in_place:
        engine.clear(seq)
        if kv is not None:
            engine.load_seq(kv, seq)
            if keep is not None:
                engine.truncate(keep, seq)
        elif resume and (flags := (yield from _replay(gen, n_batch, emit))):
            if flags & CANCEL:
                return Outcome("cancelled", [])
            return Outcome("parked", [], kv_valid=False)
    if ready is not None:
        ready()
    logits = prompt_logits
    while not gen.prefilled:
        start = gen.n_prefilled
        chunk = ids[start : start + n_batch]
        logits = yield Eval(chunk, start)
        gen.n_prefilled = start + len(chunk)
        if not gen.prefilled:
            flags = emit([])
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
        flags = emit(payloads)
        if flags & CANCEL:
            return Outcome("cancelled", [])
        if flags & PREEMPT:
            return Outcome("parked", [])
        logits = yield Eval([token], pos)
        pos += 1
    return Outcome("finished", payloads + gen.final_payloads())
