"""Which of an engine's running sequences one step serves: pure, no clock.

A worker with several sequences runs, per step, one engine call that decodes a
token of each chosen decoding sequence, and the prefill chunks it picks (the
worker puts them in as few calls as its kernels allow: jobs/worker/loop.py).
This module decides who is in that step, from numbers the worker measures
and passes in (how long a decode call of ``n`` sequences
takes, how long a prefill chunk takes); it guesses nothing.

Invariants (property-tested):
- every interactive decoding sequence (a job above the batch level) decodes at
  every step: its pace is the engine's;
- without interactive sequences decoding, every decoding sequence decodes;
- with them, a batch sequence joins the step only if the measured step time
  with it stays within the interactive ones' step time alone plus a slack of
  ``(pace - 1)`` times that for each step it has waited (a size not measured
  yet is allowed: that is how it gets measured; while the interactive ones'
  own step time is not measured, they decode alone once to measure it). At no wait that is the pace
  bound itself; a sequence left out waits longer and so is served within a
  bounded number of steps: interactive streams keep ``pace`` on average and
  batch work is never starved;
- the ones that wait longest are considered first, so the batch sequences
  take turns;
- every interactive sequence that is prefilling gets one prefill chunk per
  step (its time to first token is the latency a person feels; a chunk is
  at most ``n_batch`` tokens, so a decoding stream's step grows by one
  bounded chunk per arrival, and only until its prompt is in);
- otherwise at most one batch prefill chunk runs, when nothing interactive
  decodes or when its measured cost fits the same slack spread over the steps
  it has waited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["SeqView", "StepPlan", "plan_step"]


@dataclass(frozen=True)
class SeqView:
    """What the planner sees of one running sequence."""

    seq: int
    #: The ordering key of its job (higher runs first; see scheduler.policy).
    key: float
    interactive: bool
    #: Its next engine call is a prefill chunk (else one decode token).
    prefilling: bool
    #: Steps since it was last served (0: served at the last step).
    waited: int = 0


@dataclass(frozen=True)
class StepPlan:
    #: Sequences that decode one token each, in one engine call.
    decode: tuple[int, ...]
    #: The sequences whose next prefill chunk runs, in this order (several in
    #: one call where the worker's kernels allow it).
    prefill: tuple[int, ...] = ()


def plan_step(
    seqs: Sequence[SeqView],
    decode_ms: Mapping[int, float],
    prefill_ms: float | None = None,
    pace: float = 1.3,
) -> StepPlan:
    """The next step for ``seqs``.

    ``decode_ms[n]``: measured duration of one decode call of ``n`` sequences;
    ``prefill_ms``: measured duration of one prefill chunk (None: not yet
    measured); ``pace``: how much slower than alone an interactive stream may
    step while batch work shares the engine.
    """
    decoding = [s for s in seqs if not s.prefilling]
    urgent = [s for s in decoding if s.interactive]
    others = [s for s in decoding if not s.interactive]
    chosen = list(urgent)
    alone = decode_ms.get(len(urgent)) if urgent else None
    # Longest-waiting first, then the better job: left out this step are the
    # ones served most recently.
    for s in sorted(others, key=lambda s: (-s.waited, -s.key, s.seq)):
        if urgent and alone is None:
            break  # measure the interactive ones' pace alone first
        cost = decode_ms.get(len(chosen) + 1)
        if alone is None or cost is None or cost <= alone + _slack(alone, pace, s):
            chosen.append(s)
    order = sorted((s for s in seqs if s.prefilling), key=lambda s: (-s.key, -s.waited, s.seq))
    prefill = [s for s in order if s.interactive]
    batch = [s for s in order if not s.interactive]
    if not prefill and batch:
        first = batch[0]
        if not urgent or _fits(first, urgent, decode_ms, prefill_ms, pace):
            prefill = [first]
    return StepPlan(tuple(s.seq for s in chosen), tuple(s.seq for s in prefill))


def _fits(
    s: SeqView,
    urgent: Sequence[SeqView],
    decode_ms: Mapping[int, float],
    prefill_ms: float | None,
    pace: float,
) -> bool:
    """Whether a batch prefill chunk, its cost spread over the steps it waited,
    keeps the interactive streams within their pace."""
    alone = decode_ms.get(len(urgent))
    if prefill_ms is None or alone is None:
        return True  # not measured yet
    return prefill_ms <= _slack(alone, pace, s)


def _slack(alone: float, pace: float, s: SeqView) -> float:
    """The delay ``s`` may add to the interactive streams' step: ``pace - 1``
    of their step time for every step it has waited, and this one."""
    return (pace - 1) * alone * (s.waited + 1)
