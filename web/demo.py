"""The demo client of `parkq demo`: a long job, a short question, parking shown.

A long batch completion streams; a second later a short interactive question
arrives. The long job is parked (its stream pauses), the question is
answered, and the long job resumes where it stopped. The question's time to
first token is printed beside what it would have waited without preemption.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests

__all__ = ["run_demo"]

DIM, BOLD, RESET = "\033[2m", "\033[1m", "\033[0m"


def _stream(base_url: str, body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (job id, chunk) for each data event of a streamed completion."""
    with requests.post(
        f"{base_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=600
    ) as r:
        r.raise_for_status()
        job_id = r.headers["X-Job-Id"]
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                yield job_id, json.loads(line[6:])


def run_demo(
    base_url: str,
    long_prompt: str,
    max_tokens: int,
    short_prompt: str,
    write: Callable[[str], None],
) -> dict[str, float]:
    lock = threading.Lock()
    out: dict[str, Any] = {"long_tokens": 0}
    long_started = threading.Event()

    def say(text: str) -> None:
        with lock:
            write(text)

    def long_job() -> None:
        body = {"prompt": long_prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": "batch"}  # fmt: skip
        t0 = time.monotonic()
        for job_id, chunk in _stream(base_url, body):
            if not long_started.is_set():
                out["long_id"], out["long_first"] = job_id, time.monotonic()
                long_started.set()
            out["long_tokens"] += 1
            say(DIM + chunk["choices"][0]["text"] + RESET)
        out["long_seconds"] = time.monotonic() - t0

    say(f"{BOLD}[long batch job]{RESET} {long_prompt}")
    thread = threading.Thread(target=long_job)
    thread.start()
    long_started.wait(timeout=120)
    time.sleep(1.0)
    # What the question would wait without preemption: the rest of the long job.
    rate = out["long_tokens"] / max(1e-6, time.monotonic() - out["long_first"])
    would_wait = (max_tokens - out["long_tokens"]) / max(rate, 1e-6)
    say(f"\n{BOLD}[short question arrives]{RESET} {short_prompt}\n")
    t0 = time.monotonic()
    first = None
    body = {"prompt": short_prompt, "max_tokens": 24, "temperature": 0, "priority": "interactive"}
    for _, chunk in _stream(base_url, body):
        first = first or time.monotonic()
        say(BOLD + chunk["choices"][0]["text"] + RESET)
    ttft = (first or time.monotonic()) - t0
    status = requests.get(f"{base_url}/v1/jobs/{out['long_id']}", timeout=10).json()
    say(f"\n{BOLD}[the long job is {status['state']} (preemptions: {status['preemptions']}); "
        f"it resumes where it stopped]{RESET}\n")  # fmt: skip
    thread.join()
    status = requests.get(f"{base_url}/v1/jobs/{out['long_id']}", timeout=10).json()
    say(
        f"\n\n{BOLD}-- short question: time to first token {ttft * 1000:.0f} ms; without "
        f"preemption it would have waited about {would_wait:.1f} s behind the long job.{RESET}\n"
        f"{BOLD}-- long job: {status['tokens']} tokens, {status['state']}, parked "
        f"{status['preemptions']} time(s), {rate:.0f} tokens/s while running.{RESET}\n"
    )
    return {"ttft_s": ttft, "would_wait_s": would_wait, "long_tokens_per_s": rate}
