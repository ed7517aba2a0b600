"""Nothing stranded: a worker that stops for a reason nobody planned leaves no
job `running` without a worker; an error in one job is that job's, and the
worker goes on; Redis refusing writes for a while never stops a worker.

Each cause is forced in a real worker process through the fault wrapper
(tests/faultworker.py), against a real redis-server and llama.cpp."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from jobs.store.identity import ModelIdentity
from jobs.store.scheduling import Store
from scheduler.keys import Keys
from scheduler.settings import load_settings
from tests.integration.helpers import (
    completion_text,
    job,
    read_events,
    reading_in_background,
    submit_stream,
    wait_until,
    web_answers,
)
from tests.integration.test_workers import Cluster, running_cluster

LONG = {"prompt": "A job that must end", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True, "priority": "batch"}  # fmt: skip
#: Each decode step at least 2 ms: a 400-token job runs for a second or more.
SLOW = {"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.002"}


@pytest.fixture
def stack(redis_server, tiny_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    """`parkq web` and no worker yet (each test starts its own)."""
    prefix = f"strand{time.monotonic_ns()}"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, ()) as c:
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        yield c


def _reference(c: Cluster) -> str:
    """LONG's text from an undisturbed worker (started and stopped here)."""
    c.start_worker("ref")
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    text = completion_text(read_events(submit_stream(c.base_url, LONG)))
    ref = c.procs.pop("ref")
    ref.terminate()
    ref.wait(timeout=30)
    wait_until(lambda: c.workers_alive() == 0, timeout=30)
    return text


def _reading(c: Cluster, worker: str, env: dict[str, str]) -> tuple[str, Any, list[Any]]:
    """Start ``worker`` with ``env``, submit LONG and read its stream in the
    background: the job's id, the reading thread and the events read."""
    c.start_worker(worker, env=env)
    resp = submit_stream(c.base_url, LONG)
    thread, seen = reading_in_background(c.base_url, resp, per_connection=1000)
    return resp.headers["X-Job-Id"], thread, seen


def test_a_worker_that_exits_on_an_unplanned_error_leaves_its_job_to_the_next(
    stack: Cluster,
) -> None:
    """The loop fails outside any job (a bug) after 100 tokens: the process
    exits, and its sign-off requeues the job instead of forgetting the worker
    (which left the job `running` for good, its client on keep-alives)."""
    c = stack
    reference = _reference(c)
    job_id, thread, seen = _reading(
        c, "buggy", {**SLOW, "PARKQ_TEST_WORKER_ERROR_AFTER_TOKENS": "100"}
    )
    assert c.procs["buggy"].wait(timeout=60) != 0
    wait_until(lambda: job(c.base_url, job_id)["state"] == "queued", timeout=10)
    c.start_worker("next")  # whoever comes next finishes it
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))  # each once, in order
    assert completion_text(seen) == reference
    assert job(c.base_url, job_id)["state"] == "finished"


def test_an_error_inside_one_job_requeues_it_and_the_worker_goes_on(stack: Cluster) -> None:
    """The job's own path fails once at token 100: the same worker, still
    running, takes it back and finishes it; the client sees one text."""
    c = stack
    reference = _reference(c)
    c.start_worker("w", env={**SLOW, "PARKQ_TEST_JOB_ERROR_AFTER_TOKENS": "100"})
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, LONG)
    job_id = resp.headers["X-Job-Id"]
    thread, seen = reading_in_background(c.base_url, resp, per_connection=1000)
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == reference
    status = job(c.base_url, job_id)
    assert status["state"] == "finished" and status["worker"] == "w"
    assert c.procs["w"].poll() is None  # the worker went on
    # And serves the next job.
    assert read_events(submit_stream(c.base_url, {**LONG, "max_tokens": 20}))[-1][1] == "[DONE]"


def test_a_job_whose_record_cannot_be_read_fails_and_the_worker_goes_on(
    stack: Cluster, redis_server
) -> None:
    """A job whose stored request is not JSON (a bad write, a tool that edited
    Redis): each claim of it fails at its start; after PARKQ_CRASH_LIMIT (3)
    it fails with an error event and [DONE]; the worker serves the next job."""
    c = stack
    resp = submit_stream(c.base_url, LONG)  # no worker yet: it waits in the queue
    job_id = resp.headers["X-Job-Id"]
    key = Keys(c.env["PARKQ_KEY_PREFIX"]).job(job_id)
    redis.Redis.from_url(redis_server.url).hset(key, "request", "{not json")
    c.start_worker("w")
    seen = read_events(resp)
    assert seen[-1][1] == "[DONE]"
    error = json.loads(seen[-2][1])["error"]
    assert error["type"] == "server_error" and error["code"] == "job_error"
    assert error["message"].startswith("The job failed: JSONDecodeError")
    assert job(c.base_url, job_id)["state"] == "failed"
    assert c.procs["w"].poll() is None
    assert read_events(submit_stream(c.base_url, {**LONG, "max_tokens": 20}))[-1][1] == "[DONE]"


def test_redis_refusing_writes_for_a_while_never_stops_a_worker(
    stack: Cluster, redis_server
) -> None:
    """maxmemory reached mid-job (every write refused with OOM for 4 s): the
    worker waits and carries on; the job ends whole once Redis takes writes."""
    c = stack
    reference = _reference(c)
    c.start_worker("w", env=SLOW)
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, LONG)
    job_id = resp.headers["X-Job-Id"]
    thread, seen = reading_in_background(c.base_url, resp, per_connection=1000)
    wait_until(lambda: job(c.base_url, job_id)["tokens"] >= 50, timeout=60)
    r = redis.Redis.from_url(redis_server.url)
    old = r.config_get("maxmemory")["maxmemory"]
    assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    r.config_set("maxmemory", 1)  # below what Redis holds: every write is refused
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.set(f"{job_id}-probe", 1)
        time.sleep(4)
        assert c.procs["w"].poll() is None, "the worker exited while Redis refused writes"
    finally:
        r.config_set("maxmemory", old)
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == reference
    assert job(c.base_url, job_id)["state"] == "finished"
    assert c.procs["w"].poll() is None


def test_twenty_jobs_of_another_model_ahead_never_hide_this_models_job(
    stack: Cluster, redis_server
) -> None:
    """Another deployment's model shares the queue; its 20 jobs wait ahead (more
    than a claim used to read: 16). This model's worker takes its own job."""
    c = stack
    settings = load_settings(key_prefix=c.env["PARKQ_KEY_PREFIX"],
                             queue_name=c.env["PARKQ_QUEUE_NAME"])  # fmt: skip
    other = Store(redis.Redis.from_url(redis_server.url), settings,
                  ModelIdentity("other", "e" * 64, 4096, 100, "f" * 64))  # fmt: skip
    for i in range(20):
        assert other.enqueue(f"other-{i}", "completion", {"prompt": "x"}, 10, time.time())
    c.start_worker("w")
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, {**LONG, "max_tokens": 30})
    seen = read_events(resp)
    assert seen[-1][1] == "[DONE]"
    assert job(c.base_url, resp.headers["X-Job-Id"])["state"] == "finished"
    assert all(other.get(f"other-{i}")["state"] == "queued" for i in range(20))  # type: ignore[index]


def test_a_replay_that_computes_other_tokens_is_never_spliced(stack: Cluster) -> None:
    """The first worker dies after 100 tokens; the one that replays the job
    computes other logits from position 30 on (planted: as another device or
    kernel path rounds otherwise). The client keeps what it had, then gets an
    error and [DONE]: never the continuation of a text it did not see."""
    c = stack
    reference = _reference(c)
    job_id, thread, seen = _reading(c, "first", {**SLOW, "PARKQ_TEST_DIE_AFTER_TOKENS": "100"})
    c.procs["first"].wait(timeout=60)
    c.start_worker("other", env={"PARKQ_TEST_LOGITS_DIFFER_FROM": "30"})
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    error = json.loads(seen[-2][1])["error"]
    assert error["code"] == "replay_diverged"
    kept = completion_text(seen[:-2])
    assert len(seen) - 2 >= 100 and reference.startswith(kept)
    assert job(c.base_url, job_id)["state"] == "failed"
    assert c.procs["other"].poll() is None


def test_a_parked_job_waits_for_its_busy_holder_as_long_as_a_replay_would_cost(
    redis_server, tiny_model: Path, tmp_path: Path
) -> None:
    """A long job runs for seconds, then a short one parks it (one sequence a
    call); an idle worker starts while the short one still runs. Past the 1 s
    affinity the idle worker would replay the long job token by token, which
    costs about as long as it has run: it leaves the job to its holder until
    then, and the holder resumes it once the short job is done."""
    # Priorities that do not age within the test (the suite's age a level
    # every 0.5 s: the long job would soon outrank the short one).
    unaged = {"PARKQ_PRIORITY_LEVEL_SECONDS": "600", "PARKQ_AFFINITY_SECONDS": "1"}
    with running_cluster(redis_server.url, tiny_model, tmp_path, f"holder{time.monotonic_ns()}",
                         (), web_env=unaged) as c:  # fmt: skip
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        _holder_keeps_its_job(c, redis_server, unaged)


def _holder_keeps_its_job(c: Cluster, redis_server: Any, unaged: dict[str, str]) -> None:
    env = {**unaged, "PARKQ_TEST_DECODE_DELAY_SECONDS": "0.02", "PARKQ_MAX_SEQS": "1",
           "PARKQ_PARKED_SEQS": "1"}  # fmt: skip
    c.start_worker("holder", env=env)
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, {**LONG, "max_tokens": 900})
    job_id = resp.headers["X-Job-Id"]
    thread, seen = reading_in_background(c.base_url, resp, per_connection=2000)
    wait_until(lambda: job(c.base_url, job_id)["tokens"] >= 500, timeout=120)  # >= 10 s run
    short = submit_stream(c.base_url, {"prompt": "Quick question", "max_tokens": 400,
                                       "ignore_eos": True, "priority": "interactive"})  # fmt: skip
    wait_until(lambda: job(c.base_url, job_id)["state"] == "parked", timeout=60)
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    key = Keys(c.env["PARKQ_KEY_PREFIX"]).job(job_id)
    ran = float(r.hget(key, "run_seconds") or 0)
    assert ran > 5  # far past the affinity: the old rule let anyone replay it after 1 s
    c.start_worker("idle", env=unaged)
    wait_until(lambda: c.workers_alive() == 2, timeout=60)
    # The test means something only if the idle worker came up while the
    # long job still waited for its holder.
    assert job(c.base_url, job_id)["state"] == "parked", "start the idle worker sooner"
    assert read_events(short)[-1][1] == "[DONE]"
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    record = r.hgetall(key)
    assert record["state"] == "finished"
    if record["worker"] != "holder":  # a slow machine: the short job outlasted the long one's run
        assert float(record["resumed_at"]) - float(record["parked_at"]) >= ran - 0.5


#: The job's stream and event number as a lagging replica has them: its first
#: `keep` events (ARGV[2] fewer than the primary had). KEYS: job, events.
_TRUNCATE = """
local keep = tonumber(redis.call('HGET', KEYS[1], 'seq')) - tonumber(ARGV[2])
local entries = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', keep)
redis.call('DEL', KEYS[2])
for _, e in ipairs(entries) do redis.call('XADD', KEYS[2], e[1], unpack(e[2])) end
redis.call('HSET', KEYS[1], 'seq', keep)
return keep
"""


def test_events_lost_in_a_failover_are_written_again_never_skipped(
    stack: Cluster, redis_server
) -> None:
    """Redis loses the job's last 50 events (as a failover to a replica that had
    not received them does): the worker's next write notices, the job is
    replayed from what Redis holds, and the client's text is the undisturbed
    one, each event once; a client that connects afterwards reads it whole."""
    c = stack
    reference = _reference(c)
    job_id, thread, seen = _reading(c, "w", SLOW)
    wait_until(lambda: job(c.base_url, job_id)["tokens"] >= 150, timeout=60)
    r = redis.Redis.from_url(redis_server.url)
    keys = Keys(c.env["PARKQ_KEY_PREFIX"])
    kept = int(r.eval(_TRUNCATE, 2, keys.job(job_id), keys.events(job_id), "", 50))
    assert kept >= 100
    thread.join(timeout=120)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == reference
    late = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events", stream=True, timeout=60)
    assert completion_text(read_events(late)) == reference
    assert job(c.base_url, job_id)["state"] == "finished"
    counters = r.hgetall(keys.counters)
    assert int(counters.get(b"writes_lost", 0)) >= 1


#: A job's end as a failover to a replica that had not received it leaves it:
#: `running` on its sequence (KEYS[3]) again, its last ARGV[2] events gone.
_UNFINISH = (
    """
redis.call('HSET', KEYS[1], 'state', 'running')
redis.call('HDEL', KEYS[1], 'finished_at')
redis.call('PERSIST', KEYS[1])
local token = redis.call('HGET', KEYS[1], 'exec') .. '.' .. redis.call('HGET', KEYS[1], 'nonce')
redis.call('HSET', KEYS[3], 'job', ARGV[1], 'exec', token)
"""
    + _TRUNCATE
)


def test_a_finish_lost_in_a_failover_is_noticed_and_the_job_ends_again(
    stack: Cluster, redis_server
) -> None:
    """The job finished, but Redis lost its end (its state, its last events and
    its sequence's release), as a failover to a lagging replica does: the
    worker, alive and idle, sees Redis record a job on its sequence that it
    does not run, hands it back, and the job is replayed to the same end."""
    c = stack
    c.start_worker("w")
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, {**LONG, "max_tokens": 60})
    job_id = resp.headers["X-Job-Id"]
    first = read_events(resp)
    assert first[-1][1] == "[DONE]"
    r = redis.Redis.from_url(redis_server.url)
    keys = Keys(c.env["PARKQ_KEY_PREFIX"])
    slot = r.hget(keys.job(job_id), "worker").decode()
    r.eval(_UNFINISH, 3, keys.job(job_id), keys.events(job_id), keys.worker(slot), job_id, 2)
    wait_until(lambda: job(c.base_url, job_id)["state"] == "finished", timeout=60)
    late = requests.get(f"{c.base_url}/v1/jobs/{job_id}/events", stream=True, timeout=60)
    again = read_events(late)
    assert again == first  # the same events, numbered the same, ending with [DONE]
    assert c.procs["w"].poll() is None
