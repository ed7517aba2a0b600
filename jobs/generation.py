"""One generation's state between engine steps: everything but the KV cache.

A :class:`Generation` takes sampled tokens and returns the SSE payloads they
produce. It holds the generated token ids, the UTF-8 decoder, the stop-sequence
matcher, the logprobs not yet emitted and the counters, as plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobs.chunks import ChunkWriter
from jobs.events import DONE
from jobs.sampling import SamplingParams, TokenLogprob, logprobs_of, sample
from jobs.textstream import StopMatcher, Utf8Decoder

__all__ = ["Generation", "GenerationRequest"]


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
    created: int = 0

    def to_json(self) -> dict[str, Any]:
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
            "created": self.created,
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
            created=int(d.get("created", 0)),
        )


@dataclass
class Generation:
    job_id: str
    request: GenerationRequest
    piece: Callable[[int], bytes]
    is_eog: Callable[[int], bool]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    decoder: Utf8Decoder = field(default_factory=Utf8Decoder)
    stopper: StopMatcher = field(init=False)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        self.stopper = StopMatcher(self.request.stop)
        self.chunks = ChunkWriter(
            self.request.kind, self.job_id, self.request.model, self.request.created, self.piece
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.request.prompt_ids), len(self.generated)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def next_token(self, logits: np.ndarray) -> int:
        return sample(logits, self.request.sampling, len(self.generated))

    def accept(self, token: int, logits: np.ndarray) -> list[str]:
        """Take one sampled token; return the payloads it makes ready."""
        out: list[str] = []
        if not self.started and self.request.kind == "chat":
            out.append(self.chunks.role())
        self.started = True
        if self.is_eog(token) and not self.request.ignore_eos:
            self.finish_reason = "stop"
            return out + self._release(self.stopper.flush() + self.decoder.feed(b"", True))
        self.generated.append(token)
        if self.request.logprobs:
            self.held_logprobs.append(logprobs_of(logits, token, self.request.top_logprobs))
        text, stopped = self.stopper.feed(self.decoder.feed(self.piece(token)))
        if stopped:
            self.finish_reason = "stop"
            return out + self._release(text)
        if len(self.generated) >= self.request.max_tokens:
            self.finish_reason = "length"
            tail = self.decoder.feed(b"", True)
            text += self.stopper.feed(tail)[0] + self.stopper.flush()
        return out + self._release(text)

    def stop_at_context_end(self) -> list[str]:
        """The context is full: end with ``length`` and release what is held."""
        self.finish_reason = "length"
        return self._release(self.stopper.flush() + self.decoder.feed(b"", True))

    def _release(self, text: str) -> list[str]:
        if not text and not (self.done and self.held_logprobs):
            return []
        lps = None
        if self.request.logprobs:
            lps, self.held_logprobs = self.held_logprobs, []
        payload = self.chunks.delta(text, lps, self.text_offset)
        self.text_offset += len(text)
        return [payload]

    def final_payloads(self) -> list[str]:
        assert self.finish_reason is not None
        out = [self.chunks.finish(self.finish_reason)]
        if self.request.include_usage:
            out.append(self.chunks.usage(self.usage))
        out.append(DONE)
        return out
