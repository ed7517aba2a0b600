"""A generation's request as the web validated it and Redis stores it with its job.

Token ids, sampling parameters, stops, a grammar, the choices of ``n`` > 1:
everything a worker needs to run the generation, in JSON that round-trips
exactly (the web writes it at enqueue; any worker reads it at claim, and again
at every resume or replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.engine.sampling import SamplingParams

__all__ = ["GenerationRequest"]


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request as stored with its job (JSON round-trips exactly)."""

    kind: str
    model: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    include_usage: bool = False
    tools: bool = False
    created: int = 0
    #: An llguidance grammar the output must follow (response_format), or None.
    grammar: str | None = None
    #: Completions' ``echo``: the prompt's text, streamed before the first token.
    echo: str | None = None
    #: ``n`` > 1: the request's choices are jobs of their own; this is choice
    #: ``choice`` of ``choices``, streamed under the response's id
    #: ``response_id`` (empty: the job's own id). Siblings on one worker share
    #: the prompt's KV.
    choice: int = 0
    choices: int = 1
    response_id: str = ""
    #: A background response (``/v1/responses`` with ``background``): it runs to
    #: its end whether or not anyone reads its stream (never abandoned).
    background: bool = False
    #: The ``service_tier`` the request asked for (echoed back; the worker
    #: does not read it): ``priority``, ``default``, ``flex``, or empty.
    service_tier: str = ""

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.background:
            extra["background"] = True
        if self.service_tier:
            extra["service_tier"] = self.service_tier
        return {
            "kind": self.kind,
            "model": self.model,
            "prompt_ids": self.prompt_ids,
            "max_tokens": self.max_tokens,
            "sampling": self.sampling.__dict__,
            "stop": list(self.stop),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "ignore_eos": self.ignore_eos,
            "include_usage": self.include_usage,
            "tools": self.tools,
            "created": self.created,
            "grammar": self.grammar,
            "echo": self.echo,
            "choice": self.choice,
            "choices": self.choices,
            "response_id": self.response_id,
            **extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerationRequest:
        return cls(
            kind=d["kind"],
            model=d["model"],
            prompt_ids=list(d["prompt_ids"]),
            max_tokens=int(d["max_tokens"]),
            sampling=SamplingParams(**d["sampling"]),
            stop=tuple(d.get("stop", ())),
            logprobs=bool(d.get("logprobs", False)),
            top_logprobs=int(d.get("top_logprobs", 0)),
            ignore_eos=bool(d.get("ignore_eos", False)),
            include_usage=bool(d.get("include_usage", False)),
            tools=bool(d.get("tools", False)),
            created=int(d.get("created", 0)),
            grammar=d.get("grammar"),
            echo=d.get("echo"),
            choice=int(d.get("choice", 0)),
            choices=int(d.get("choices", 1)),
            response_id=str(d.get("response_id", "")),
            background=bool(d.get("background", False)),
            service_tier=str(d.get("service_tier", "")),
        )
