"""Structured outputs: a grammar that masks the logits at every step.

A request's ``response_format`` (``json_object``, ``json_schema``) is compiled
once, by the web, into an llguidance grammar (a JSON string) that is stored
with the job. On the worker a :class:`Constraint` holds llguidance's matcher
for it: before each sampling step it masks every token the grammar does not
allow; each sampled token is fed to it; when the grammar is complete the
generation ends. The matcher is decoding state, but it is rebuilt rather than
saved: a generation resumed anywhere (a park, a replay, another worker) feeds
it the tokens generated so far, which puts it in exactly the state it had.

llguidance (https://github.com/guidance-ai/llguidance) is the grammar engine of
llama.cpp and vLLM: a token mask per step in well under a millisecond on a
262k-token vocabulary, JSON schemas compiled to grammars, lazily.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance
import numpy as np

__all__ = [
    "MAX_SCHEMA_BYTES",
    "Constraint",
    "GrammarError",
    "grammar_for_json_object",
    "grammar_for_json_schema",
    "grammar_for_tool_calls",
]

#: The largest JSON schema a request may carry (as JSON text).
MAX_SCHEMA_BYTES = 64 * 1024

#: JSON without free whitespace: the model cannot pad the output forever.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar cannot be compiled (the message says why)."""


def grammar_for_json_schema(schema: Any) -> str:
    """An llguidance grammar for JSON values that validate against ``schema``."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    return _valid(grammar)


def grammar_for_json_object() -> str:
    """An llguidance grammar for any JSON object (OpenAI's ``json_object``)."""
    return _valid(
        llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    )


def grammar_for_tool_calls(functions: dict[str, Any], several: bool) -> str:
    """An llguidance grammar for Hermes-style tool calls only
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, see
    jobs/engine/toolcalls.py): one call, or with ``several`` one or more separated by
    newlines, each naming one of ``functions`` (name -> JSON schema of its
    arguments) with arguments that follow that function's schema."""
    if not functions:
        raise GrammarError("no function to call")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    schema = {"x-guidance": _JSON_OPTIONS, "anyOf": calls}
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the tools are {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    start = 'start: call ("\\n" call)*' if several else "start: call"
    lark = f'{start}\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {json.dumps(schema)}\n'
    return _valid(llguidance.LLMatcher.grammar_from_lark(lark))


def _valid(grammar: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.removeprefix("Error: ").strip())
    return grammar


class Constraint:
    """llguidance's matcher for one generation, with its mask buffer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, n_vocab: int) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._n_vocab = n_vocab
        self._words = (tokenizer.vocab_size + 31) // 32
        self._mask = np.zeros(self._words, dtype=np.int32)

    def feed(self, tokens: Iterable[int]) -> None:
        """Consume tokens sampled under this grammar (a resumed generation's)."""
        for token in tokens:
            self.consume(token)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} refused: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar takes no more tokens (the structure is closed)."""
        return self._matcher.is_stopped()

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar refuses at -inf."""
        self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), count=self._n_vocab, bitorder="little")
        return np.where(bits.view(bool), logits, np.float32(-np.inf))
