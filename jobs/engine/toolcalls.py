"""Hermes-style tool calls in a chat stream: ``<tool_call>{json}</tool_call>``.

The model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
the parser turns each into one OpenAI ``tool_calls`` delta carrying the whole
call, and passes other text through. Its state is plain data, so a call cut in
half by parking is finished after the resume, with the same id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["CLOSE", "OPEN", "ToolCall", "ToolCallParser"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    index: int
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallParser:
    inside: bool = False
    held: str = ""
    count: int = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        """Split ``text`` into plain text pieces and completed tool calls."""
        out: list[str | ToolCall] = []
        buf = self.held + text
        self.held = ""
        while buf:
            if self.inside:
                end = buf.find(CLOSE)
                if end == -1:
                    self.held = buf
                    return out
                out.append(self._call(buf[:end]))
                buf = buf[end + len(CLOSE) :]
                self.inside = False
            else:
                start = buf.find(OPEN)
                if start == -1:
                    keep = _partial_suffix(buf, OPEN)
                    if len(buf) > keep:
                        out.append(buf[: len(buf) - keep])
                    self.held = buf[len(buf) - keep :]
                    return out
                if start:
                    out.append(buf[:start])
                buf = buf[start + len(OPEN) :]
                self.inside = True
        return out

    def flush(self) -> list[str | ToolCall]:
        """End of generation: an unfinished call is given back as text."""
        rest = (OPEN + self.held) if self.inside else self.held
        self.inside, self.held = False, ""
        return [rest] if rest else []

    def _call(self, body: str) -> str | ToolCall:
        try:
            obj = json.loads(body)
            name = obj["name"]
            args = obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return OPEN + body + CLOSE  # not a well-formed call: keep it as text
        if not isinstance(name, str):
            return OPEN + body + CLOSE
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call = ToolCall(self.count, name, arguments)
        self.count += 1
        return call


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
