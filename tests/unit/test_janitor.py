"""The janitor under a Redis that refuses writes (maxmemory: OOM): it stops the
sweep and tries again later, and a finished job's events are never let go
before its result is written (they are its only copy until then)."""

from __future__ import annotations

import threading
import time
from typing import Any

import fakeredis
import pytest
import redis

from jobs.store.scheduling import Store
from jobs.worker.loop import Worker
from scheduler.settings import Settings
from tests.fakes import FakeEngine, FakeVocab
from web.app import create_app
from web.janitor import compact_ended

REPLAY = 30


def _finished_job(settings: Settings, fake_redis: fakeredis.FakeRedis) -> tuple[Store, str]:
    app = create_app(settings, vocab=FakeVocab(), client=fake_redis)
    client = app.test_client()
    w = Worker(settings, FakeEngine(), fake_redis, name="w1")
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                    "stream": True})  # fmt: skip
        assert b"data: [DONE]" in resp.get_data()
        job_id = resp.headers["X-Job-Id"]
    finally:
        w.stop()
        thread.join(timeout=10)
    store: Store = app.extensions["parkq"].store
    return store, job_id


def test_a_refused_result_write_keeps_the_events_and_the_job_listed(
    settings: Settings, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, job_id = _finished_job(settings, fake_redis)
    k = store.keys
    assert fake_redis.zscore(k.ended, job_id) is not None
    ttl_before = fake_redis.ttl(k.events(job_id))
    assert ttl_before == -1 or ttl_before > REPLAY

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.OutOfMemoryError(
            "command not allowed when used memory > 'maxmemory'."
        )

    calls = 0
    real_zrange = fake_redis.zrange

    def counting_zrange(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return real_zrange(*args, **kwargs)

    monkeypatch.setattr(store.r, "eval", refuse)
    monkeypatch.setattr(store.r, "zrange", counting_zrange)
    t0 = time.monotonic()
    assert compact_ended(store, REPLAY, seconds=2.0) == 0
    # The sweep tried it once (no spinning over the same ids until its time is
    # up) and left it listed, its events kept as they were, no result.
    assert time.monotonic() - t0 < 1.0 and calls <= 2
    assert fake_redis.zscore(k.ended, job_id) is not None
    assert fake_redis.ttl(k.events(job_id)) == ttl_before
    assert fake_redis.hget(k.job(job_id), "result") is None
    # Redis answers again: the result is written, then the events may go.
    monkeypatch.undo()
    assert compact_ended(store, REPLAY) == 1
    assert fake_redis.hget(k.job(job_id), "result") is not None
    assert 0 < fake_redis.ttl(k.events(job_id)) <= REPLAY
    assert fake_redis.zscore(k.ended, job_id) is None
