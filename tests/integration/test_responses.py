"""The Responses API through the official openai client, against a real `parkq
web` and `parkq worker` (tiny model, the session's redis-server): streamed,
background, resumed, cancelled, continued, parked, and through a worker's
SIGKILL and a restart of the web; and service_tier, system_fingerprint,
models.retrieve and x-request-id on the other routes."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.integration.helpers import job, wait_until
from tests.integration.test_workers import Cluster, running_cluster

#: A long response whose every token is drawn (the openai client's default
#: temperature), with a seed: each run of it gives the same text.
LONG: dict[str, Any] = {
    "model": "tiny",
    "input": "Tell me everything about the park.",
    "max_output_tokens": 1500,
    "temperature": 1.0,
    "extra_body": {"seed": 7, "ignore_eos": True, "priority": "batch"},
}


@pytest.fixture(scope="module")
def cluster(redis_server: Any, tiny_model: Path, tmp_path_factory: Any) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("responses")
    with running_cluster(redis_server.url, tiny_model, root, "responses", ("wr",)) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)


def _deltas(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _finished(client: openai.OpenAI, response_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.1)
    raise AssertionError(f"{response_id} did not end")


def test_streamed_non_streamed_and_background_give_one_text(client: openai.OpenAI) -> None:
    args = dict(model="tiny", input="Tell me about the park.", max_output_tokens=40,
                extra_body={"seed": 3, "ignore_eos": True})  # fmt: skip
    whole = client.responses.create(**args)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 40
    assert whole.usage.total_tokens == whole.usage.input_tokens + 40
    events = list(client.responses.create(stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert _deltas(events) == whole.output_text == events[-1].response.output_text
    queued = client.responses.create(background=True, **args)
    assert queued.status in ("queued", "in_progress") and queued.background
    assert _finished(client, queued.id).output_text == whole.output_text


@pytest.mark.parametrize("cut", [1, 2, 5, 17])
def test_a_background_stream_cut_after_n_events_resumes_with_each_event_once(
    client: openai.OpenAI, cut: int
) -> None:
    args = {**LONG, "max_output_tokens": 30}
    seen: list[Any] = []
    with client.responses.create(background=True, stream=True, **args) as first:
        for event in first:
            seen.append(event)
            if len(seen) == cut:
                break
    response_id = seen[0].response.id
    deadline = time.monotonic() + 120
    while seen[-1].type not in ("response.completed", "response.incomplete", "response.failed"):
        assert time.monotonic() < deadline, f"no end after {len(seen)} events"
        after = seen[-1].sequence_number
        with client.responses.retrieve(response_id, stream=True, starting_after=after) as more:
            for event in more:
                seen.append(event)
                if len(seen) % 7 == 0:  # cut again, mid-stream
                    break
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    final = client.responses.retrieve(response_id)
    assert final.status == "incomplete" and _deltas(seen) == final.output_text


def test_a_background_response_runs_on_when_its_reader_leaves(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    """Past the disconnect grace period (1 s here) an interactive job whose
    reader left is cancelled (tests/integration/test_disconnect.py); an
    interactive background response is not. The worker is held (SIGSTOP) while
    the reader is away, so the job cannot end before the grace period has
    passed, however fast the machine."""
    args = {**LONG, "max_output_tokens": 3000, "extra_body": {"seed": 7, "ignore_eos": True}}
    worker = cluster.procs["wr"]
    with client.responses.create(background=True, stream=True, **args) as events:
        seen = iter(events)
        response_id = next(seen).response.id  # an interactive one (the default priority)
        next(e for e in seen if e.type == "response.output_text.delta")  # it runs
        worker.send_signal(signal.SIGSTOP)
    try:
        time.sleep(2.0)  # its reader gone for longer than the grace period (< the TTL, 3 s)
    finally:
        worker.send_signal(signal.SIGCONT)
    final = _finished(client, response_id)
    assert final.status == "incomplete" and final.usage is not None
    assert final.usage.output_tokens == 3000


def test_cancel_while_queued_running_and_parked(client: openai.OpenAI, cluster: Cluster) -> None:
    running = client.responses.create(background=True, **LONG)
    wait_until(lambda: job(cluster.base_url, running.id)["state"] == "running")
    queued = client.responses.create(background=True, **LONG)
    assert client.responses.retrieve(queued.id).status == "queued"
    assert client.responses.cancel(queued.id).status == "cancelled"
    # An interactive chat parks the running batch response (one sequence here).
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    wait_until(lambda: job(cluster.base_url, running.id)["state"] == "parked")
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content) > 0
    again = client.responses.create(background=True, **LONG)
    wait_until(lambda: job(cluster.base_url, again.id)["tokens"] > 5)
    stopped = client.responses.cancel(again.id)
    assert stopped.status == "cancelled" and stopped.output_text
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(_finished(client, client.responses.create(
            background=True, **{**LONG, "max_output_tokens": 3}).id).id)  # fmt: skip
    with pytest.raises(openai.BadRequestError):  # only background ones
        client.responses.cancel(client.responses.create(model="tiny", input="x",
                                                        max_output_tokens=2).id)  # fmt: skip


def test_a_parked_background_response_resumes_with_the_text_of_an_undisturbed_run(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    alone = _finished(client, client.responses.create(background=True, **LONG).id)
    disturbed = client.responses.create(background=True, **LONG)
    wait_until(lambda: job(cluster.base_url, disturbed.id)["tokens"] > 50)
    for _ in range(2):
        client.chat.completions.create(model="tiny", max_tokens=20,
                                       messages=[{"role": "user", "content": "quick"}])  # fmt: skip
    final = _finished(client, disturbed.id)
    assert job(cluster.base_url, disturbed.id)["preemptions"] >= 1
    assert final.output_text == alone.output_text and final.status == "incomplete"


def test_a_background_response_survives_its_worker_s_sigkill_and_a_web_restart(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    alone = _finished(client, client.responses.create(background=True, **LONG).id)
    hit = client.responses.create(background=True, **LONG)
    wait_until(lambda: job(cluster.base_url, hit.id)["tokens"] > 80)
    cluster.procs["wr"].send_signal(signal.SIGKILL)
    cluster.procs["wr"].wait()
    cluster.procs["web"].terminate()
    cluster.procs["web"].wait(timeout=30)
    cluster.start_worker("wr")
    cluster.start_web()
    wait_until(lambda: cluster.workers_alive() == 1, timeout=60)
    final = _finished(client, hit.id)
    assert final.output_text == alone.output_text and final.status == "incomplete"
    events = list(client.responses.retrieve(hit.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _deltas(events) == alone.output_text


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    first = client.responses.create(model="tiny", input="Name a tree.", max_output_tokens=8,
                                    instructions="Be brief.", temperature=0)  # fmt: skip
    second = client.responses.create(model="tiny", input="And a flower?", max_output_tokens=8,
                                     previous_response_id=first.id, temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id and second.instructions is None
    # Its prompt: the first's conversation (not its instructions), its answer, the new input.
    messages = [{"role": "user", "content": "Name a tree."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And a flower?"}]  # fmt: skip
    counted = requests.post(cluster.base_url + "/v1/tokenize", json={"messages": messages},
                            timeout=10).json()["count"]  # fmt: skip
    assert second.usage is not None and second.usage.input_tokens == counted
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, i.role) for i in items] == [("message", "user")]  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")


def test_input_items_tools_and_deletion(client: openai.OpenAI) -> None:
    city = {"type": "string", "enum": ["Paris", "Rome"]}
    tools: Any = [{"type": "function", "name": "weather", "description": "The weather",
              "parameters": {"type": "object", "properties": {"city": city},
                             "required": ["city"], "additionalProperties": False}}]  # fmt: skip
    called = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools,
                                     tool_choice="required", max_output_tokens=400)  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "weather" and "city" in json.loads(calls[0].arguments)
    answer = client.responses.create(
        model="tiny", previous_response_id=called.id, tools=tools, max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete")
    listed = client.responses.input_items.list(answer.id, order="asc").data
    assert [i.type for i in listed] == ["function_call_output"]
    assert client.responses.delete(answer.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "input"),
        ({"model": "tiny", "input": []}, "input"),
        ({"model": "tiny", "input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "tiny", "input": "x", "truncation": "auto"}, "truncation"),
        ({"model": "tiny", "input": [{"role": "wizard", "content": "x"}]}, "input.0.message.role"),
    ],
)
def test_a_bad_response_request_is_a_400_naming_the_field(
    cluster: Cluster, body: dict[str, Any], param: str
) -> None:
    resp = requests.post(cluster.base_url + "/v1/responses", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param)


def test_service_tier_fingerprint_model_and_request_id(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    for tier, level, echoed in (("priority", 20, "priority"), ("flex", 0, "flex"),
                                ("auto", 10, "default"), (None, 10, "default")):  # fmt: skip
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=2,
            **({"service_tier": tier} if tier else {}),
        )  # fmt: skip
        body = raw.parse()
        assert body.service_tier == echoed
        assert job(cluster.base_url, body.id)["priority"] == level
        assert raw.headers["x-request-id"].startswith("req_")
    # parkq's own priority wins over the tier.
    both = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          service_tier="priority",
                                          extra_body={"priority": "batch"})  # fmt: skip
    assert both.service_tier == "flex" and job(cluster.base_url, both.id)["priority"] == 0
    announced = requests.get(cluster.base_url + "/v1/models", timeout=5).json()
    fp = both.system_fingerprint
    assert fp is not None and fp.startswith("fp_")
    streamed = list(client.chat.completions.create(model="tiny", messages=messages,
                                                   max_tokens=3, stream=True))  # fmt: skip
    assert {c.system_fingerprint for c in streamed} == {fp}
    assert client.models.retrieve("tiny").id == announced["data"][0]["id"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    given = requests.get(cluster.base_url + "/v1/jobs/nope", timeout=5,
                         headers={"X-Request-Id": "proxy-42"})  # fmt: skip
    assert given.status_code == 404 and given.headers["x-request-id"] == "proxy-42"
