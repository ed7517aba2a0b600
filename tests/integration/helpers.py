"""HTTP helpers for the integration tests."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from tools.client import lines


def submit_stream(
    base_url: str, body: dict[str, Any], route: str = "completions"
) -> requests.Response:
    resp = requests.post(
        f"{base_url}/v1/{route}", json={**body, "stream": True}, stream=True, timeout=60
    )
    resp.raise_for_status()
    return resp


def sse_lines(resp: requests.Response) -> Iterator[str]:
    """The lines of a streamed SSE response, ended at LF only (tools/client.py):
    requests' ``iter_lines`` would also cut at U+2028 or NEL in an event's text."""
    return lines(resp.iter_content(chunk_size=None))


def read_events(resp: requests.Response, limit: int | None = None) -> list[tuple[int, str]]:
    """Read SSE events (id, data) until [DONE] (then close) or ``limit`` events."""
    out: list[tuple[int, str]] = []
    event_id = None
    # One line iterator per response: a new one would lose what the last one buffered.
    if "_parkq_lines" not in resp.__dict__:
        resp.__dict__["_parkq_lines"] = sse_lines(resp)
    lines = resp.__dict__["_parkq_lines"]
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            assert event_id is not None
            out.append((event_id, line[6:]))
            if line[6:] == "[DONE]":
                resp.close()  # the stream is over
                break
            if limit is not None and len(out) >= limit:
                break
    return out


def completion_text(events: list[tuple[int, str]]) -> str:
    return "".join(c["text"] for c in chunks(events) for c in c["choices"])


def chunks(events: list[tuple[int, str]]) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in events if d != "[DONE]"]


def logprob_tokens(events: list[tuple[int, str]]) -> list[tuple[str, float]]:
    out = []
    for c in chunks(events):
        for choice in c["choices"]:
            lp = choice.get("logprobs")
            if lp:
                out += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
    return out


def job(base_url: str, job_id: str) -> dict[str, Any]:
    return requests.get(f"{base_url}/v1/jobs/{job_id}", timeout=10).json()


def web_answers(base_url: str) -> bool:
    """Whether `parkq web` answers at ``base_url`` (with or without live workers)."""
    try:
        return requests.get(f"{base_url}/healthz", timeout=5).status_code in (200, 503)
    except requests.RequestException:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def read_with_reconnects(
    base_url: str, job_id: str, resp: requests.Response, per_connection: int
) -> list[tuple[int, str]]:
    """Read a job's stream to its end, reconnecting with Last-Event-ID every
    ``per_connection`` events (and after a broken connection)."""
    seen: list[tuple[int, str]] = []
    while True:
        before = len(seen)
        with contextlib.suppress(requests.RequestException):
            seen.extend(read_events(resp, limit=per_connection))
        resp.close()
        if len(seen) == before:
            time.sleep(0.2)  # the server could not serve the stream (e.g. Redis restarting)
        if seen and seen[-1][1] == "[DONE]":
            return seen
        try:
            resp = requests.get(
                f"{base_url}/v1/jobs/{job_id}/events",
                headers={"Last-Event-ID": str(seen[-1][0] if seen else 0)},
                stream=True,
                timeout=60,
            )
        except requests.RequestException:
            time.sleep(0.2)


def reading_in_background(
    base_url: str, resp: requests.Response, per_connection: int
) -> tuple[threading.Thread, list[tuple[int, str]]]:
    """Read the stream of ``resp``'s job to its end in a thread (reconnecting as
    :func:`read_with_reconnects` does); the thread and the events read so far."""
    job_id = resp.headers["X-Job-Id"]
    seen: list[tuple[int, str]] = []
    thread = threading.Thread(
        target=lambda: seen.extend(read_with_reconnects(base_url, job_id, resp, per_connection))
    )
    thread.start()
    return thread, seen


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        out.append((int(entry.name), cmdline.decode(errors="replace")))
    return out
