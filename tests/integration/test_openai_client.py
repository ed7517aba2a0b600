"""The official openai client against a real `parkq up` with the tiny model."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import Server

MESSAGES = [{"role": "user", "content": "Tell me about the park."}]


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish in (["length"], ["stop"])
    assert text
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=16,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_streamed_text_equals_non_streamed_text_for_the_same_seed(
    client: openai.OpenAI, temperature: float
) -> None:
    args = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=40,
        temperature=temperature,
        seed=1234,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, **args))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    streamed_lp = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert full.choices[0].logprobs is not None
    assert streamed_lp == [t.logprob for t in full.choices[0].logprobs.content]
    assert len(streamed_lp) == 40
    assert full.usage is not None and full.usage.completion_tokens == 40


def test_seeded_sampling_differs_across_seeds(client: openai.OpenAI) -> None:
    texts = {
        client.completions.create(
            model="tiny", prompt="The queue", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text
        for seed in (1, 2, 3)
    }  # fmt: skip
    assert len(texts) == 3


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="hello", max_tokens=8, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_models_and_errors_through_the_client(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="x", best_of=2)
    assert "best_of" in str(exc.value)
