"""Park and resume with the fake engine: the output never changes."""

from __future__ import annotations

import json

import pytest

from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from jobs.worker.generation import Generation
from jobs.worker.runner import PREEMPT, Start, drive
from tests.fakes import FakeEngine


def _request(prompt: bytes, **kw) -> GenerationRequest:
    return GenerationRequest(
        kind=kw.pop("kind", "completion"),
        model="fake",
        prompt_ids=list(prompt),
        max_tokens=kw.pop("max_tokens", 60),
        sampling=kw.pop("sampling", SamplingParams(temperature=0.8, seed=7)),
        logprobs=True,
        top_logprobs=2,
        **kw,
    )


def _run_alone(
    req: GenerationRequest, n_batch: int, engine: FakeEngine
) -> tuple[list[int], list[str]]:
    gen = Generation("job", req, engine.token_bytes, engine.is_eog)
    out: list[str] = []
    outcome = drive(engine, gen, lambda p: out.extend(p) or 0, n_batch)
    return gen.generated, out + outcome.payloads


def _run_parked(
    req: GenerationRequest, n_batch: int, park_at: set[int], keep_kv: bool, engine: FakeEngine
) -> tuple[list[int], list[str], int]:
    """Park at the given emit calls; resume from a JSON state round trip each time."""
    gen = Generation("job", req, engine.token_bytes, engine.is_eog)
    out: list[str] = []
    calls = {"n": 0}
    start = Start.fresh()
    parks = 0

    def emit(payloads: list[str]) -> int:
        out.extend(payloads)
        calls["n"] += 1
        return PREEMPT if calls["n"] in park_at else 0

    while True:
        outcome = drive(engine, gen, emit, n_batch, start)
        if outcome.state != "parked":
            break
        parks += 1
        start = Start.checkpoint(engine.save_seq()) if keep_kv else Start.replay()
        # Another job uses the engine meanwhile.
        other = Generation(
            "other", _request(b"zz", max_tokens=5), engine.token_bytes, engine.is_eog
        )
        drive(engine, other, lambda p: 0, n_batch)
        state = json.loads(json.dumps(gen.state()))
        gen = Generation.restore("job", req, engine.token_bytes, engine.is_eog, state)
    return gen.generated, out + outcome.payloads, parks


@pytest.mark.parametrize("keep_kv", [True, False])
@pytest.mark.parametrize("park_at", [{3}, {2, 9, 15}, set(range(2, 40, 3))])
def test_parked_generation_is_token_identical(keep_kv: bool, park_at: set[int]) -> None:
    req = _request(b"a prompt of some length", max_tokens=50)
    alone = _run_alone(req, 4, FakeEngine())
    tokens, payloads, parks = _run_parked(req, 4, park_at, keep_kv, FakeEngine())
    # A replay checks only for cancellation, so a park asked for then is not taken.
    assert parks == len(park_at) if keep_kv else parks >= min(len(park_at), 10)
    assert (tokens, payloads) == alone


def test_parking_during_prefill_continues_from_the_chunk() -> None:
    req = _request(b"x" * 30, max_tokens=10)
    alone = _run_alone(req, 4, FakeEngine())
    engine = FakeEngine()
    tokens, payloads, parks = _run_parked(req, 4, {1, 2, 5}, True, engine)
    assert parks == 3 and (tokens, payloads) == alone
    # Each prompt chunk was decoded once: parking in prefill repeats no work.
    chunks = [(4, pos) for pos in range(0, 28, 4)] + [(2, 28)]
    assert [engine.calls.count(c) for c in chunks] == [1] * len(chunks)


def test_tool_call_cut_by_parking_keeps_id_and_arguments() -> None:
    text = b'Sure. <tool_call>{"name": "lookup", "arguments": {"q": "caf\xc3\xa9"}}</tool_call>'
    req = _request(b"p", kind="chat", tools=True, max_tokens=len(text) + 5)
    alone = _run_alone(req, 8, FakeEngine(script=list(text)))
    engine = FakeEngine(script=list(text))
    _, payloads, parks = _run_parked(req, 8, {10, 30, 50}, True, engine)
    assert parks == 3 and payloads == alone[1]
    calls = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in (json.loads(p) for p in payloads if p != "[DONE]")
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert len(calls) == 1
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"q": "café"}'}
    assert calls[0]["id"].startswith("call_")
    finish = json.loads(payloads[-2])["choices"][0]["finish_reason"]
    assert finish == "tool_calls"


def test_a_cached_prompt_prefix_changes_nothing() -> None:
    from jobs.engine.checkpoints import PrefixCache

    first = _request(b"a shared system prompt, then question one?", max_tokens=20)
    second = _request(b"a shared system prompt, then question two!", max_tokens=20)
    cold = _run_alone(second, 4, FakeEngine())
    engine = FakeEngine()
    _run_alone(first, 4, engine)
    cache = PrefixCache(1 << 20)
    cache.put(first.prompt_ids, engine.save_seq())
    hit = cache.best(second.prompt_ids, 4)
    assert hit is not None
    entry, keep = hit
    assert keep == 36 and keep % 4 == 0  # whole chunks of the shared 38-byte prefix
    gen = Generation("job", second, engine.token_bytes, engine.is_eog)
    gen.n_prefilled = keep
    out: list[str] = []
    engine.calls.clear()
    outcome = drive(engine, gen, lambda p: out.extend(p) or 0, 4, Start.prefix(entry.kv, keep))
    assert (gen.generated, out + outcome.payloads) == cold
    assert engine.calls[0] == (4, 36)  # prefill resumed after the cached chunks
