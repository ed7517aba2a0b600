"""Every stream closes: a reconnect after the end (what a browser's EventSource
does) ends at once, and a job that ended without writing its ``[DONE]`` (a
refused transition, a fenced failure, a vanished record) closes the streams of
the clients still reading it, with its error and a ``[DONE]``."""

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

from scheduler.keys import Keys
from tests.integration.helpers import (
    job,
    read_events,
    sse_lines,
    submit_stream,
    wait_until,
    web_answers,
)
from tests.integration.test_workers import Cluster, running_cluster

SHORT = {"prompt": "Twenty tokens and done", "max_tokens": 20, "temperature": 0,
         "ignore_eos": True}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Two answers, please"}], "max_tokens": 12,
        "n": 2, "temperature": 0.9, "seed": 3}  # fmt: skip


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model: Path, tmp_path_factory) -> Iterator[Cluster]:
    """One worker; idle streams look at their job every second (the keep-alive)."""
    root = tmp_path_factory.mktemp("stream-end")
    with running_cluster(redis_server.url, tiny_model, root, "streamend", ("w",),
                         web_env={"PARKQ_KEEPALIVE_SECONDS": "1"}) as c:  # fmt: skip
        yield c


def _reconnect(c: Cluster, job_id: str, last_id: str) -> requests.Response:
    return requests.get(f"{c.base_url}/v1/jobs/{job_id}/events",
                        headers={"Last-Event-ID": last_id}, stream=True, timeout=20)  # fmt: skip


def _frames(resp: requests.Response) -> list[tuple[str, str]]:
    """Every (id, data) until the server closes the stream (the read timeout
    fails the test if it never does)."""
    out, event_id = [], ""
    for line in sse_lines(resp):
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
    return out


def test_a_reconnect_with_the_last_id_after_done_ends_at_once(stack: Cluster) -> None:
    resp = submit_stream(stack.base_url, SHORT)
    job_id = resp.headers["X-Job-Id"]
    seen = read_events(resp)
    assert seen[-1][1] == "[DONE]"
    t0 = time.monotonic()
    again = _reconnect(stack, job_id, str(seen[-1][0]))
    assert again.status_code == 204 and again.content == b""  # EventSource: stop reconnecting
    assert time.monotonic() - t0 < 5
    # From an id before the end: the rest, its [DONE], and the stream closes.
    rest = _frames(_reconnect(stack, job_id, str(seen[-3][0])))
    assert [(int(i), d) for i, d in rest] == seen[-2:]


def test_an_n2_stream_reconnects_after_one_choice_or_both_finished(stack: Cluster) -> None:
    resp = submit_stream(stack.base_url, CHAT, route="chat/completions")
    response_id = resp.headers["X-Job-Id"]
    frames = _frames(resp)
    assert frames[-1][1] == "[DONE]"
    last_id = frames[-1][0]
    first, second = (int(part) for part in last_id.split(","))
    again = _reconnect(stack, response_id, last_id)
    assert again.status_code == 204
    # Choice 0 finished (the client has its [DONE]), choice 1 three events short
    # of its end: the rest of choice 1, then one [DONE], and the stream closes.
    rest = _frames(_reconnect(stack, response_id, f"{first},{second - 3}"))
    assert rest[-1] == (last_id, "[DONE]")
    assert [i for i, _ in rest[:-1]] == [f"{first},{second - 2}", f"{first},{second - 1}"]
    assert all(json.loads(d)["choices"][0]["index"] == 1 for _, d in rest[:-1])


def _read_in_background(resp: requests.Response) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.extend(_frames(resp)), daemon=True)
    thread.start()
    return thread, got


@pytest.mark.parametrize("ending", ["failed", "cancelled", "vanished"])
def test_a_job_that_ended_without_its_done_closes_every_stream(
    redis_server, tiny_model: Path, tmp_path: Path, ending: str
) -> None:
    """No worker: the job waits in the queue while its client reads keep-alives.
    Then it ends the way a refused transition, a fenced fail or an expired record
    leaves it: its state says so and its stream has no [DONE]."""
    prefix = f"noend{time.monotonic_ns()}"
    with running_cluster(redis_server.url, tiny_model, tmp_path, prefix, (),
                         web_env={"PARKQ_KEEPALIVE_SECONDS": "1"}) as c:  # fmt: skip
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        resp = submit_stream(c.base_url, SHORT)
        job_id = resp.headers["X-Job-Id"]
        thread, got = _read_in_background(resp)
        time.sleep(1.5)  # a keep-alive or two: the job is live
        assert thread.is_alive() and not got
        r = redis.Redis.from_url(redis_server.url)
        key = Keys(prefix).job(job_id)
        if ending == "vanished":
            r.delete(key)
        else:
            r.hset(key, mapping={"state": ending, "error": "The worker lost the job."})
        thread.join(timeout=15)
        assert not thread.is_alive(), "the stream stayed open after its job ended"
        assert got[-1] == ("2", "[DONE]")
        error = json.loads(got[0][1])["error"]
        assert got[0][0] == "1" and len(got) == 2
        expected = {"failed": ("server_error", "The worker lost the job."),
                    "cancelled": ("cancelled", "The job was cancelled."),
                    "vanished": ("server_error", "The job's record is gone.")}  # fmt: skip
        assert (error["type"], error["message"]) == expected[ending]
        if ending != "vanished":
            # A reconnect after those ids finds the job ended and nothing after;
            # one between them gets the rest.
            assert _reconnect(c, job_id, "2").status_code == 204
            assert _frames(_reconnect(c, job_id, "1")) == [("2", "[DONE]")]
            assert job(c.base_url, job_id)["state"] == ending


def test_a_client_reading_when_its_job_finishes_gets_every_event_once(stack: Cluster) -> None:
    """The closing rule never cuts a live stream short or repeats an event."""
    resp = submit_stream(stack.base_url, {**SHORT, "max_tokens": 200})
    job_id = resp.headers["X-Job-Id"]
    seen = read_events(resp)
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert seen[-1][1] == "[DONE]" and job(stack.base_url, job_id)["state"] == "finished"
    wait_until(lambda: job(stack.base_url, job_id)["state"] == "finished", timeout=5)
