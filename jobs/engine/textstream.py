"""Turning token bytes into safe text: UTF-8 holding and stop sequences.

Both keep their whole state in plain fields, so a parked generation can carry
them in its checkpoint.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

__all__ = ["StopMatcher", "Utf8Decoder"]


@dataclass
class Utf8Decoder:
    """Incremental UTF-8: a character split across tokens is held until whole.

    Invalid bytes become U+FFFD, so the output is always valid text.
    """

    pending: bytes = b""

    def feed(self, data: bytes, final: bool = False) -> str:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.setstate((self.pending, 0))
        text = decoder.decode(data, final)
        self.pending = decoder.getstate()[0]
        return text


@dataclass
class StopMatcher:
    """Holds back text that may be the start of a stop sequence.

    ``feed`` returns the text that is safe to emit and whether a stop sequence
    was completed (the stop sequence itself and anything after it are dropped).
    """

    stops: tuple[str, ...] = ()
    held: str = ""

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text  # what is held is shorter than any stop sequence
        hits = [i for s in self.stops if (i := buf.find(s)) != -1]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
