"""Batch API parity, against a real `parkq web` and `parkq worker` (tiny model,
the session's redis-server) and the official openai client: signed webhooks the
client verifies (retried until acknowledged, kept across a web restart),
`/v1/responses` as a batch endpoint, `usage` on the batch object,
`output_expires_after`, and a batch that outlives its completion window."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import requests

from tests.conftest import fresh_port
from tests.integration.helpers import children, wait_until
from tests.integration.test_workers import Cluster

SECRET = "whsec_" + base64.b64encode(b"parkq webhook test secret 32 by").decode()
PREFIX = "hooks"


class Receiver:
    """An HTTP endpoint that records each POST and answers the next of
    ``statuses`` (then 200); ``start`` and ``stop`` open and close its port."""

    def __init__(self) -> None:
        self.port = fresh_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        self.got: list[tuple[dict[str, str], bytes, int]] = []
        self.statuses: list[int] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.got.append(({k.lower(): v for k, v in self.headers.items()}, body,
                                     status))  # fmt: skip
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def events(self) -> list[tuple[dict[str, str], bytes]]:
        """The deliveries the endpoint acknowledged."""
        return [(h, b) for h, b, status in self.got if 200 <= status < 300]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cluster(
    redis_server: Any, tiny_model: Path, tmp_path_factory: Any, receiver: Receiver
) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("webhooks")
    env = {"PARKQ_WEBHOOK_URL": receiver.url, "PARKQ_WEBHOOK_SECRET": SECRET,
           "PARKQ_WEBHOOK_BACKOFF_SECONDS": "0.3", "PARKQ_JANITOR_SECONDS": "0.5"}  # fmt: skip
    c = Cluster(redis_server.url, tiny_model, root, prefix=PREFIX)
    c.env.update(env)
    c.start_web()
    c.start_worker("wh")
    try:
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def _batch(client: openai.OpenAI, tmp_path: Path, lines: list[dict[str, Any]], endpoint: Any,
           **extra: Any) -> Any:  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with path.open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                 completion_window="24h", **extra)  # fmt: skip


def _ended(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not end")


def _event_for(receiver: Receiver, batch_id: str, timeout: float = 60) -> list[Any]:
    """The acknowledged deliveries about ``batch_id``, once there is one."""

    def about() -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in receiver.events() if json.loads(b)["data"]["id"] == batch_id]

    wait_until(lambda: bool(about()), timeout=timeout)
    return about()


def _chat(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}],
                     "max_tokens": 10, **body}}  # fmt: skip


def _metric(base_url: str, name: str) -> float:
    for line in requests.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


def test_an_ended_batch_sends_one_signed_event_retried_until_acknowledged(
    client: openai.OpenAI, cluster: Cluster, receiver: Receiver, tmp_path: Path
) -> None:
    receiver.statuses[:] = [503, 500]  # the endpoint refuses twice, then takes it
    before = _metric(cluster.base_url, "parkq_webhooks_delivered_total")
    failed_before = _metric(cluster.base_url, "parkq_webhook_attempts_failed_total")
    lines = [_chat(f"q-{i}", f"Question {i}", seed=i) for i in range(3)]
    batch = _batch(client, tmp_path, lines, "/v1/chat/completions")
    done = _ended(client, batch.id)
    assert done.status == "completed"
    delivered = _event_for(receiver, batch.id)
    assert len(delivered) == 1  # acknowledged once: never sent again
    headers, body = delivered[0]
    event = client.webhooks.unwrap(body, headers, secret=SECRET)
    assert event.type == "batch.completed" and event.data.id == batch.id
    assert event.id == headers["webhook-id"] and event.created_at >= done.created_at
    # Every attempt carried the one event id (receivers deduplicate by it).
    attempts = [h for h, b, _ in receiver.got if json.loads(b)["data"]["id"] == batch.id]
    assert len(attempts) == 3 and {h["webhook-id"] for h in attempts} == {event.id}
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, headers, secret=other)
    assert _metric(cluster.base_url, "parkq_webhooks_delivered_total") == before + 1
    assert _metric(cluster.base_url, "parkq_webhook_attempts_failed_total") == failed_before + 2
    wait_until(lambda: _metric(cluster.base_url, "parkq_webhooks_pending") == 0, timeout=10)
    # usage on the batch object: the sum of its lines' usage.
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    used = [x["response"]["body"]["usage"] for x in out]
    assert done.usage is not None
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in used) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in used) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens


def test_cancelled_and_failed_batches_send_their_own_events(
    client: openai.OpenAI, receiver: Receiver, tmp_path: Path
) -> None:
    bad = _batch(client, tmp_path, [{"custom_id": "x", "method": "POST", "url": "/nowhere",
                                     "body": {}}], "/v1/chat/completions")  # fmt: skip
    assert _ended(client, bad.id).status == "failed"
    long = [_chat(f"l-{i}", "x", max_tokens=3000, ignore_eos=True) for i in range(3)]
    batch = _batch(client, tmp_path, long, "/v1/chat/completions")
    client.batches.cancel(batch.id)
    assert _ended(client, batch.id).status == "cancelled"
    for batch_id, type_ in ((bad.id, "batch.failed"), (batch.id, "batch.cancelled")):
        ((headers, body),) = _event_for(receiver, batch_id)
        assert client.webhooks.unwrap(body, headers, secret=SECRET).type == type_


def test_an_event_waits_in_redis_across_a_web_restart_until_its_endpoint_is_back(
    client: openai.OpenAI, cluster: Cluster, receiver: Receiver, redis_server: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    receiver.stop()  # the endpoint is down: attempts fail to connect
    try:
        bad = _batch(client, tmp_path, [{"custom_id": "x"}], "/v1/chat/completions")
        assert _ended(client, bad.id).status == "failed"
        r = redis.Redis.from_url(redis_server.url, decode_responses=True)
        due = "{" + PREFIX + "}:webhooks"
        wait_until(lambda: r.zcard(due) == 1, timeout=10)
        (event_id,) = r.zrange(due, 0, -1)
        wait_until(lambda: int(r.hget("{" + PREFIX + "}:webhook:" + event_id, "attempts") or 0)
                   >= 2, timeout=30)  # fmt: skip
        # Every web process at once, with no goodbye (gunicorn's workers too):
        # whatever one held in memory is gone.
        web = cluster.procs["web"]
        for pid, _ in children(web.pid):
            os.kill(pid, signal.SIGKILL)
        web.kill()
        web.wait()
        assert r.zcard(due) == 1
    finally:
        receiver.start()
    cluster.start_web()
    wait_until(lambda: cluster.workers_alive() == 1, timeout=60)
    # (A claim the killed process held lapses after its lease: up to a minute.)
    ((headers, body),) = _event_for(receiver, bad.id, timeout=120)
    event = client.webhooks.unwrap(body, headers, secret=SECRET)
    assert event.type == "batch.failed" and event.id == event_id
    wait_until(lambda: r.zcard(due) == 0, timeout=10)


def test_responses_as_a_batch_endpoint_give_what_the_api_gives(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    body = {"model": "tiny", "input": "Tell me about the park.", "max_output_tokens": 12,
            "temperature": 0.7, "seed": 3}  # fmt: skip
    lines = [{"custom_id": "r-1", "method": "POST", "url": "/v1/responses", "body": body},
             {"custom_id": "r-2", "method": "POST", "url": "/v1/responses",
              "body": {**body, "previous_response_id": "resp_x"}}]  # fmt: skip
    batch = _batch(client, tmp_path, lines, "/v1/responses",
                   output_expires_after={"anchor": "created_at", "seconds": 7200})  # fmt: skip
    done = _ended(client, batch.id)
    assert done.status == "completed" and done.endpoint == "/v1/responses"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    (line,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    got = line["response"]["body"]
    direct = client.responses.create(**{k: v for k, v in body.items() if k != "seed"},
                                     extra_body={"seed": 3})  # fmt: skip
    assert got["object"] == "response" and got["status"] == direct.status
    assert got["output"][0]["content"][0]["text"] == direct.output_text
    assert got["usage"]["output_tokens"] == direct.usage.output_tokens
    assert done.usage is not None and done.usage.output_tokens == got["usage"]["output_tokens"]
    (err,) = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "r-2" and "previous_response_id" in err["error"]["message"]
    # output_expires_after: the output file expires that long after it was written.
    out = client.files.retrieve(done.output_file_id)
    assert out.expires_at is not None and out.expires_at - out.created_at == 7200


@pytest.mark.parametrize("how", ["window", "stop cut short"])
def test_a_batch_past_its_completion_window_expires_keeping_what_it_finished(
    client: openai.OpenAI, cluster: Cluster, receiver: Receiver, redis_server: Any,
    tmp_path: Path, how: str,
) -> None:  # fmt: skip
    """``window``: its expires_at passes. ``stop cut short``: a process marked it
    expired and died before stopping its lines: the next read stops them."""
    lines = [_chat("quick", "Hello", max_tokens=4)]
    lines += [_chat(f"slow-{i}", "x", max_tokens=4000, ignore_eos=True) for i in range(12)]
    batch = _batch(client, tmp_path, lines, "/v1/chat/completions")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    key = "{" + PREFIX + "}:batch:" + batch.id

    def quick_done() -> bool:
        job_ids = [json.loads(x)["job"] for x in r.lrange(key + ":items", 0, 0)]
        return bool(job_ids) and r.hget("{" + PREFIX + "}:job:" + job_ids[0], "state") == "finished"

    wait_until(quick_done, timeout=60)
    if how == "window":
        r.hset(key, "expires_at", str(int(time.time()) - 1))  # its window has passed
    else:
        r.hset(key, "expired_at", str(int(time.time())))  # marked, nothing stopped
    done = _ended(client, batch.id, timeout=60)
    assert done.status == "expired" and done.expired_at is not None
    assert done.completed_at is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    finished = [x["custom_id"] for x in out]
    expired = [e["custom_id"] for e in errors]
    # What ended before the window passed is kept; every other line is expired.
    assert finished[0] == "quick" and expired
    assert sorted(finished + expired) == sorted(x["custom_id"] for x in lines)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    counts = done.request_counts
    assert (counts.completed, counts.failed) == (len(finished), len(expired))
    ((headers, body),) = _event_for(receiver, batch.id)
    assert client.webhooks.unwrap(body, headers, secret=SECRET).type == "batch.expired"
    # The engine is free again: nothing of the batch still runs.
    left = [j for j in r.zrange("{" + PREFIX + "}:queue", 0, -1)]
    assert left == []


def test_a_batch_of_an_earlier_release_runs_on_past_its_window(
    client: openai.OpenAI, redis_server: Any, tmp_path: Path
) -> None:
    """Its window was not enforced when it was created: an upgrade does not expire it."""
    lines = [_chat(f"old-{i}", "x", max_tokens=300, ignore_eos=True) for i in range(6)]
    batch = _batch(client, tmp_path, lines, "/v1/chat/completions")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    key = "{" + PREFIX + "}:batch:" + batch.id
    r.hdel(key, "window_enforced")  # as a batch created by an earlier release
    r.hset(key, "expires_at", str(int(time.time()) - 1))
    done = _ended(client, batch.id)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 6
