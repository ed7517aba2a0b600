"""The step clock: parts and the rest of the busy time."""

from __future__ import annotations

from jobs.worker.stepclock import PARTS, StepClock


def test_the_rest_of_the_busy_time_is_other_and_a_take_starts_over() -> None:
    clock = StepClock()
    clock.add("engine", 0.8)
    clock.add("sampling", 0.05)
    clock.add("redis", 0.1)
    clock.busy += 1.0
    spent = clock.take()
    assert list(spent) == list(PARTS)
    assert spent["engine"] == 0.8 and spent["redis"] == 0.1
    assert abs(spent["other"] - 0.05) < 1e-9
    assert sum(clock.take().values()) == 0.0
