"""The llama.cpp engine with the generated tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jobs.engine.llama import LlamaEngine


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> LlamaEngine:
    return LlamaEngine(str(tiny_model), n_ctx=1024, n_batch=512)


def _greedy(engine: LlamaEngine, prompt: list[int], n: int) -> list[int]:
    engine.clear()
    logits = engine.eval(prompt, 0)
    out, pos = [], len(prompt)
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = engine.eval([tok], pos)
        pos += 1
    return out


def test_utf8_round_trips_through_the_tokenizer(engine: LlamaEngine) -> None:
    text = "Hello, wörld! 日本語 🙂 tab\there"
    ids = engine.tokenize(text, add_bos=False, special=False)
    assert b"".join(engine.token_bytes(t) for t in ids).decode().lstrip() == text


def test_greedy_decoding_is_reproducible_across_loads(
    engine: LlamaEngine, tiny_model: Path
) -> None:
    prompt = engine.tokenize("The park queue")
    first = _greedy(engine, prompt, 50)
    other = LlamaEngine(str(tiny_model), n_ctx=1024, n_batch=512)
    try:
        assert _greedy(other, prompt, 50) == first
    finally:
        other.close()
    assert len(set(first)) > 3


def test_chat_template_comes_from_the_model(engine: LlamaEngine) -> None:
    prompt, stops = engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<|user|>\nhi\n<|assistant|>\n"
    assert stops == ["</s>"]


def test_sequence_state_round_trip_continues_identically(engine: LlamaEngine) -> None:
    prompt = engine.tokenize("checkpoint me " * 20)
    reference = _greedy(engine, prompt, 30)
    # Decode the prompt and 10 tokens, save the KV, clobber it, restore, continue.
    head = _greedy(engine, prompt, 10)
    state = engine.save_seq()
    _greedy(engine, engine.tokenize("something else entirely"), 5)
    engine.clear()
    engine.load_seq(state)
    # Logits are not part of the state: re-decode the last token to get them back.
    pos = len(prompt) + 9
    engine.truncate(pos)
    logits = engine.eval([head[-1]], pos)
    tail = []
    pos += 1
    for _ in range(20):
        tok = int(np.argmax(logits))
        tail.append(tok)
        logits = engine.eval([tok], pos)
        pos += 1
    assert head + tail == reference
