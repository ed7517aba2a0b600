"""The demo client of `parkq demo`: a long job, a short question, parking shown.

A short warm-up measures the engine's speed, so that the long batch
completion is sized to outlast the question on any machine. The long job
streams; a second later a short interactive question arrives. The long job is
parked (its stream pauses), the question is answered, and the long job resumes
where it stopped. The summary states only what the run showed: the question's
time to first token, and what it would have waited only if the long job was
really parked for it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests

from tools.client import DONE, events

__all__ = ["DemoFailed", "long_job_tokens", "run_demo"]

DIM, BOLD, RESET = "\033[2m", "\033[1m", "\033[0m"

#: How long the long job should run at the measured speed: the question comes
#: after about one second, and the long job must still be running then.
LONG_JOB_SECONDS = 10.0
#: When the question arrives, measured from the long job's first token (sooner
#: when the long job is shorter: a context too small for ten seconds' output).
QUESTION_AFTER_SECONDS = 1.0


class DemoFailed(RuntimeError):
    """The demo could not show what it promises; the message says why."""


def _stream(base_url: str, body: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (job id, chunk) for each data event of a streamed completion."""
    with requests.post(
        f"{base_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=600
    ) as r:
        if r.status_code != 200:
            raise DemoFailed(f"the server answered {r.status_code}: {r.text[:200]}")
        job_id = r.headers["X-Job-Id"]
        done = False
        for _, data in events(r):
            if data == DONE:
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise DemoFailed(f"job {job_id} failed: {chunk['error']['message']}")
            yield job_id, chunk
        if not done:
            raise DemoFailed(f"the stream of job {job_id} ended before [DONE]")


def long_job_tokens(tokens_per_s: float, room: int, asked: int | None) -> int:
    """The long job's length: ``asked``, or enough for LONG_JOB_SECONDS, within ``room``."""
    if asked is not None:
        return max(1, min(asked, room))
    return max(64, min(room, round(tokens_per_s * LONG_JOB_SECONDS)))


def _speed(base_url: str, prompt: str) -> float:
    """Decode tokens per second, from a short batch completion's stream."""
    stamps = []
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "priority": "batch"}  # fmt: skip
    for _ in _stream(base_url, body):
        stamps.append(time.monotonic())
    if len(stamps) < 2:
        return 1000.0
    return (len(stamps) - 1) / max(1e-6, stamps[-1] - stamps[0])


def _job(base_url: str, job_id: str) -> dict[str, Any]:
    resp = requests.get(f"{base_url}/v1/jobs/{job_id}", timeout=10)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


def run_demo(
    base_url: str,
    long_prompt: str,
    max_tokens: int | None,
    short_prompt: str,
    write: Callable[[str], None],
) -> dict[str, Any]:
    """Run the demo against a live parkq; raise :class:`DemoFailed` when it cannot."""
    lock = threading.Lock()
    out: dict[str, Any] = {"long_tokens": 0}
    long_started = threading.Event()
    failure: list[BaseException] = []

    def say(text: str) -> None:
        with lock:
            write(text)

    models = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"]
    room = int(models[0]["context_length"]) - 64  # the prompt and some slack
    speed = _speed(base_url, long_prompt)
    n_long = long_job_tokens(speed, room, max_tokens)

    def long_job() -> None:
        body = {"prompt": long_prompt, "max_tokens": n_long, "temperature": 0,
                "ignore_eos": True, "priority": "batch"}  # fmt: skip
        t0 = time.monotonic()
        try:
            for job_id, chunk in _stream(base_url, body):
                if not long_started.is_set():
                    out["long_id"], out["long_first"] = job_id, time.monotonic()
                    long_started.set()
                out["long_tokens"] += 1
                say(DIM + chunk["choices"][0]["text"] + RESET)
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)
            long_started.set()
        out["long_seconds"] = time.monotonic() - t0

    say(f"{BOLD}[long batch job, {n_long} tokens]{RESET} {long_prompt}")
    thread = threading.Thread(target=long_job, daemon=True)
    thread.start()
    if not long_started.wait(timeout=120) or failure:
        raise DemoFailed(f"the long job did not start: {failure[0] if failure else 'timeout'}")
    after = min(QUESTION_AFTER_SECONDS, max(0.2, n_long / speed / 4))
    time.sleep(max(0.0, out["long_first"] + after - time.monotonic()))
    rate = out["long_tokens"] / max(1e-6, time.monotonic() - out["long_first"])
    left = n_long - out["long_tokens"]
    still_running = _job(base_url, out["long_id"])["state"] in ("running", "queued", "parked")
    say(f"\n{BOLD}[short question arrives]{RESET} {short_prompt}\n")
    t0 = time.monotonic()
    first = None
    body = {"prompt": short_prompt, "max_tokens": 24, "temperature": 0, "priority": "interactive"}
    for _, chunk in _stream(base_url, body):
        first = first or time.monotonic()
        say(BOLD + chunk["choices"][0]["text"] + RESET)
    ttft = (first or time.monotonic()) - t0
    parked = int(_job(base_url, out["long_id"])["preemptions"]) > 0
    if parked:
        say(f"\n{BOLD}[the long job was parked for the question; it resumes where it "
            f"stopped]{RESET}\n")  # fmt: skip
    thread.join(timeout=600)
    if failure:
        raise DemoFailed(str(failure[0]))
    if thread.is_alive():
        raise DemoFailed("the long job did not finish within 10 minutes")
    status = _job(base_url, out["long_id"])
    summary = f"\n\n{BOLD}-- short question: time to first token {ttft * 1000:.0f} ms"
    if parked and still_running:
        summary += (
            f"; without preemption it would have waited about {left / max(rate, 1e-6):.1f} s "
            "behind the long job"
        )
    elif not still_running:
        summary += "; the long job had already finished when it arrived, so nothing was parked"
    else:
        summary += "; the long job was not parked (it ran on beside the question)"
    summary += (
        f".{RESET}\n{BOLD}-- long job: {status['tokens']} tokens, {status['state']}, parked "
        f"{status['preemptions']} time(s), {rate:.0f} tokens/s while running.{RESET}\n"
    )
    say(summary)
    return {
        "ttft_s": ttft,
        "would_wait_s": left / max(rate, 1e-6) if parked else None,
        "long_tokens_per_s": rate,
        "parked": parked,
        "long_state": status["state"],
    }
