"""``n`` > 1: several choices from one prompt, each a job of its own.

Choice i is what a request with ``n: 1`` and ``seed + i`` gives, token for
token, streamed or not, whether its siblings ran after it on one sequence or
beside it on several, took its prompt's KV or were parked.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.integration.conftest import Server
from tests.integration.helpers import job, sse_lines, submit_stream, wait_until
from tests.integration.test_workers import Cluster, running_cluster
from tools.client import read_counter

MESSAGES = [{"role": "user", "content": "Name three things found in a park."}]
#: A prompt of several prefill chunks (PARKQ_N_BATCH is 16 in the tests).
LONG_PROMPT = " ".join(f"Line {i}: the park opens at dawn and closes at dusk." for i in range(8))


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _events(resp: requests.Response) -> list[tuple[str, str]]:
    """(id, data) of every SSE event until [DONE]."""
    out: list[tuple[str, str]] = []
    event_id = ""
    for line in sse_lines(resp):
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
            if line[6:] == "[DONE]":
                break
    resp.close()
    return out


def _texts(events: list[tuple[str, str]], n: int) -> list[str]:
    texts = [""] * n
    for _, data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            texts[choice["index"]] += choice.get("text") or ""
    return texts


def test_each_chat_choice_is_the_single_choice_of_its_seed(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model="tiny", messages=MESSAGES, max_tokens=30, temperature=0.9,
        logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    several = client.chat.completions.create(n=3, seed=41, **args)
    assert [c.index for c in several.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=41 + i, **args) for i in range(3)]
    for choice, single in zip(several.choices, singles, strict=True):
        assert choice.message.content == single.choices[0].message.content
        assert choice.logprobs is not None and single.choices[0].logprobs is not None
        got = [t.logprob for t in choice.logprobs.content or []]
        assert got == [t.logprob for t in single.choices[0].logprobs.content or []]
        assert choice.finish_reason == "length"
    assert len({c.message.content for c in several.choices}) == 3  # seeds differ
    usage, one = several.usage, singles[0].usage
    assert usage is not None and one is not None
    assert usage.prompt_tokens == one.prompt_tokens  # the prompt counted once
    assert usage.completion_tokens == 90
    assert usage.total_tokens == usage.prompt_tokens + 90


def test_streamed_choices_carry_their_index_then_one_usage_chunk_and_one_done(
    server: Server, client: openai.OpenAI
) -> None:
    body = {"prompt": "The gate", "max_tokens": 20, "temperature": 0.7, "seed": 5, "n": 2,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    resp = submit_stream(server.base_url, body)
    response_id = resp.headers["X-Job-Id"]
    events = _events(resp)
    assert [d for _, d in events].count("[DONE]") == 1 and events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert {c["id"] for c in chunks} == {response_id}
    assert [c for c in chunks if not c["choices"]] == [chunks[-1]]  # usage comes last, once
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finishes) == [0, 1]
    # Event ids: each choice's last event so far, never going back.
    ids = [tuple(map(int, i.split(","))) for i, _ in events]
    assert all(len(i) == 2 for i in ids)
    for prev, cur in itertools.pairwise(ids):
        assert all(a <= b for a, b in zip(prev, cur, strict=True))
    whole = client.completions.create(
        model="tiny", prompt="The gate", max_tokens=20, temperature=0.7, seed=5, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert _texts(events, 2) == [c.text for c in whole.choices]


def test_a_reconnect_with_the_stream_s_last_event_id_loses_and_repeats_nothing(
    server: Server,
) -> None:
    body = {"prompt": "Once", "max_tokens": 60, "temperature": 0.8, "seed": 3, "n": 3,
            "ignore_eos": True}  # fmt: skip
    uninterrupted = _events(submit_stream(server.base_url, body))
    resp = submit_stream(server.base_url, body)
    response_id = resp.headers["X-Job-Id"]
    seen: list[tuple[str, str]] = []
    lines = sse_lines(resp)
    event_id = ""
    for line in lines:  # a dozen events, then the connection drops
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            seen.append((event_id, line[6:]))
            if len(seen) == 12:
                break
    resp.close()
    rest = requests.get(
        f"{server.base_url}/v1/jobs/{response_id}/events",
        headers={"Last-Event-ID": seen[-1][0]},
        stream=True,
        timeout=60,
    )
    assert rest.status_code == 200
    events = seen + _events(rest)
    assert _texts(events, 3) == _texts(uninterrupted, 3)
    assert len(events) == len(uninterrupted)
    status = job(server.base_url, response_id)
    assert status["state"] == "finished"
    assert [c["id"] for c in status["choices"]] == [f"{response_id}_{i}" for i in range(3)]
    assert status["usage"]["completion_tokens"] == 180
    bad = requests.get(
        f"{server.base_url}/v1/jobs/{response_id}/events",
        headers={"Last-Event-ID": "4,5"},  # two ids for three choices
        timeout=10,
    )
    assert bad.status_code == 400 and "3 integers" in bad.json()["error"]["message"]


def test_cancelling_the_response_cancels_every_choice(server: Server) -> None:
    body = {"prompt": "Long", "max_tokens": 3000, "n": 2, "ignore_eos": True,
            "priority": "batch"}  # fmt: skip
    resp = submit_stream(server.base_url, body)
    response_id = resp.headers["X-Job-Id"]
    wait_until(lambda: job(server.base_url, response_id)["tokens"] > 0)
    out = requests.delete(f"{server.base_url}/v1/jobs/{response_id}", timeout=10)
    assert out.status_code in (200, 202)
    events = _events(resp)
    errors = [json.loads(d)["error"] for _, d in events if d.startswith('{"error"')]
    assert len(errors) == 1 and errors[0]["type"] == "cancelled"  # sent once
    wait_until(lambda: job(server.base_url, response_id)["state"] == "cancelled")
    states = {c["state"] for c in job(server.base_url, response_id)["choices"]}
    assert states == {"cancelled"}
    again = requests.delete(f"{server.base_url}/v1/jobs/{response_id}", timeout=10)
    assert again.status_code == 409


def test_a_batch_line_asks_for_one_choice(server: Server) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "x", "max_tokens": 2, "n": 2}}  # fmt: skip
    files = {"file": ("in.jsonl", json.dumps(line) + "\n")}
    up = requests.post(
        f"{server.base_url}/v1/files", files=files, data={"purpose": "batch"}, timeout=10
    )
    batch = requests.post(
        f"{server.base_url}/v1/batches",
        json={"input_file_id": up.json()["id"], "endpoint": "/v1/completions",
              "completion_window": "24h"},
        timeout=10,
    ).json()  # fmt: skip

    def ended() -> bool:
        got = requests.get(f"{server.base_url}/v1/batches/{batch['id']}", timeout=10).json()
        batch.update(got)
        return got["status"] in ("completed", "failed")

    wait_until(ended)
    errors = requests.get(
        f"{server.base_url}/v1/files/{batch['error_file_id']}/content", timeout=10
    ).text
    assert "'n' must be 1" in errors, batch


# -- the prompt computed once, with real quantized weights ---------------------


@pytest.fixture(scope="module")
def singles(redis_server, q8_model: Path, tmp_path_factory) -> list[list[str]]:
    """Each choice's text and logprobs as a request of its own (n: 1, seed + i)."""
    root = tmp_path_factory.mktemp("choices-ref")
    with running_cluster(redis_server.url, q8_model, root, "choicesref", ("one",)) as c:
        return [_logprob_tokens(_events(submit_stream(c.base_url, _body(seed=7 + i))), 1)[0]
                for i in range(3)]  # fmt: skip


def _body(**extra: Any) -> dict[str, Any]:
    return {"prompt": LONG_PROMPT, "max_tokens": 120, "temperature": 0.9, "seed": 7,
            "logprobs": 1, "ignore_eos": True, **extra}  # fmt: skip


def _logprob_tokens(events: list[tuple[str, str]], n: int) -> list[list[str]]:
    """Per choice: each token with its logprob (a text would hide a changed logit)."""
    out: list[list[str]] = [[] for _ in range(n)]
    for _, data in events:
        if data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            lp = choice.get("logprobs")
            if lp:
                pairs = zip(lp["tokens"], lp["token_logprobs"], strict=True)
                out[choice["index"]] += [f"{t}|{v!r}" for t, v in pairs]
    return out


@pytest.fixture
def cluster(redis_server, q8_model: Path, tmp_path: Path) -> Iterator[Cluster]:
    prefix = f"choices{time.monotonic_ns()}"
    with running_cluster(redis_server.url, q8_model, tmp_path, prefix, ()) as c:
        yield c


def _shared(c: Cluster) -> float:
    return read_counter(c.base_url, {}, "parkq_prompt_tokens_shared_total")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequences", ["1", "4"])
def test_siblings_take_the_prompt_computed_once_and_give_what_they_give_alone(
    cluster: Cluster, singles: list[list[str]], sequences: str
) -> None:
    """One sequence: the choices run one after another; four: side by side (the
    later ones wait for the first one's prefill). Either way the prompt is
    computed once and each choice is exactly its single request."""
    c = cluster
    c.start_worker("w", env={"PARKQ_MAX_SEQS": sequences})
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    before = _shared(c)
    resp = submit_stream(c.base_url, _body(n=3, stream_options={"include_usage": True}))
    response_id = resp.headers["X-Job-Id"]
    events = _events(resp)
    assert _logprob_tokens(events, 3) == singles
    prompt_tokens = json.loads(events[-2][1])["usage"]["prompt_tokens"]
    assert prompt_tokens > 3 * 16  # several prefill chunks
    assert _shared(c) - before == 2 * prompt_tokens
    workers = {ch["worker"] for ch in job(c.base_url, response_id)["choices"]}
    assert workers == ({"w"} if sequences == "1" else {"w", "w/1", "w/2"})


@pytest.mark.timeout(300)
def test_a_parked_choice_resumes_exactly(cluster: Cluster, singles: list[list[str]]) -> None:
    """A batch request's choices, one parked for an interactive request."""
    c = cluster
    c.start_worker("w", env={"PARKQ_TEST_DECODE_DELAY_SECONDS": "0.005"})
    wait_until(lambda: c.workers_alive() == 1, timeout=60)
    resp = submit_stream(c.base_url, _body(n=3, priority="batch"))
    response_id = resp.headers["X-Job-Id"]
    result: dict[str, list[tuple[str, str]]] = {}
    reader = threading.Thread(target=lambda: result.setdefault("events", _events(resp)))
    reader.start()
    wait_until(lambda: job(c.base_url, response_id)["tokens"] > 20, timeout=60)
    short = _events(submit_stream(c.base_url, {"prompt": "hi", "max_tokens": 4}))
    assert short[-1][1] == "[DONE]"
    reader.join(timeout=240)
    assert _logprob_tokens(result["events"], 3) == singles
    assert job(c.base_url, response_id)["preemptions"] >= 1
