"""A job whose own writes Redis always refuses (an error reply that is not a
Redis that cannot serve for a while) ends failed after its crash limit, and the
worker goes on with the others; a passing refusal counts as no crash."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from jobs.store.faults import TRANSIENT, passes
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import StepCall, Store
from jobs.worker.loop import Worker
from scheduler.settings import Settings
from tests.fakes import FakeEngine
from tests.unit.test_worker import _running
from tests.unit.test_worker import _wait_state as _wait


def _refused(code: str) -> redis.ResponseError:
    """An error reply as redis-py parses it (the code apart, as status_code)."""
    from redis._parsers.base import BaseParser

    exc = BaseParser.parse_error(f"{code} a reply for this test")
    assert isinstance(exc, redis.ResponseError)
    return exc


def test_the_codes_of_a_redis_that_cannot_serve_pass_and_others_do_not() -> None:
    for code in ("OOM", "READONLY", "MASTERDOWN", "NOREPLICAS", "MISCONF", "UNBLOCKED",
                 "BUSY", "NOSCRIPT", "TRYAGAIN"):  # fmt: skip
        assert passes(_refused(code)), code
    for code in ("ERR", "WRONGTYPE", "NOPERM", "SOMETHINGNEW"):
        assert not passes(_refused(code)), code
    assert passes(redis.ConnectionError("reset")) and passes(redis.TimeoutError("slow"))


def test_a_job_whose_writes_are_always_refused_fails_and_the_others_run(
    fake_redis: fakeredis.FakeRedis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "jobs.worker.execution.WRITE_RETRY", Retry(NoBackoff(), 1, supported_errors=TRANSIENT)
    )
    store = Store(fake_redis, settings)
    rq = RQBridge(fake_redis, settings.queue_name, settings.result_ttl)
    req = GenerationRequest("completion", "fake", list(b"hello"), 5, SamplingParams(temperature=0))
    for job_id, priority in (("bad", 10), ("good", 5)):
        rq.create(job_id, "test")
        store.enqueue(job_id, "completion", req.to_json(), priority, time.time())
    worker = Worker(settings, FakeEngine(), fake_redis, name="w0")
    steps = worker.store.steps

    def refuse_bad(calls: list[StepCall]) -> Any:
        if any(c.job_id == "bad" for c in calls):
            raise _refused("WRONGTYPE")
        return steps(calls)

    worker.store.steps = refuse_bad  # type: ignore[method-assign]
    with _running(worker):
        bad = _wait(store, "bad", {"failed"})
        good = _wait(store, "good", {"finished"})
    assert int(bad.get("crashes", 0)) >= settings.crash_limit
    assert good["tokens"] == "5"
