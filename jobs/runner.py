"""Drive one generation on the engine: chunked prefill, then one token per step.

``emit(payloads)`` writes a step's events and returns the job's control flags;
the runner checks them between prefill chunks and between decode steps, which
is where a running job can be cancelled or parked.

A generation starts fresh, resumes from a KV checkpoint (its positions are
restored, the pending token decoded), or replays: the same engine calls as
the original run (prompt chunks, then one generated token at a time), so the
KV and the logits are bit-identical and the generation continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobs.engine import Engine
from jobs.generation import Generation

__all__ = ["CANCEL", "PREEMPT", "Outcome", "drive"]

CANCEL = 1
PREEMPT = 2

Emit = Callable[[list[str]], int]


@dataclass(frozen=True)
class Outcome:
    state: str  # "finished", "cancelled" or "parked"
    payloads: list[str]
    #: Whether the engine's KV holds the generation's positions (a park in the
    #: middle of a replay does not: it is parked without a checkpoint).
    kv_valid: bool = True


def _replay(engine: Engine, gen: Generation, n_batch: int, emit: Emit) -> int:
    """Rebuild the KV of a generation without a checkpoint.

    Returns 0, or the flags (CANCEL, PREEMPT) that stopped it: the replay
    checks them (and the worker beats) after every prefill chunk and every
    token, like a run does; a job asked to park is parked again, without a
    checkpoint.
    """
    ids = gen.request.prompt_ids
    for start in range(0, gen.n_prefilled, n_batch):
        engine.eval(ids[start : min(start + n_batch, gen.n_prefilled)], start)
        if flags := emit([]) & (CANCEL | PREEMPT):
            return flags
    pos = gen.n_prefilled
    for token in gen.generated[:-1] if gen.pending is not None else []:
        engine.eval([token], pos)
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
    """Run ``gen`` until it finishes, is cancelled or is asked to park.

    ``kv`` restores a checkpoint of ``gen.n_past`` positions; with ``resume``
    and no ``kv`` the positions are replayed first. ``keep`` truncates a
    restored ``kv`` (a cached prompt prefix). ``ready`` is called once the KV
    cache holds the positions.
    """
    ids = gen.request.prompt_ids
    engine.clear(0)
    if kv is not None:
        engine.load_seq(kv)
        if keep is not None:
            engine.truncate(keep)
    elif resume and (flags := _replay(engine, gen, n_batch, emit)):
        if flags & CANCEL:
            return Outcome("cancelled", [])
        return Outcome("parked", [], kv_valid=False)
    if ready is not None:
        ready()
    logits = None
    while not gen.prefilled:
        start = gen.n_prefilled
        chunk = ids[start : start + n_batch]
        logits = engine.eval(chunk, start)
        gen.n_prefilled = start + len(chunk)
        if not gen.prefilled:
            flags = emit([])
            if flags & CANCEL:
                return Outcome("cancelled", [])
            if flags & PREEMPT:
                return Outcome("parked", [])
    pos = gen.n_past
    pending = gen.pending
    if pending is not None:
        logits = engine.eval([pending], pos)
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
        logits = engine.eval([token], pos)
        pos += 1
    return Outcome("finished", payloads + gen.final_payloads())
