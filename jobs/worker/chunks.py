"""OpenAI streaming chunks for chat and text completions."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.engine.sampling import TokenLogprob

__all__ = ["ChunkWriter"]


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ChunkWriter:
    """Builds the JSON ``data:`` of each SSE event of one job."""

    kind: str  # "chat" or "completion"
    job_id: str
    model: str
    created: int
    piece: Callable[[int], bytes]
    #: The choice this job is (``n`` > 1: one job per choice).
    index: int = 0

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {
            "id": self.job_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        body.update(extra)
        return _dump(body)

    def role(self) -> str:
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope([choice])

    def delta(self, text: str, logprobs: list[TokenLogprob] | None, offset: int) -> str:
        if self.chat:
            lp = None if logprobs is None else {"content": [self._chat_lp(t) for t in logprobs]}
            choice = {
                "index": self.index,
                "delta": {"content": text},
                "logprobs": lp,
                "finish_reason": None,
            }
        else:
            lp = None if logprobs is None else self._completion_lp(logprobs, offset)
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": None}
        return self._envelope([choice])

    def tool_call(self, index: int, call_id: str, name: str, arguments: str) -> str:
        call = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        choice = {
            "index": self.index,
            "delta": {"tool_calls": [call]},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope([choice])

    def finish(self, reason: str) -> str:
        if self.chat:
            choice: dict[str, Any] = {
                "index": self.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {"index": self.index, "text": "", "logprobs": None, "finish_reason": reason}
        return self._envelope([choice])

    def usage(self, usage: dict[str, int]) -> str:
        return self._envelope([], usage=usage)

    def _text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", errors="replace")

    def _chat_lp(self, t: TokenLogprob) -> dict[str, Any]:
        return {
            "token": self._text(t.token),
            "logprob": t.logprob,
            "bytes": list(self.piece(t.token)),
            "top_logprobs": [
                {"token": self._text(i), "logprob": lp, "bytes": list(self.piece(i))}
                for i, lp in t.top
            ],
        }

    def _completion_lp(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for t in entries:
            tokens.append(self._text(t.token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in entries],
            "top_logprobs": [{self._text(i): lp for i, lp in t.top} for t in entries],
            "text_offset": offsets,
        }
