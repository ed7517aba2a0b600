import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.policy import Policy, priority_level


def test_named_and_integer_priorities() -> None:
    assert priority_level("interactive") > priority_level("batch")
    assert priority_level(7) == 7
    for bad in ("urgent", True, 10_000, -10_000):
        with pytest.raises(ValueError):
            priority_level(bad)


def test_higher_priority_runs_first_and_fifo_within_a_level() -> None:
    p = Policy(level_seconds=60, aging_rate=1)
    jobs = {
        "batch-old": p.score(0, 1000.0),
        "inter-new": p.score(10, 1100.0),
        "inter-old": p.score(10, 1050.0),
    }
    assert sorted(jobs, key=jobs.__getitem__) == ["inter-old", "inter-new", "batch-old"]


def test_one_level_is_worth_level_seconds_of_waiting() -> None:
    p = Policy(level_seconds=60, aging_rate=2)
    # A batch job that arrived 61 s before an interactive one (one level up) runs first.
    assert p.score(0, 1000.0) < p.score(1, 1061.0)
    assert p.score(0, 1000.0) > p.score(1, 1059.0)


MILLIS = st.integers(0, 10**9).map(lambda ms: ms / 1000)  # timestamps at 1 ms resolution


@given(
    st.lists(st.tuples(st.integers(-5, 15), MILLIS), min_size=2, max_size=20),
    MILLIS,
    MILLIS,
)
def test_stored_order_equals_effective_order_at_every_instant(
    jobs: list[tuple[int, float]], t1: float, t2: float
) -> None:
    p = Policy(level_seconds=30, aging_rate=1.5)
    by_score = sorted(range(len(jobs)), key=lambda i: (p.score(*jobs[i]), i))
    for now in (t1, t2):
        by_effective = sorted(range(len(jobs)), key=lambda i: (-p.effective(*jobs[i], now), i))
        assert [p.score(*jobs[i]) for i in by_score] == [p.score(*jobs[i]) for i in by_effective]
