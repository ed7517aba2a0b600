"""The benchmark workload and a client that plays it against a server.

Long generations run back to back from one client; short interactive requests
arrive as a Poisson process. The same seed gives the same arrival times.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from tools.client import events

__all__ = ["SHORT_BODY", "Observed", "Request", "Workload", "play", "stream"]

#: The short interactive request (max_tokens comes from the workload).
SHORT_BODY = {
    "prompt": "Q: What is the capital of France?\nA:",
    "temperature": 0,
    "priority": "interactive",
}
#: Greedy: what the workload sends unless told another sampling.
GREEDY: dict[str, Any] = {"temperature": 0}


@dataclass(frozen=True)
class Workload:
    duration: float = 60.0
    short_rate: float = 0.5
    short_tokens: int = 32
    long_tokens: int = 1024
    long_prompt_words: int = 64
    seed: int = 0
    shorts: bool = True
    #: Every request's sampling fields (None: greedy); ``{}`` sends none, as the
    #: openai client does when told nothing (the server's defaults).
    sampling: dict[str, Any] | None = None

    @property
    def sampling_fields(self) -> dict[str, Any]:
        return GREEDY if self.sampling is None else self.sampling

    def arrivals(self) -> list[float]:
        """Offsets (seconds from the start) of the short requests."""
        if not self.shorts or self.short_rate <= 0:
            return []
        rng = random.Random(self.seed)
        out, t = [], rng.expovariate(self.short_rate)
        while t < self.duration:
            out.append(t)
            t += rng.expovariate(self.short_rate)
        return out

    def long_prompt(self) -> str:
        rng = random.Random(self.seed + 1)
        words = ["the", "park", "queue", "model", "token", "job", "long", "short", "answer"]
        return " ".join(rng.choice(words) for _ in range(self.long_prompt_words))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Request:
    kind: str  # "long" or "short"
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: list[float] = field(default_factory=list)  # arrival time of each token
    job_id: str | None = None
    text: str = ""
    #: The stream ended with ``[DONE]``.
    done: bool = False
    #: Generated tokens as the server's usage counts them (when it says).
    completion_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


@dataclass
class Observed:
    start: float
    duration: float
    requests: list[Request]

    def of(self, kind: str) -> list[Request]:
        return [r for r in self.requests if r.kind == kind]


def stream(
    url: str, body: dict[str, Any], req: Request, stop: threading.Event | None = None
) -> None:
    """Stream one completion or chat completion, recording when each piece of
    text arrives, and the text."""
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=3600) as r:
        r.raise_for_status()
        req.job_id = r.headers.get("X-Job-Id")
        for _, data in events(r):
            if stop is not None and stop.is_set():
                break
            if data == "[DONE]":
                req.done = True
            if not data.startswith("{"):
                continue
            chunk = json.loads(data)
            usage = chunk.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                req.completion_tokens = int(usage["completion_tokens"])
            choice = (chunk.get("choices") or [{}])[0]
            piece = choice.get("text") or choice.get("delta", {}).get("content")
            if piece:
                now = time.monotonic()
                req.first = req.first or now
                req.tokens.append(now)
                req.text += piece
    req.end = time.monotonic()


def stream_response(url: str, body: dict[str, Any], req: Request) -> None:
    """Stream one response of the Responses API (``/v1/responses``), recording
    when each piece of text arrives, as :func:`stream` does for completions."""
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=3600) as r:
        r.raise_for_status()
        req.job_id = r.headers.get("X-Job-Id")
        for _, data in events(r):
            event = json.loads(data)
            kind = event.get("type")
            if kind == "response.output_text.delta" and event["delta"]:
                now = time.monotonic()
                req.first = req.first or now
                req.tokens.append(now)
                req.text += event["delta"]
            elif kind in ("response.completed", "response.incomplete"):
                usage = event["response"].get("usage") or {}
                if usage.get("output_tokens") is not None:
                    req.completion_tokens = int(usage["output_tokens"])
                req.done = True
    req.end = time.monotonic()


def play(base_url: str, workload: Workload, long_extra: dict[str, Any]) -> Observed:
    """Run the workload for its duration against ``base_url``; return what was seen."""
    url = f"{base_url}/v1/completions"
    start = time.monotonic()
    deadline = start + workload.duration
    stop = threading.Event()
    observed = Observed(start, workload.duration, [])
    long_body = {
        "prompt": workload.long_prompt(),
        "max_tokens": workload.long_tokens,
        "priority": "batch",
        **workload.sampling_fields,
        **long_extra,
    }
    short_fields = {k: v for k, v in SHORT_BODY.items() if k != "temperature"}
    short_body = {**short_fields, "max_tokens": workload.short_tokens, **workload.sampling_fields,
                  **long_extra}  # fmt: skip

    def longs() -> None:
        while time.monotonic() < deadline and not stop.is_set():
            req = Request("long", time.monotonic())
            observed.requests.append(req)
            stream(url, long_body, req, stop)
            if req.job_id and time.monotonic() >= deadline:
                requests.delete(f"{base_url}/v1/jobs/{req.job_id}", timeout=10)

    def short(at: float) -> None:
        time.sleep(max(0.0, start + at - time.monotonic()))
        req = Request("short", time.monotonic())
        observed.requests.append(req)
        stream(url, short_body, req)

    threads = [threading.Thread(target=longs)]
    threads += [threading.Thread(target=short, args=(at,)) for at in workload.arrivals()]
    for t in threads:
        t.start()
    time.sleep(max(0.0, deadline - time.monotonic()))
    stop.set()
    for t in threads:
        t.join(timeout=600)
    return observed
