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
    assert set(plan.prefill) <= {s.seq for s in prefilling}
    assert len(set(plan.prefill)) == len(plan.prefill)
    interactive = {s.seq for s in prefilling if s.interactive}
    if interactive:
        # Every interactive prompt gets a chunk at every step, and no batch one does.
        assert set(plan.prefill) == interactive
    else:
        assert len(plan.prefill) <= 1


@given(SPECS, COSTS, PREFILL)
def test_without_interactive_decodes_everything_runs(
    specs: list[tuple[bool, bool, int, int]], costs: dict[int, float], prefill_ms: float | None
) -> None:
    seqs = [s for s in _views(specs) if not (s.interactive and not s.prefilling)]
    plan = plan_step(seqs, costs, prefill_ms)
    assert set(plan.decode) == {s.seq for s in seqs if not s.prefilling}
    assert bool(plan.prefill) == any(s.prefilling for s in seqs)


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
        now = {*plan.decode, *plan.prefill}
        for s in now:
            served[s] = True
        for s in plan.prefill:
            chunks[s] -= 1
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
    assert plan_step(seqs, costs) == StepPlan((0, 1))
    # After waiting two steps its slack has grown enough: it decodes beside them.
    assert plan_step([*seqs[:2], replace(seqs[2], waited=2)], costs) == StepPlan((0, 1, 2))
    # Sizes not measured yet are allowed (that is how they get measured) ...
    assert plan_step(seqs, {2: 20.0}) == StepPlan((0, 1, 2))
    # ... once the interactive ones' own pace is known: else they step alone once.
    assert plan_step(seqs, {}) == StepPlan((0, 1))


def test_every_interactive_prompt_gets_a_chunk_each_step_before_any_batch_prompt() -> None:
    """Eight people at once: each prompt is prefilled in the first step (each
    chunk in a call of its own), not one per step behind the others' decodes."""
    arrivals = [SeqView(i, 100.0 - i, True, True) for i in range(8)]
    batch = SeqView(8, 1.0, False, True, waited=50)
    plan = plan_step([*arrivals, batch], {1: 12.0}, prefill_ms=20.0)
    assert plan == StepPlan((), tuple(range(8)))
    # Once they decode, the batch prompt gets its chunk when it fits the slack.
    running = [replace(s, prefilling=False) for s in arrivals]
    assert plan_step([*running, batch], {8: 60.0}, prefill_ms=20.0).prefill == (8,)
