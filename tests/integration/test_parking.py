"""Parking through the real pipeline: one worker, the tiny model, real Redis."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from jobs.worker.stepclock import PARTS
from scheduler.keys import Keys
from tests.integration.conftest import TEST_ENV, Server, start_parkq, stop_parkq
from tests.integration.helpers import (
    completion_text,
    job,
    logprob_tokens,
    read_events,
    reading_in_background,
    submit_stream,
    wait_until,
)
from tests.integration.test_workers import running_cluster


def _long(temperature: float | None, **kw) -> dict[str, Any]:
    """A long batch job; ``temperature`` None sends none (the API's default, 1)."""
    body = {
        "prompt": kw.pop("prompt", "The long batch job begins"),
        "max_tokens": kw.pop("max_tokens", 2500),
        "temperature": temperature,
        "seed": 42,
        "logprobs": 2,
        "ignore_eos": True,
        "priority": "batch",
        **kw,
    }
    return {k: v for k, v in body.items() if v is not None}


#: Every sampling mode a request can ask for, each through a park and back:
#: greedy, a temperature, and the openai client's defaults (no temperature)
#: with every knob that narrows or bends the distribution.
SAMPLING: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "defaults and every knob": {
        "temperature": None, "top_p": 0.9, "top_k": 50, "min_p": 0.02,
        "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {"7": 1.5},
    },
}  # fmt: skip


SHORT: dict[str, Any] = {"prompt": "Quick question", "max_tokens": 4, "priority": "interactive"}


def _reference(server: Server, body: dict[str, Any]) -> list[tuple[int, str]]:
    resp = submit_stream(server.base_url, body)
    events = read_events(resp)
    resp.close()
    assert job(server.base_url, resp.headers["X-Job-Id"])["preemptions"] == 0
    return events


def _interrupt(server: Server, job_id: str, times: int) -> list[float]:
    """Send ``times`` short interactive requests while ``job_id`` runs; their TTFTs."""
    ttfts = []
    for _ in range(times):
        start = job(server.base_url, job_id)["tokens"]

        def progressed(start: int = start) -> bool:
            status = job(server.base_url, job_id)
            return status["state"] == "running" and status["tokens"] > start + 3

        wait_until(progressed)
        t0 = time.monotonic()
        resp = submit_stream(server.base_url, SHORT)
        first = read_events(resp, limit=1)
        ttfts.append(time.monotonic() - t0)
        rest = read_events(resp)
        resp.close()
        assert first and rest[-1][1] == "[DONE]"
    return ttfts


@pytest.fixture(scope="module")
def unaged(redis_server: Any, tiny_model: Path) -> Iterator[Server]:
    """A stack where a running job parks at the next step for a better one (no
    minimum run time) and waiting jobs gain a priority level a minute (the
    suite's: every 0.5 s). With the suite's settings ten interruptions of one
    2,500-token job were not always ten parks: each resumed run first kept the
    engine 50 ms (a few hundred tokens here), so the job could end before the
    tenth; and a slow machine ages it past interactive requests after 5 s."""
    env = {**TEST_ENV, "PARKQ_MIN_RUN_SECONDS": "0", "PARKQ_PRIORITY_LEVEL_SECONDS": "60",
           "PARKQ_KEY_PREFIX": "unaged", "PARKQ_QUEUE_NAME": "unaged"}  # fmt: skip
    proc, base = start_parkq(tiny_model, redis_server.url, env=env)
    yield Server(base, redis_server.url, proc)
    stop_parkq(proc)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("parks", [1, 3, 10])
def test_parked_job_is_token_identical(unaged: Server, parks: int, sampling: str) -> None:
    server = unaged
    body = _long(**SAMPLING[sampling])
    reference = _reference(server, body)
    resp = submit_stream(server.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    _interrupt(server, job_id, parks)
    events = read_events(resp)
    resp.close()
    assert job(server.base_url, job_id)["preemptions"] == parks
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)
    assert len(logprob_tokens(events)) == 2500


def test_parking_during_prefill_continues_from_its_chunk(
    redis_server: Any, tiny_model: Path, tmp_path: Path
) -> None:
    prompt = "the park " * 1000  # 2,000 tokens: 125 chunks of 16
    body = _long(0.0, prompt=prompt, max_tokens=200)
    prefix = "prefillpark"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, ()) as c:
        # Every prefill chunk takes at least 10 ms: the prompt is still being
        # prefilled (1.25 s or more) when the short request arrives, on any machine.
        c.start_worker("w", env={"PARKQ_TEST_PREFILL_DELAY_SECONDS": "0.01"})
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        # The interrupted run goes first: the reference run after it may reuse the
        # prompt's cached KV (which changes nothing), but this one must prefill.
        resp = submit_stream(c.base_url, body)
        job_id = resp.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, job_id)["state"] == "running", timeout=30)
        short = submit_stream(c.base_url, SHORT)
        assert read_events(short, limit=1)
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        checkpoint = json.loads(client.hget(Keys(prefix).job(job_id), "checkpoint") or "{}")
        client.close()
        read_events(short)
        short.close()
        events = read_events(resp)
        resp.close()
        assert job(c.base_url, job_id)["preemptions"] == 1
        reference = read_events(submit_stream(c.base_url, body))
    assert checkpoint["generated"] == [] and 0 < checkpoint["n_prefilled"] < 2000
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)


def test_short_request_starts_within_a_step_of_arriving(server: Server) -> None:
    idle = []
    for _ in range(3):
        t0 = time.monotonic()
        resp = submit_stream(server.base_url, SHORT)
        read_events(resp, limit=1)
        idle.append(time.monotonic() - t0)
        read_events(resp)
        resp.close()
    resp = submit_stream(server.base_url, _long(0.0))
    job_id = resp.headers["X-Job-Id"]
    busy = _interrupt(server, job_id, 3)
    events = read_events(resp)
    resp.close()
    long_job = job(server.base_url, job_id)
    assert long_job["preemptions"] == 3 and events[-1][1] == "[DONE]"
    # Behaviour, not speed: under load the short request waited for one step and
    # a park, not for the 2,500-token job (which takes seconds here).
    assert max(busy) < min(idle) + 1.0
    assert long_job["finished_at"] - long_job["started_at"] > max(busy)


def test_reconnecting_reader_across_parks_gets_every_event_once(server: Server) -> None:
    body = _long(0.8, max_tokens=1500)
    reference = _reference(server, body)
    resp = submit_stream(server.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    thread, seen = reading_in_background(server.base_url, resp, per_connection=150)
    _interrupt(server, job_id, 3)
    thread.join(timeout=60)
    assert seen and seen[-1][1] == "[DONE]"
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == completion_text(reference)


def test_cancel_a_parked_job_leaves_the_runner_alone(server: Server) -> None:
    long = submit_stream(server.base_url, _long(0.0))
    long_id = long.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, long_id)["tokens"] > 5)
    chat = submit_stream(server.base_url, {**SHORT, "max_tokens": 600, "ignore_eos": True})
    chat_id = chat.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, long_id)["state"] == "parked")
    wait_until(lambda: job(server.base_url, chat_id)["state"] == "running")
    resp = requests.delete(f"{server.base_url}/v1/jobs/{long_id}", timeout=10)
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    long_events = read_events(long)
    assert json.loads(long_events[-2][1])["error"]["code"] == "job_cancelled"
    chat_events = read_events(chat)
    chat.close()
    long.close()
    assert job(server.base_url, chat_id)["tokens"] == 600
    assert json.loads(chat_events[-2][1])["choices"][0]["finish_reason"] == "length"
    assert job(server.base_url, long_id)["state"] == "cancelled"


def test_batch_job_finishes_under_a_continuous_stream_of_interactive_requests(
    server: Server,
) -> None:
    # Test settings: 10 levels * 0.5 s + margin 0.2 s: after ~5.2 s of age no new
    # interactive request can preempt or overtake the batch job.
    resp = submit_stream(server.base_url, _long(0.0, max_tokens=1500))
    job_id = resp.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, job_id)["state"] == "running")
    stop = threading.Event()
    served = []

    def chatter() -> None:
        while not stop.is_set():
            r = requests.post(
                server.base_url + "/v1/completions",
                json={**SHORT, "max_tokens": 30, "ignore_eos": True},
                timeout=60,
            )
            served.append(r.status_code)

    threads = [threading.Thread(target=chatter) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        events = read_events(resp)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        resp.close()
    batch = job(server.base_url, job_id)
    assert events[-1][1] == "[DONE]" and batch["state"] == "finished"
    assert batch["preemptions"] >= 1
    assert len(served) > 10 and set(served) == {200}


def test_a_follow_up_reuses_the_cached_prompt_and_changes_nothing(server: Server) -> None:
    history = "the answer to the question is " * 60  # about 400 tokens of conversation
    first = {**_long(0.8, max_tokens=40), "prompt": history + "one", "priority": "interactive"}
    follow = {**first, "prompt": history + "two more"}
    hits = "{parkq}:samples:prefix_hit_tokens"
    cold = _reference(server, follow)  # runs cold: nothing cached starts like it yet
    before = server.redis.llen(hits)
    _reference(server, first)
    warm = _reference(server, follow)
    assert server.redis.llen(hits) > before
    assert int(float(server.redis.lindex(hits, 0) or 0)) >= 16 * 20
    assert completion_text(warm) == completion_text(cold)
    assert logprob_tokens(warm) == logprob_tokens(cold)


def _metrics(server: Server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_metrics_parse_and_move_as_jobs_run_and_park(server: Server) -> None:
    before = _metrics(server)
    resp = submit_stream(server.base_url, _long(0.0, max_tokens=600))
    job_id = resp.headers["X-Job-Id"]
    _interrupt(server, job_id, 1)
    read_events(resp)
    # The step clock reaches the counters with the worker's next flush (one
    # heartbeat interval, 0.5 s in the tests).
    wait_until(
        lambda: (
            _metrics(server)["parkq_step_seconds_total{part=engine}"]
            > before.get("parkq_step_seconds_total{part=engine}", 0.0)
        ),
        timeout=30,
    )
    after = _metrics(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # Where the worker's busy time went: the engine above all, sampling and
    # Redis each a share (greedy here: sampling is an argmax).
    split = {p: moved(f"parkq_step_seconds_total{{part={p}}}") for p in PARTS}
    assert split["engine"] > 0 and split["redis"] > 0 and split["sampling"] > 0
    assert split["engine"] > split["sampling"]

    assert moved("parkq_preemptions_total{}") == 1
    assert moved("parkq_tokens_generated_total{}") >= 600 + SHORT["max_tokens"]
    assert moved("parkq_jobs_ended_total{state=finished}") == 2
    assert moved("parkq_park_latency_seconds_count{}") == 1
    assert moved("parkq_resume_latency_seconds_count{}") == 1
    assert moved("parkq_ttft_seconds_count{priority=interactive}") == 1
    assert moved("parkq_ttft_seconds_count{priority=batch}") == 1
    # Each job waited in the queue once (its first claim; the parked one's
    # resume is not a wait from arrival), and the buckets reach an hour.
    assert moved("parkq_queue_wait_seconds_count{priority=interactive}") == 1
    assert moved("parkq_queue_wait_seconds_count{priority=batch}") == 1
    assert "parkq_queue_wait_seconds_bucket{le=3600.0,priority=batch}" in after
    assert "parkq_ttft_seconds_bucket{le=3600.0,priority=batch}" in after
    assert moved("parkq_inter_token_latency_seconds_count{}") >= 500
    assert after["parkq_workers_alive{}"] == 1
    assert after["parkq_jobs_running{}"] == 0 and after["parkq_jobs_parked{}"] == 0
    # The resumed job's checkpoint was used up: the next heartbeat reports none held.
    wait_until(lambda: _metrics(server)["parkq_checkpoint_bytes{}"] == 0, timeout=10)
