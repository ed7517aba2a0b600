"""Generated inputs (issue 33, "every input"): one Hypothesis strategy for the
requests of every POST route and job route, built from the pydantic models
that validate the bodies, and one for batch files as real producers write them.

A body is built from its route's JSON schema (``model_json_schema()``, so a
field added to a model is generated without a change here). Each field is most
often a value its schema describes (so that the checks behind the first one
are reached) and otherwise any JSON at all, or JSON text Python's ``json``
module reads into something odd: 1e400, NaN, a 5,000-digit integer, nesting
3,000 deep. Text is drawn with the characters that broke parkq before or
could: digits that are not ASCII (``'²'.isdigit()``), line and paragraph
separators (``str.splitlines`` splits at them), lone surrogates (sent as
JSON's ``\\ud800`` escape), NUL and other controls, private-use markers and
control-token spellings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st
from pydantic import BaseModel

from web.batches import BatchCreate
from web.schemas import (
    RESPONSES_UNSUPPORTED,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)

__all__ = [
    "FILE_ID",
    "JOB_ID",
    "ODD_CHARS",
    "RESPONSE_ID",
    "Call",
    "JsonlFile",
    "Raw",
    "any_json",
    "body_of",
    "dump",
    "jsonl_files",
    "requests",
    "texts",
]

#: Characters that broke parkq before, or could.
ODD_CHARS = (
    "²", "٣", "\uff11", "\u2028", "\u2029", "\x85", "\x00", "\x1c", "\x1e", "\x0b", "\x0c", "\r",
    "\n", "\ud800", "\udfff", "\ufeff", "\ue000", "\ue001", "\U0001f9e9", "é", "\u200b", "\\",
    '"', "<|user|>", "<|assistant|>", "</s>", "\x7f",
)  # fmt: skip


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is into a body (what ``json.dumps`` cannot write)."""

    text: str


#: JSON texts Python's json module reads into odd values, or refuses oddly.
RAW = tuple(
    Raw(t)
    for t in ("1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1" * 5000, "-0", "1e-400",
              "[" * 3000 + "]" * 3000, '{"a":' * 300 + "1" + "}" * 300, "9" * 40)
)  # fmt: skip
HUGE = (2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, 10**30)


def texts(max_size: int = 12) -> st.SearchStrategy[str]:
    """Text, a third of it with the odd characters."""
    plain = st.text(st.characters(codec="utf-8"), max_size=max_size)
    chars = st.one_of(st.sampled_from(ODD_CHARS), st.characters(codec="utf-8"))
    odd = st.lists(chars, max_size=max_size).map("".join)
    return st.one_of(plain, plain, odd, st.sampled_from(("", "x" * 5000, "word " * 2000)))


def _digits() -> st.SearchStrategy[str]:
    """Token-id-like keys: ASCII digits, and digits str.isdigit() takes but ASCII has not."""
    return st.text(alphabet="019²³¹٣१\uff11", min_size=1, max_size=3)


def any_json() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE),
        st.floats(allow_nan=False, allow_infinity=False), texts(), st.sampled_from(RAW),
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(6), inner, max_size=4),
        max_leaves=10,
    )


class _Schema:
    """Values for a JSON schema (the subset pydantic writes), with its ``$defs``."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})

    def value(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            return st.deferred(lambda: self.value(self.defs[schema["$ref"].split("/")[-1]]))
        for key in ("anyOf", "oneOf"):
            if key in schema:  # (null, the default of an optional field, less often)
                some = [self.value(s) for s in schema[key] if s.get("type") != "null"]
                nulls = [st.none()] if len(some) < len(schema[key]) else []
                return st.one_of(*some, *some, *some, *nulls)
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of(*(self.value({**schema, "type": k}) for k in kind))
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True) | texts()
            return texts(schema.get("maxLength", 12) + 1)
        if kind == "integer":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**64)))
            high = schema.get("maximum", schema.get("exclusiveMaximum", 2**64))
            edges = (low - 1, low, low + 1, high - 1, high, high + 1)
            ints = st.integers(low, min(high, 2**64))
            return st.one_of(ints, ints, st.sampled_from(edges + HUGE))
        if kind == "number":
            low, high = schema.get("minimum"), schema.get("maximum")
            edges = tuple(x for x in (low, high) if x is not None)
            inside = st.floats(low, high, allow_nan=False, allow_infinity=False)
            return st.one_of(inside, inside, st.sampled_from((*edges, 0, -0.0, 1e308, 5e-324)))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = self.value(schema.get("items", {}))
            high = min(schema.get("maxItems", 4), 4) + 1
            return st.lists(items, min_size=schema.get("minItems", 0), max_size=high)
        if kind == "object" or "properties" in schema:
            return self.object(schema)
        return any_json()

    def object(self, schema: dict[str, Any], odd_share: int = 4) -> st.SearchStrategy[Any]:
        """Objects of ``schema``: one in ``odd_share`` with one field anything at all,
        a required one left out, or one no schema names."""
        props: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        if not props:
            values = self.value(extra) if isinstance(extra, dict) else any_json()
            return st.dictionaries(
                st.one_of(_digits(), _digits(), texts(6)), values, min_size=1, max_size=3
            )
        required = set(schema.get("required", ()))
        fixed = {k: self.value(v) for k, v in props.items() if k in required}
        optional = {k: self.value(v) for k, v in props.items() if k not in required}
        # A few of the optional fields at a time (each one could refuse the body).
        names: st.SearchStrategy[frozenset[str]] = (
            st.frozensets(st.sampled_from(sorted(optional)), max_size=5)
            if optional
            else st.just(frozenset())
        )
        body = names.flatmap(
            lambda ks: st.fixed_dictionaries({**fixed, **{k: optional[k] for k in sorted(ks)}})
        )
        anything = st.one_of(any_json(), st.sampled_from(RAW))
        odd = st.tuples(body, st.sampled_from(sorted(props)), anything, st.integers(0, 2)).map(
            lambda t: _mutated(t[0], t[1], t[2], t[3])
        )
        return st.one_of(*[body] * (odd_share - 1), odd)


def _mutated(body: dict[str, Any], key: str, value: Any, how: int) -> dict[str, Any]:
    if how == 0:
        return {**body, key: value}
    if how == 1:
        return {k: v for k, v in body.items() if k != key}
    return {**body, f"{key}_x": value}


def body_of(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Bodies for ``model``'s route: mostly objects from its schema (the OpenAI
    fields parkq refuses included), sometimes any JSON at all."""
    schema = model.model_json_schema()
    gen = _Schema(schema)
    objects = gen.object(schema, odd_share=3)
    if model in (ChatRequest, CompletionRequest, ResponsesRequest):
        table = RESPONSES_UNSUPPORTED if model is ResponsesRequest else UNSUPPORTED
        unused = {k: st.sampled_from(v) | any_json() for k, v in table.items()
                  if k not in model.model_fields}  # fmt: skip
        refused = st.fixed_dictionaries({}, optional=unused)
        objects = st.tuples(objects, st.one_of(st.just({}), st.just({}), refused)).map(
            lambda t: {**t[1], **t[0]} if isinstance(t[0], dict) else t[0]
        )
    return st.one_of(*[objects] * 5, any_json())


def dump(value: Any, ensure_ascii: bool = True) -> str:
    """JSON text of ``value``, each :class:`Raw` written as it is."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        inner = ",".join(f"{dump(k, ensure_ascii)}:{dump(v, ensure_ascii)}"
                         for k, v in value.items())  # fmt: skip
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v, ensure_ascii) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ensure_ascii)


@dataclass(frozen=True)
class Call:
    """One request: a JSON ``body`` (ASCII-escaped or not), or a multipart ``form``,
    or neither."""

    method: str
    path: str
    body: Any = None
    ensure_ascii: bool = True
    form: dict[str, Any] | None = field(default=None)
    has_body: bool = False

    @property
    def data(self) -> bytes | None:
        # Raw non-ASCII text with a lone surrogate is not UTF-8: a body that is not text.
        if not self.has_body:
            return None
        return dump(self.body, self.ensure_ascii).encode("utf-8", "surrogatepass")


def _post(path: str, model: type[BaseModel]) -> st.SearchStrategy[Call]:
    return st.builds(lambda b, a: Call("POST", path, b, a, has_body=True), body_of(model),
                     st.booleans())  # fmt: skip


#: Where a test's own objects go in a path or body: replaced by a real id.
FILE_ID, JOB_ID, RESPONSE_ID = "{file}", "{job}", "{response}"
ID_ROUTES = (
    ("GET", "/v1/jobs/{}"), ("DELETE", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}/events"),
    ("GET", "/v1/jobs/{}/result"), ("GET", "/v1/batches/{}"), ("POST", "/v1/batches/{}/cancel"),
    ("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"), ("DELETE", "/v1/files/{}"),
    ("GET", "/v1/responses/{}"), ("POST", "/v1/responses/{}/cancel"),
    ("DELETE", "/v1/responses/{}"), ("GET", "/v1/responses/{}/input_items"),
    ("GET", "/v1/models/{}"),
)  # fmt: skip


RESPONSE_ROUTES = [r for r in ID_ROUTES if "/v1/responses/" in r[1]]


def _id_call(route: tuple[str, str], ident: str) -> Call:
    return Call(route[0], route[1].format(quote(ident, safe="", errors="surrogatepass")))


def _form(purpose: str | None, content: bytes | None, name: str) -> Call:
    """An upload; a multipart form's fields are bytes, and the test client's
    encoder takes no lone surrogate: those become '?'."""

    def text(value: str) -> str:
        return value.encode("utf-8", "replace").decode()

    form: dict[str, Any] = {}
    if purpose is not None:
        form["purpose"] = text(purpose)
    if content is not None:
        form["file"] = (content, text(name))
    return Call("POST", "/v1/files", form=form)


def requests() -> st.SearchStrategy[Call]:
    """A request to any POST route, or to a job, batch or file route with an odd id."""
    bodies = body_of(BatchCreate)
    with_file = bodies.map(lambda b: {**b, "input_file_id": FILE_ID} if isinstance(b, dict) else b)
    batch = st.builds(lambda b, a: Call("POST", "/v1/batches", b, a, has_body=True),
                      st.one_of(bodies, with_file), st.booleans())  # fmt: skip
    upload = st.builds(
        _form,
        st.one_of(st.none(), st.just("batch"), texts()),
        st.one_of(st.none(), jsonl_files().map(lambda f: f.content), st.binary(max_size=40)),
        texts(),
    )
    ids = st.one_of(texts(), st.sampled_from(("..", ".", "a/b", "%00", JOB_ID, FILE_ID,
                                              RESPONSE_ID)))  # fmt: skip
    return st.one_of(
        _post("/v1/chat/completions", ChatRequest),
        _post("/v1/chat/completions", ChatRequest),
        _post("/v1/completions", CompletionRequest),
        _post("/v1/completions", CompletionRequest),
        _post("/v1/responses", ResponsesRequest),
        _post("/v1/responses", ResponsesRequest),
        _post("/v1/tokenize", TokenizeRequest),
        _post("/v1/detokenize", DetokenizeRequest),
        batch,
        upload,
        st.builds(_id_call, st.sampled_from(ID_ROUTES), ids),
        # A real response's routes (it is cancelled: none waits for a worker).
        st.builds(_id_call, st.sampled_from(RESPONSE_ROUTES), st.just(RESPONSE_ID)),
    )


# -- batch files ------------------------------------------------------------------


@dataclass(frozen=True)
class JsonlFile:
    content: bytes
    #: custom_id of each good line, in order (they all run).
    good: list[str]
    #: how many lines are refused (each one error line).
    bad: int


def _good_line(i: int, text: str, raw: bool) -> tuple[str, str]:
    custom_id = f"ok-{i}-{text}"
    body = {"prompt": f"hi {text}", "max_tokens": 2, "user": text}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    return custom_id, json.dumps(line, ensure_ascii=not raw)


BAD_LINES = (
    '{"custom_id": "bad-bias", "method": "POST", "url": "/v1/completions", '
    '"body": {"prompt": "hi", "logit_bias": {"²": 1}}}',
    '{"custom_id": "bad-url", "method": "POST", "url": "/v1/nope", "body": {"prompt": "hi"}}',
    '{"custom_id": "bad-n", "url": "/v1/completions", "body": {"prompt": "hi", "n": 2}}',
    '{"custom_id": "bad-deep", "url": "/v1/completions", "body": ' + "[" * 3000 + "]" * 3000 + "}",
    '{"custom_id": "bad-nan", "url": "/v1/completions", "body": {"prompt": "hi", "top_p": NaN}}',
    '{"url": "/v1/completions", "body": {"prompt": "no custom_id"}}',
    "[1, 2]",
    '{"custom_id": "cut", "url": ',
    '"\u2028"',
)


def jsonl_files() -> st.SearchStrategy[JsonlFile]:
    """Batch files as producers write them: ``ensure_ascii=False`` (a raw U+2028
    inside a string, as JavaScript's JSON.stringify writes it), CRLF or LF, a
    BOM, blank lines, a last line with or without its newline; some lines bad."""
    safe = st.text(alphabet=["a", "é", "\u2028", "\u2029", "\x85", "²", " ", "\U0001f9e9"],
                   max_size=6)  # fmt: skip
    line = st.one_of(
        st.tuples(safe, st.booleans()).map(lambda t: ("good", t)),
        st.sampled_from(BAD_LINES).map(lambda b: ("bad", b)),
    )
    return st.builds(
        _file,
        st.lists(line, min_size=1, max_size=6),
        st.sampled_from(("\n", "\r\n")),
        st.booleans(),
        st.booleans(),
        st.lists(st.sampled_from(("", "  ", "\t", "\r")), max_size=2),
    )


def _file(lines: list[tuple[str, Any]], eol: str, bom: bool, last_eol: bool,
          blanks: list[str]) -> JsonlFile:  # fmt: skip
    out, good, bad = [], [], 0
    for i, (kind, what) in enumerate(lines):
        if kind == "good":
            custom_id, text = _good_line(i, *what)
            good.append(custom_id)
        else:
            text, bad = what, bad + 1
        out.append(text)
        if i < len(blanks):
            out.append(blanks[i])
    body = ("\ufeff" if bom else "") + eol.join(out) + (eol if last_eol else "")
    return JsonlFile(body.encode(), good, bad)
