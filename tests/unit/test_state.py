import pytest

from scheduler.state import (
    TERMINAL,
    IllegalTransition,
    JobState,
    can_transition,
    check_transition,
    sources,
)


def test_terminal_states_have_no_way_out() -> None:
    for end in TERMINAL:
        for target in JobState:
            assert not can_transition(end, target)


def test_lifecycle_paths() -> None:
    assert check_transition(JobState.QUEUED, JobState.RUNNING) is JobState.RUNNING
    assert can_transition(JobState.RUNNING, JobState.PARKING)
    assert can_transition(JobState.PARKING, JobState.PARKED)
    assert can_transition(JobState.PARKED, JobState.RUNNING)
    with pytest.raises(IllegalTransition):
        check_transition(JobState.QUEUED, JobState.FINISHED)
    with pytest.raises(IllegalTransition):
        check_transition(JobState.PARKED, JobState.PARKING)


def test_sources_feed_the_lua_scripts() -> None:
    assert set(sources(JobState.RUNNING)) == {JobState.QUEUED, JobState.PARKED}
    assert JobState.QUEUED in sources(JobState.CANCELLED)
    assert JobState.FINISHED not in sources(JobState.CANCELLED)
