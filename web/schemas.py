"""Request bodies of the OpenAI-compatible routes, validated by pydantic."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from web.errors import BadRequest

__all__ = [
    "RESPONSES_UNSUPPORTED",
    "UNSUPPORTED",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ResponseFormat",
    "ResponsesRequest",
    "TokenizeRequest",
    "parse",
]

M = TypeVar("M", bound=BaseModel)

MAX_STOP = 4
MAX_CHOICES = 16
MAX_STOP_LEN = 256
#: A token id as a key of ``logit_bias``: ASCII digits, at most 9 of them.
_TOKEN_ID = re.compile(r"[0-9]{1,9}", re.ASCII)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that
    validates against a schema; enforced token by token by a grammar."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


#: OpenAI request fields parkq does not implement, with the value that means
#: "not used": a request that sets one otherwise is refused, never silently
#: served without it (unknown fields are ignored: clients send extras).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("auto", None),
    "parallel_tool_calls": (True, None),
    "best_of": (1, None),
    "suffix": ("", None),
    "functions": (None, []),
    "function_call": (None, "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    #: Choices to generate: each is a job (a sequence) of its own, choice i
    #: sampled with seed + i; siblings on one worker share the prompt's KV.
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: str | None = None  # accepted, not used

    priority: str | int = "interactive"
    #: OpenAI's tiers, as priority levels (scheduler.policy.SERVICE_TIERS).
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    #: Token id (as a string) -> bias from -100 to 100 added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        # ASCII digits only: str.isdigit() and int() also take '²' or '٣'.
        bad = next((k for k in v or {} if not _TOKEN_ID.fullmatch(k)), None)
        if bad is not None:
            raise ValueError(
                f"keys must be token ids (0 to 999999999, in ASCII digits); {bad[:20]!r} is not one"
            )
        if v and len(v) > 300:
            raise ValueError("at most 300 token biases are allowed")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"a stop sequence is at most {MAX_STOP_LEN} characters")
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The function of an earlier tool call: its name and its arguments (a JSON
    text, as the model wrote it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message, as OpenAI's response gave it."""

    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message; fields beyond these are passed to the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")
        return d


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly that one."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    #: ``auto`` (the default): the model may call tools; ``none``: it sees none and
    #: calls none; ``required``: it calls one or more; named: it calls that one.
    #: Enforced by a grammar (jobs/engine/constraints.py), not by the prompt.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: With ``required`` or a named choice: False allows exactly one call.
    parallel_tool_calls: bool | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        several = isinstance(v, list) and len(v) > 1 and isinstance(v[0], str)
        nested = isinstance(v, list) and bool(v) and isinstance(v[0], list)
        if several or nested:
            raise ValueError(
                f"{len(v)} prompts were given; one prompt per request is supported "
                "(send one request per prompt, or use the Batch API)"
            )
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """Either ``text`` (tokenized as is) or chat ``messages`` (through the chat template)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        },
    )
    text: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: list[Annotated[int, Field(ge=0)]]


#: How pydantic names the member of a union in an error's location.
_MEMBER_TYPES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_member(part: Any) -> bool:
    """A type's name, not a field's (fields are lower case; models capitalized)."""
    return isinstance(part, str) and ("[" in part or part in _MEMBER_TYPES or part[:1].isupper())


def parse(model: type[M], body: Any) -> M:
    """Validate ``body``; raise :class:`BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    unsupported = (
        UNSUPPORTED if issubclass(model, _Common)
        else RESPONSES_UNSUPPORTED if model is ResponsesRequest
        else {}
    )  # fmt: skip
    for name, unused in unsupported.items():
        if name in model.model_fields:
            continue  # implemented by this route
        if name in body and body[name] not in unused:
            raise BadRequest(f"'{name}' is not supported by this server; leave it out.", param=name)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # A value of a union type fails every member: the deepest error says most.
        first = max(exc.errors(), key=lambda e: len(e["loc"]))
        param = ".".join(str(p) for p in first["loc"] if not _union_member(p)) or None
        msg = first["msg"].removeprefix("Value error, ")
        raise BadRequest(f"Invalid value for '{param}': {msg}", param=param) from None


# -- the Responses API (/v1/responses) ----------------------------------------


class InputText(BaseModel):
    """A text part of an input message (``input_text``; ``output_text`` in an
    assistant message taken back from an earlier output)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallInput(BaseModel):
    """A function call the model made earlier, given back as input."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str


class FunctionCallOutput(BaseModel):
    """What a function call returned."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]


InputItem = Annotated[
    InputMessage | FunctionCallInput | FunctionCallOutput, Field(discriminator="type")
]


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON that validates
    against ``schema`` (the Responses API's flat form of ``response_format``)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: TextFormat | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    """``{"type": "function", "name": ...}``: call exactly that one."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


#: Responses API fields parkq does not implement, with the values that mean
#: "not used" (as UNSUPPORTED for the other routes).
RESPONSES_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "reasoning": (None, {}),
    "prompt": (None,),
    "conversation": (None,),
    "truncation": (None, "disabled"),
    "include": (None, []),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "background_options": (None,),
    "context_management": (None,),
}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = ""
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    #: Run as a job that no reader holds: answered at once (``queued``), then
    #: polled, streamed, resumed or cancelled by its id.
    background: bool = False
    #: Kept for retrieval (parkq keeps every response for PARKQ_RESULT_TTL).
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: (
        Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None
    ) = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    #: parkq extensions, as on the other routes.
    priority: str | int = "interactive"
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    ignore_eos: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages_without_type(cls, v: Any) -> Any:
        # An easy input message ({"role": ..., "content": ...}) has no type.
        if isinstance(v, list):
            return [
                {**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                and "role" in item else item
                for item in v
            ]  # fmt: skip
        return v
