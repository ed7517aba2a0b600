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


def test_the_lua_scripts_get_the_same_table() -> None:
    """The prelude every script starts with: state names and the table, as Lua."""
    import fakeredis

    from scheduler.state import lua_prelude

    client = fakeredis.FakeRedis()
    probe = client.register_script(lua_prelude() + "return MAY[ARGV[1]][ARGV[2]] and 1 or 0")
    for source in JobState:
        for target in JobState:
            assert probe(args=[source.value, target.value]) == can_transition(source, target)
    move = client.register_script(lua_prelude() + "return move(KEYS[1], ARGV[1]) and 1 or 0")
    client.hset("job", "state", JobState.FINISHED.value)
    assert move(keys=["job"], args=[JobState.RUNNING.value]) == 0  # refused, unchanged
    assert client.hget("job", "state") == b"finished"
    client.hset("job", "state", JobState.RUNNING.value)
    assert move(keys=["job"], args=[JobState.PARKING.value]) == 1
    assert client.hget("job", "state") == b"parking"
