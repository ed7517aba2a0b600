"""Jobs through the real pipeline: reconnects, cancellation, priority, rq info."""

from __future__ import annotations

import json
import subprocess
import sys

import requests

from tests.integration.conftest import Server
from tests.integration.helpers import completion_text, job, read_events, submit_stream, wait_until

LONG = {"prompt": "A long story", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def test_reconnect_with_last_event_id_yields_every_token_once(server: Server) -> None:
    body = {"prompt": "Reconnect", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    reference = requests.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    first = submit_stream(server.base_url, body)
    job_id = first.headers["X-Job-Id"]
    part1 = read_events(first, limit=25)
    first.close()
    seen = part1
    # Reconnect twice more, each time from the last event id received.
    for limit in (40, None):
        resp = requests.get(
            f"{server.base_url}/v1/jobs/{job_id}/events",
            headers={"Last-Event-ID": str(seen[-1][0])},
            stream=True,
            timeout=60,
        )
        seen = seen + read_events(resp, limit)
        resp.close()
    ids = [i for i, _ in seen]
    assert ids == list(range(1, len(ids) + 1))
    assert seen[-1][1] == "[DONE]"
    assert completion_text(seen) == reference["choices"][0]["text"]


def test_cancel_a_running_job_stops_it(server: Server) -> None:
    resp = submit_stream(server.base_url, LONG)
    job_id = resp.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, job_id)["tokens"] > 10)
    cancel = requests.delete(f"{server.base_url}/v1/jobs/{job_id}", timeout=10)
    assert cancel.status_code == 202
    events = read_events(resp)
    assert events[-1][1] == "[DONE]"
    assert json.loads(events[-2][1])["error"]["code"] == "job_cancelled"
    status = job(server.base_url, job_id)
    assert status["state"] == "cancelled" and status["tokens"] < 3000


def test_cancel_a_queued_job_it_never_runs(server: Server) -> None:
    long = submit_stream(server.base_url, LONG)
    long_id = long.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, long_id)["state"] == "running")
    queued = submit_stream(server.base_url, {"prompt": "never", "max_tokens": 5})
    queued_id = queued.headers["X-Job-Id"]
    assert job(server.base_url, queued_id)["state"] == "queued"
    assert requests.delete(f"{server.base_url}/v1/jobs/{queued_id}", timeout=10).json() == {
        "id": queued_id,
        "object": "job",
        "state": "cancelled",
    }
    events = read_events(queued)
    assert [d for _, d in events][-1] == "[DONE]"
    requests.delete(f"{server.base_url}/v1/jobs/{long_id}", timeout=10)
    read_events(long)
    status = job(server.base_url, queued_id)
    assert status["state"] == "cancelled" and status["started_at"] is None and status["tokens"] == 0


def test_waiting_jobs_run_in_priority_order(server: Server) -> None:
    long = submit_stream(server.base_url, LONG)
    long_id = long.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, long_id)["state"] == "running")
    batch = submit_stream(
        server.base_url, {"prompt": "batch", "max_tokens": 4, "priority": "batch"}
    )
    inter = submit_stream(
        server.base_url, {"prompt": "chat", "max_tokens": 4, "priority": "interactive"}
    )
    batch_id, inter_id = batch.headers["X-Job-Id"], inter.headers["X-Job-Id"]
    assert job(server.base_url, inter_id)["queue_position"] == 0
    assert job(server.base_url, batch_id)["queue_position"] == 1
    requests.delete(f"{server.base_url}/v1/jobs/{long_id}", timeout=10)
    for resp in (long, batch, inter):
        read_events(resp)
    b, i = job(server.base_url, batch_id), job(server.base_url, inter_id)
    assert b["state"] == i["state"] == "finished"
    assert i["started_at"] < b["started_at"]


def test_rq_info_shows_the_jobs_and_the_worker(server: Server) -> None:
    requests.post(
        server.base_url + "/v1/completions", json={"prompt": "rq", "max_tokens": 3}, timeout=60
    )
    out = subprocess.run(
        [sys.executable, "-m", "rq.cli", "info", "--url", server.redis_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("parkq"))
    finished = int(line.split(" finished")[0].split(",")[-1])
    assert finished >= 1
    r = server.redis
    seen = {
        "parkq workers": r.zrange("{parkq}:workers", 0, -1, withscores=True),
        "rq workers": sorted(r.smembers("rq:workers")),
        "rq worker keys": sorted(r.scan_iter(match="rq:worker:*", count=1000)),
    }
    assert "1 workers" in out.stdout or "workers, 1 queues" in out.stdout, seen


def test_bad_input_against_the_real_tokenizer(server: Server) -> None:
    resp = requests.post(
        server.base_url + "/v1/completions",
        json={"prompt": "word " * 5000, "max_tokens": 10},
        timeout=30,
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
    resp = requests.post(
        server.base_url + "/v1/completions", data=b"x" * (2 << 20), timeout=30,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert resp.status_code == 413
    assert requests.get(server.base_url + "/healthz", timeout=10).status_code == 200


def test_a_job_whose_rq_record_is_deleted_still_runs(server: Server) -> None:
    """rq-dashboard (shipped in compose) can delete a job's RQ record: parkq runs
    the job anyway (the RQ mirror is a read-only view)."""
    blocker = submit_stream(
        server.base_url,
        {"prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "priority": 1000},
    )
    blocker_id = blocker.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, blocker_id)["state"] == "running")
    target = submit_stream(server.base_url, {"prompt": "mine", "max_tokens": 20})
    target_id = target.headers["X-Job-Id"]
    assert job(server.base_url, target_id)["state"] == "queued"
    assert server.redis.delete(f"rq:job:{target_id}") == 1  # rq-dashboard's "delete"
    requests.delete(f"{server.base_url}/v1/jobs/{blocker_id}", timeout=10)
    blocker.close()
    events = read_events(target)
    assert events[-1][1] == "[DONE]" and len(completion_text(events)) > 0
    status = job(server.base_url, target_id)
    assert status["state"] == "finished" and status["tokens"] == 20
    assert server.redis.lrem("rq:queue:parkq", 0, target_id) == 0  # not left in RQ's queue
