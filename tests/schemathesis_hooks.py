"""Schemathesis hooks for tests/integration/test_schema.py (loaded through
SCHEMATHESIS_HOOKS): generated bodies also carry text that Hypothesis never
generates by default. In some cases one string of the body (key or value) gets
a lone surrogate (sent as JSON's ``\\ud800`` escape, text no UTF-8 can carry),
a NUL or control characters; parkq must answer with a 4xx or an answer,
never a 5xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

#: What goes into the chosen string.
ODD = ("\ud800", "\udfff", "\udc80x", "\x00", "\x01\x1b[31m\x7f")

Path = tuple[Any, ...]


def _texts(value: Any, path: Path = ()) -> list[tuple[Path, bool]]:
    """Where ``value`` holds text: (path, True if the path names a key)."""
    out: list[tuple[Path, bool]] = []
    if isinstance(value, str):
        out.append((path, False))
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                out.append(((*path, key), True))
            out.extend(_texts(item, (*path, key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out.extend(_texts(item, (*path, i)))
    return out


def _with(value: Any, path: Path, is_key: bool, odd: str) -> Any:
    """``value`` with ``odd`` appended to the string (or key) at ``path``."""
    if not path:
        return value + odd if isinstance(value, str) else value
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        if not rest and is_key:
            return {(k + odd if k == head else k): v for k, v in value.items()}
        return {k: (_with(v, rest, is_key, odd) if k == head else v) for k, v in value.items()}
    if isinstance(value, list):
        return [_with(v, rest, is_key, odd) if i == head else v for i, v in enumerate(value)]
    return value


def _json_body(context: Any) -> bool:
    """Whether the operation takes a JSON body (a multipart form, the file
    upload's, cannot carry a lone surrogate at all)."""
    operation = context.operation
    if operation is None:
        return False
    bodies = operation.body
    return any("json" in body.media_type for body in bodies)


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    places = _texts(body) if _json_body(context) else []
    if not places:
        return st.just(body)
    odd = st.tuples(st.sampled_from(places), st.sampled_from(ODD)).map(
        lambda choice: _with(body, choice[0][0], choice[0][1], choice[1])
    )
    # Mostly odd: a generated body has many strings, and only some reach the
    # tokenizer (a prompt, a message); the rest of the run keeps plain bodies.
    return st.one_of(odd, odd, odd, st.just(body))
