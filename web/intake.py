"""Requests in: a route's JSON body, validated, becomes the job the workers
run (a :class:`GenerationRequest`), refused with the reason when it cannot."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from flask import g, has_request_context, request

from jobs.engine.constraints import (
    GrammarError,
    grammar_for_json_object,
    grammar_for_json_schema,
    grammar_for_tool_calls,
)
from jobs.engine.prompts import ChatVocab, TemplateError, chat_ids
from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from scheduler.policy import SERVICE_TIERS, priority_level
from web.errors import BadRequest, ContextLengthExceeded, ModelMismatch
from web.runtime import Runtime, current
from web.schemas import ChatRequest, CompletionRequest, _Common
from web.tenants import caller

__all__ = [
    "chat_job",
    "check_model",
    "completion_job",
    "parse_json",
    "priority",
    "prompt_ids",
    "read_body",
    "unencodable",
]


def unencodable(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first text in ``value``, key or
    value, that is not Unicode text UTF-8 can carry (a lone surrogate such as
    JSON's ``"\\ud800"``); None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if unencodable(key, where) is not None:
                return f"{path}.<key>" if path else "<key>"
            if (found := unencodable(item, where)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := unencodable(item, f"{path}[{i}]")) is not None:
                return found
    return None


def check_text(value: Any) -> Any:
    """``value`` if every text in it can be encoded; else a 400 naming the field."""
    where = unencodable(value)
    if where is not None:
        raise BadRequest(
            f"'{where}' is not valid Unicode text: it holds a lone surrogate (such as "
            "\\ud800), which no UTF-8 text can carry.",
            param=where,
            code="invalid_text",
        )
    return value


#: Deepest nesting of arrays and objects a body may have (OpenAI's request
#: schemas go a few levels deep; a JSON schema in ``response_format`` or a
#: tool's parameters some more).
MAX_DEPTH = 64


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def depth_over(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep
    (checked without recursion)."""
    level: list[tuple[Any, int]] = [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            level.extend((child, depth + 1) for child in children)
    return False


def parse_json(data: bytes | str) -> Any:
    """JSON as RFC 8259 has it (no NaN or Infinity), nested at most MAX_DEPTH
    deep; ValueError otherwise."""
    try:
        value = json.loads(data, parse_constant=_not_json)
    except RecursionError:  # nested past the interpreter's stack
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None
    if depth_over(value):
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    return value


def read_body() -> Any:
    try:
        body = parse_json(request.get_data(cache=False))
    except UnicodeDecodeError:
        raise BadRequest("The request body is not valid JSON (nor UTF-8 text).") from None
    except ValueError as exc:
        raise BadRequest(f"The request body is not valid JSON: {_head(exc)}.") from None
    return check_text(body)


def _head(exc: Exception) -> str:
    """The first line of an error's message, shortened."""
    text = str(exc).split("\n", 1)[0]
    return text if len(text) <= 200 else text[:200] + "..."


#: The response header that says a request runs at a lower priority than it
#: asked for: ``<level it runs at>; requested=<level it asked for>``.
CLAMPED_HEADER = "X-Parkq-Priority-Clamped"


def priority(req: _Common) -> int:
    """The request's level: its ``priority`` where given, else its
    ``service_tier``'s, else interactive; at most its key's ``max_priority``
    (scheduler/tenancy.py), and then the response says so (:data:`CLAMPED_HEADER`,
    and the ``service_tier`` it echoes)."""
    if "priority" not in req.model_fields_set and req.service_tier is not None:
        level = SERVICE_TIERS[req.service_tier]
    else:
        try:
            level = priority_level(req.priority)
        except ValueError as exc:
            raise BadRequest(str(exc), param="priority") from None
    cap = caller().policy.max_priority
    if cap is not None and level > cap:
        g.parkq_clamped = f"{cap}; requested={level}"
        return cap
    return level


def clamped() -> str | None:
    """What :func:`priority` clamped in this request, for :data:`CLAMPED_HEADER`."""
    found: str | None = g.get("parkq_clamped") if has_request_context() else None
    return found


def _limit(prompt_tokens: int, asked: int | None, default: int | None) -> int:
    n_ctx = current().n_ctx
    room = n_ctx - prompt_tokens
    if asked is None:
        asked = room if default is None else min(default, room)
        if asked < 1:
            raise ContextLengthExceeded(
                f"The prompt is {prompt_tokens} tokens; the context holds {n_ctx}, "
                "leaving no room to generate.",
                param="messages",
            )
    if prompt_tokens + asked > n_ctx:
        raise ContextLengthExceeded(
            f"This model's context holds {n_ctx} tokens, but the request needs "
            f"{prompt_tokens + asked} ({prompt_tokens} in the prompt, {asked} to generate).",
            param="max_tokens",
        )
    return asked


def _sampling(req: _Common) -> SamplingParams:
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float]:
    """The biases by token id; the keys are ASCII digits (web/schemas.py)."""
    n_vocab = current().vocab.n_vocab
    for token in bias or {}:
        if int(token, 10) >= n_vocab:
            raise BadRequest(
                f"logit_bias names token {token}; the vocabulary has {n_vocab}", param="logit_bias"
            )
    return {str(int(k, 10)): float(v) for k, v in (bias or {}).items() if v}


def _grammar(req: _Common) -> str | None:
    """The grammar of the request's ``response_format`` (None: free text)."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    try:
        if rf.type == "json_object":
            return grammar_for_json_object()
        if rf.json_schema is None:
            raise GrammarError("json_schema requires a 'json_schema' object with a 'schema'")
        return grammar_for_json_schema(rf.json_schema.json_schema)
    except GrammarError as exc:
        raise BadRequest(f"Invalid response_format: {exc}", param="response_format") from None


def _functions(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool's function name and the JSON schema of its arguments."""
    out: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(
                "each tool must be {'type': 'function', 'function': {'name': ...}}",
                param=f"tools.{i}",
            )
        parameters = function.get("parameters") if isinstance(function, dict) else None
        out[name] = parameters if isinstance(parameters, dict) else {"type": "object"}
    return out


def _tool_grammar(req: ChatRequest) -> str | None:
    """The grammar that ``tool_choice`` asks for: None unless a call is required."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        if req.parallel_tool_calls is False:
            raise BadRequest(
                "parallel_tool_calls=false is supported with tool_choice 'required' or a "
                "named function",
                param="parallel_tool_calls",
            )
        return None
    if not req.tools:
        raise BadRequest("tool_choice needs tools", param="tool_choice")
    functions = _functions(req.tools)
    if not isinstance(choice, str):
        name = choice.function.name
        if name not in functions:
            raise BadRequest(
                f"tool_choice names '{name}', which is not in tools", param="tool_choice"
            )
        functions = {name: functions[name]}
    if req.response_format is not None and req.response_format.type != "text":
        raise BadRequest(
            "give response_format or a required tool call, not both", param="tool_choice"
        )
    try:
        return grammar_for_tool_calls(functions, several=req.parallel_tool_calls is not False)
    except GrammarError as exc:
        raise BadRequest(f"Invalid tools: {exc}", param="tools") from None


def prompt_ids(
    vocab: ChatVocab, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[str]]:
    """The chat prompt's token ids and stop strings; a 400 when the chat template
    cannot render the messages (or tools) it was given."""
    try:
        return chat_ids(vocab, messages, tools)
    except TemplateError as exc:
        raise BadRequest(str(exc), param="messages", code="chat_template_error") from None
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from None


def chat_job(req: ChatRequest) -> GenerationRequest:
    runtime = current()
    messages = [m.as_template_input() for m in req.messages]
    tools = None if req.tool_choice == "none" else req.tools
    if tools:
        _functions(tools)  # the shape a template reads, checked before it renders them
    grammar = _tool_grammar(req) or _grammar(req)
    ids, template_stops = prompt_ids(runtime.vocab, messages, tools)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    return GenerationRequest(
        kind="chat",
        model=runtime.model_name,
        prompt_ids=ids,
        max_tokens=_limit(len(ids), req.token_limit, None),
        sampling=_sampling(req),
        stop=tuple(req.stop or []) + tuple(template_stops),
        logprobs=req.logprobs,
        top_logprobs=top,
        ignore_eos=req.ignore_eos,
        include_usage=req.include_usage,
        tools=bool(tools),
        created=int(time.time()),
        grammar=grammar,
    )


def completion_job(req: CompletionRequest) -> GenerationRequest:
    runtime = current()
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < runtime.vocab.n_vocab for t in ids):
            raise BadRequest("prompt token id out of the vocabulary", param="prompt")
        text = b"".join(runtime.vocab.token_bytes(t) for t in ids).decode(errors="replace")
    else:
        text = str(prompt[0] if isinstance(prompt, list) else prompt)
        ids = runtime.vocab.tokenize(text, special=False)
    if not ids:
        raise BadRequest("The prompt is empty.", param="prompt")
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported", param="echo")
    return GenerationRequest(
        kind="completion",
        model=runtime.model_name,
        prompt_ids=ids,
        max_tokens=_limit(
            len(ids), req.token_limit, runtime.settings.completions_default_max_tokens
        ),
        sampling=_sampling(req),
        stop=tuple(req.stop or []),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        ignore_eos=req.ignore_eos,
        include_usage=req.include_usage,
        created=int(time.time()),
        grammar=_grammar(req),
        echo=text if req.echo else None,
    )


def check_model(runtime: Runtime) -> None:
    """Refuse work when workers are up and none serves this server's model."""
    if runtime.identity is None or not runtime.fleet().mismatch:
        return
    fleet = runtime.fleet(fresh=True)  # never refuse on a stale read
    if not fleet.mismatch:
        return
    ours = runtime.identity
    theirs = sorted({m.describe(): m for m in fleet.others.values()}.items())
    served = "; ".join(f"{d}, {ours.difference(m)}" for d, m in theirs)
    raise ModelMismatch(
        f"This server tokenizes for {ours.describe()}, but the live workers serve "
        f"{served}. Start the web server and the workers with the same model "
        "(PARKQ_MODEL)."
    )
