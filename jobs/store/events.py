"""The payloads of a job's event stream.

Each event is the ``data:`` of one SSE event: an OpenAI chunk as JSON, an
error object, or the literal ``[DONE]``. Its SSE ``id:`` is its sequence number
in the job's stream, starting at 1.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "error_event"]

DONE = "[DONE]"


def error_event(message: str, type_: str, code: str) -> str:
    """An OpenAI-style error object, as streamed by OpenAI in an SSE ``data:``."""
    body: dict[str, Any] = {
        "error": {"message": message, "type": type_, "param": None, "code": code}
    }
    return json.dumps(body, separators=(",", ":"))
