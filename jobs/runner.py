"""Drive one generation on the engine: chunked prefill, then one token per step.

``emit(payloads, tokens)`` writes a step's events and returns the job's
control flags; the runner checks them between prefill chunks and between
decode steps, which is where a running job can be stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobs.engine import Engine
from jobs.generation import Generation

__all__ = ["CANCEL", "PREEMPT", "Outcome", "drive"]

CANCEL = 1
PREEMPT = 2

Emit = Callable[[list[str], int], int]


@dataclass(frozen=True)
class Outcome:
    state: str  # "finished" or "cancelled"
    payloads: list[str]


def drive(engine: Engine, gen: Generation, emit: Emit, n_batch: int) -> Outcome:
    ids = gen.request.prompt_ids
    engine.clear(0)
    pos = 0
    logits = None
    for start in range(0, len(ids), n_batch):
        chunk = ids[start : start + n_batch]
        logits = engine.eval(chunk, pos)
        pos += len(chunk)
        if pos < len(ids) and emit([], 0) & CANCEL:
            return Outcome("cancelled", [])
    assert logits is not None, "empty prompt"
    while True:
        if pos >= engine.n_ctx:
            payloads = gen.stop_at_context_end()
            break
        token = gen.next_token(logits)
        payloads = gen.accept(token, logits)
        if gen.done:
            break
        if emit(payloads, len(gen.generated)) & CANCEL:
            return Outcome("cancelled", [])
        logits = engine.eval([token], pos)
        pos += 1
    return Outcome("finished", payloads + gen.final_payloads())
