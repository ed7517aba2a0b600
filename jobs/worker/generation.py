"""One generation's state between engine steps: everything but the KV cache.

A :class:`Generation` takes sampled tokens and returns the SSE payloads they
produce. It holds the generated token ids, the UTF-8 decoder, the stop-sequence
matcher, the tool-call parser, the logprobs not yet emitted and the counters,
as plain data: :meth:`Generation.state` and :meth:`Generation.restore` carry
it through a park, to any worker.

Positions: the KV cache holds the first ``n_prefilled`` prompt tokens and then
every generated token but the last one. The last generated token (the
*pending* one) has been sampled and streamed but not decoded yet: a parked
generation decodes it first when it resumes.
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobs.engine.constraints import Constraint
from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import TokenLogprob, logprobs_of, sample, token_counts
from jobs.engine.textstream import StopMatcher, Utf8Decoder
from jobs.engine.toolcalls import ToolCall, ToolCallParser
from jobs.store.events import DONE
from jobs.worker.chunks import ChunkWriter
from jobs.worker.stepclock import CLOCK

__all__ = ["Generation"]


@dataclass
class Generation:
    job_id: str
    request: GenerationRequest
    piece: Callable[[int], bytes]
    is_eog: Callable[[int], bool]
    #: Builds the matcher of a request's grammar (the engine's ``constraint``).
    constrain: Callable[[str], Constraint] | None = None
    generated: list[int] = field(default_factory=list)
    n_prefilled: int = 0
    finish_reason: str | None = None
    decoder: Utf8Decoder = field(default_factory=Utf8Decoder)
    stopper: StopMatcher = field(init=False)
    parser: ToolCallParser = field(default_factory=ToolCallParser)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0
    started: bool = False
    #: Payloads produced so far: the next one has sequence number events + 1.
    events: int = 0

    def __post_init__(self) -> None:
        self.stopper = StopMatcher(self.request.stop)
        #: How often each token was generated (the penalties'; kept as tokens come).
        self.counts: Counter[int] = token_counts(self.generated)
        self.constraint: Constraint | None = None
        if self.request.grammar is not None:
            if self.constrain is None:
                raise ValueError("this engine cannot follow a grammar")
            self.constraint = self.constrain(self.request.grammar)
        self.chunks = ChunkWriter(
            self.request.kind,
            self.request.response_id or self.job_id,
            self.request.model,
            self.request.created,
            self.piece,
            self.request.choice,
        )

    # -- checkpoint ------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to continue this generation elsewhere, as JSON data."""
        return {
            "generated": self.generated,
            "n_prefilled": self.n_prefilled,
            "decoder": base64.b64encode(self.decoder.pending).decode(),
            "stop_held": self.stopper.held,
            "tool": [self.parser.inside, self.parser.held, self.parser.count],
            "logprobs": [
                [t.token, t.logprob, [list(x) for x in t.top]] for t in self.held_logprobs
            ],
            "text_offset": self.text_offset,
            "started": self.started,
            "events": self.events,
        }

    @classmethod
    def restore(
        cls,
        job_id: str,
        request: GenerationRequest,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        state: dict[str, Any],
        constrain: Callable[[str], Constraint] | None = None,
    ) -> Generation:
        gen = cls(job_id, request, piece, is_eog, constrain)
        gen.generated = [int(t) for t in state["generated"]]
        gen.counts = token_counts(gen.generated)
        if gen.constraint is not None:
            # The matcher is rebuilt, not saved: the same tokens give the same state.
            gen.constraint.feed(gen.generated)
        gen.n_prefilled = int(state["n_prefilled"])
        gen.decoder.pending = base64.b64decode(state["decoder"])
        gen.stopper.held = state["stop_held"]
        inside, held, count = state["tool"]
        gen.parser = ToolCallParser(bool(inside), held, int(count))
        gen.held_logprobs = [
            TokenLogprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
            for t, lp, top in state["logprobs"]
        ]
        gen.text_offset = int(state["text_offset"])
        gen.started = bool(state["started"])
        gen.events = int(state["events"])
        return gen

    # -- positions ---------------------------------------------------------------

    @property
    def prefilled(self) -> bool:
        return self.n_prefilled >= len(self.request.prompt_ids)

    @property
    def pending(self) -> int | None:
        """The generated token not yet decoded into the KV cache."""
        return self.generated[-1] if self.generated and not self.done else None

    @property
    def n_past(self) -> int:
        """How many positions the KV cache holds."""
        return self.n_prefilled + max(0, len(self.generated) - 1)

    # -- tokens in, payloads out ---------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.request.prompt_ids), len(self.generated)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def next_token(self, logits: np.ndarray) -> int:
        t0 = time.perf_counter()
        logits = self.request.sampling.adjusted(logits, self.counts)
        if self.constraint is not None:
            logits = self.constraint.masked(logits)
        token = sample(logits, self.request.sampling, len(self.generated))
        CLOCK.add("sampling", time.perf_counter() - t0)
        return token

    def accept(self, token: int, logits: np.ndarray) -> list[str]:
        """Take one sampled token; return the payloads it makes ready."""
        out: list[str] = []
        if not self.started and self.request.kind == "chat":
            out.append(self.chunks.role())
        elif not self.started and self.request.echo:
            out.append(self._delta(self.request.echo))
        self.started = True
        if self.is_eog(token) and not self.request.ignore_eos:
            self.finish_reason = "stop"
            return self._count(out + self._release(self._tail()))
        self.generated.append(token)
        self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.consume(token)
        if self.request.logprobs:
            self.held_logprobs.append(logprobs_of(logits, token, self.request.top_logprobs))
        text, stopped = self.stopper.feed(self.decoder.feed(self.piece(token)))
        if stopped or (self.constraint is not None and self.constraint.complete):
            self.finish_reason = "stop"
            return self._count(out + self._release(text, final=True))
        if len(self.generated) >= self.request.max_tokens:
            self.finish_reason = "length"
            text += self.stopper.feed(self.decoder.feed(b"", True))[0] + self.stopper.flush()
            return self._count(out + self._release(text, final=True))
        return self._count(out + self._release(text))

    def stop_at_context_end(self) -> list[str]:
        """The context is full: end with ``length`` and release what is held."""
        self.finish_reason = "length"
        return self._count(self._release(self._tail()))

    def final_payloads(self) -> list[str]:
        assert self.finish_reason is not None
        reason = self.finish_reason
        if reason == "stop" and self.parser.count:
            reason = "tool_calls"
        out = [self.chunks.finish(reason)]
        if self.request.include_usage and self.request.choices == 1:  # else the web's
            out.append(self.chunks.usage(self.usage))
        out.append(DONE)
        return self._count(out)

    def _tail(self) -> str:
        return self.stopper.feed(self.decoder.feed(b"", True))[0] + self.stopper.flush()

    def _count(self, payloads: list[str]) -> list[str]:
        self.events += len(payloads)
        return payloads

    def _release(self, text: str, final: bool = False) -> list[str]:
        final = final or self.done
        pieces: list[str | ToolCall] = [text] if text else []
        if self.request.tools:
            pieces = self.parser.feed(text) + (self.parser.flush() if final else [])
        out: list[str] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                call_id = f"call_{self.chunks.job_id.rsplit('-', 1)[-1][:16]}_{piece.index}"
                if self.request.choice:
                    call_id += f"_{self.request.choice}"
                out.append(self.chunks.tool_call(piece.index, call_id, piece.name, piece.arguments))
            elif piece:
                out.append(self._delta(piece))
        if (
            final
            and self.held_logprobs
            and not any(not isinstance(p, ToolCall) and p for p in pieces)
        ):
            out.append(self._delta(""))
        return out

    def _delta(self, text: str) -> str:
        lps = None
        if self.request.logprobs:
            lps, self.held_logprobs = self.held_logprobs, []
        payload = self.chunks.delta(text, lps, self.text_offset)
        self.text_offset += len(text)
        return payload
