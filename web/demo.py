"""The demo client of `parkq demo`: stream a completion and report its speed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import requests

__all__ = ["run_demo"]


def run_demo(base_url: str, prompt: str, max_tokens: int, say: Callable[[str], None]) -> None:
    body = {
        "model": "parkq",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    say(f"POST {base_url}/v1/completions (stream), prompt: {prompt!r}")
    t0 = time.monotonic()
    first: float | None = None
    usage = None
    parts: list[str] = []
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice.get("text"):
                    first = first or time.monotonic()
                    parts.append(choice["text"])
                    print(choice["text"], end="", flush=True)
    end = time.monotonic()
    print()
    n = usage["completion_tokens"] if usage else len(parts)
    ttft = (first or end) - t0
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    say(f"-- {n} tokens, time to first token {ttft * 1000:.0f} ms, {rate:.1f} tokens/s")
