"""The step planner (scheduler/batching.py): who decodes, whose prefill runs."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.batching import SeqView, StepPlan, plan_step


def _views(draw_specs: list[tuple[bool, bool, int, int]]) -> list[SeqView]:
    return [
        SeqView(seq=i, key=float(key), interactive=inter, prefilling=pre, waited=waited)
        for i, (inter, pre, key, waited) in enumerate(draw_specs)
    ]


SPECS = st.lists(
    st.tuples(st.booleans(), st.booleans(), st.integers(-50, 50), st.integers(0, 20)),
    min_size=0,
    max_size=10,
)
# Measured decode-call times that grow with the batch (ms per call of n sequences).
COSTS = st.lists(st.floats(0.0, 30.0), min_size=10, max_size=10).map(
    lambda steps: {n + 1: 10.0 + sum(steps[: n + 1]) for n in range(10)}
)
PREFILL = st.one_of(st.none(), st.floats(0.0, 2000.0))


@given(SPECS, COSTS, PREFILL)
def test_a_plan_serves_only_running_sequences_and_every_interactive_decode(
    specs: list[tuple[bool, bool, int, int]], costs: dict[int, float], prefill_ms: float | None
) -> None:
    seqs = _views(specs)
    plan = plan_step(seqs, costs, prefill_ms)
    decoding = {s.seq for s in seqs if not s.prefilling}
    assert set(plan.decode) <= decoding and len(set(plan.decode)) == len(plan.decode)
    assert {s.seq for s in seqs if s.interactive and not s.prefilling} <= set(plan.decode)
    prefilling = [s for s in seqs if s.prefilling]
    assert plan.prefill is None or plan.prefill in {s.seq for s in prefilling}
    if prefilling and any(s.interactive for s in prefilling):
        # An interactive prompt is never held back, and goes before batch ones.
        chosen = next(s for s in seqs if s.seq == plan.prefill)
        assert chosen.interactive


@given(SPECS, COSTS, PREFILL)
def test_without_interactive_decodes_everything_runs(
    specs: list[tuple[bool, bool, int, int]], costs: dict[int, float], prefill_ms: float | None
) -> None:
    seqs = [s for s in _views(specs) if not (s.interactive and not s.prefilling)]
    plan = plan_step(seqs, costs, prefill_ms)
    assert set(plan.decode) == {s.seq for s in seqs if not s.prefilling}
    assert (plan.prefill is None) == (not any(s.prefilling for s in seqs))


@given(SPECS, COSTS)
def test_batch_sequences_that_have_not_waited_keep_interactive_streams_within_pace(
    specs: list[tuple[bool, bool, int, int]], costs: dict[int, float]
) -> None:
    seqs = [replace(s, waited=0) for s in _views(specs)]
    urgent = [s for s in seqs if s.interactive and not s.prefilling]
    plan = plan_step(seqs, costs, pace=1.3)
    if urgent and len(plan.decode) > len(urgent):
        assert costs[len(plan.decode)] <= 1.3 * costs[len(urgent)] + 1e-9


@settings(max_examples=200, deadline=None)
@given(SPECS, COSTS, st.floats(0.0, 2000.0))
def test_no_sequence_is_starved(
    specs: list[tuple[bool, bool, int, int]], costs: dict[int, float], prefill_ms: float
) -> None:
    """Steps repeated with the waits updated as a worker does (a prompt is
    three chunks, then the sequence decodes): every sequence is served within
    a bound set by the costs and the prompts, not by luck."""
    seqs = _views(specs)
    chunks = {s.seq: 3 for s in seqs if s.prefilling}
    served = {s.seq: False for s in seqs}
    slack = 0.3 * costs[1]
    bound = (int(max([*costs.values(), prefill_ms]) / slack) + len(seqs) + 2) * (1 + 3 * len(seqs))
    for _ in range(bound):
        if all(served.values()):
            break
        plan = plan_step(seqs, costs, prefill_ms, pace=1.3)
        now = {*plan.decode, *([plan.prefill] if plan.prefill is not None else [])}
        for s in now:
            served[s] = True
        if plan.prefill is not None:
            chunks[plan.prefill] -= 1
        seqs = [
            replace(
                s,
                waited=0 if s.seq in now else s.waited + 1,
                prefilling=s.prefilling and chunks[s.seq] > 0,
            )
            for s in seqs
        ]
    assert all(served.values()), served


def test_a_batch_sequence_sits_out_while_two_interactive_streams_need_the_pace() -> None:
    # Measured: 20 ms for 2 sequences, 30 ms for 3: a third would make the
    # interactive streams 1.5x slower than alone.
    costs = {1: 12.0, 2: 20.0, 3: 30.0}
    seqs = [
        SeqView(0, 100.0, True, False),
        SeqView(1, 99.0, True, False),
        SeqView(2, 1.0, False, False),
    ]
    assert plan_step(seqs, costs) == StepPlan((0, 1), None)
    # After waiting two steps its slack has grown enough: it decodes beside them.
    assert plan_step([*seqs[:2], replace(seqs[2], waited=2)], costs) == StepPlan((0, 1, 2), None)
    # Sizes not measured yet are allowed (that is how they get measured) ...
    assert plan_step(seqs, {2: 20.0}) == StepPlan((0, 1, 2), None)
    # ... once the interactive ones' own pace is known: else they step alone once.
    assert plan_step(seqs, {}) == StepPlan((0, 1), None)
