"""A chat stream that survives a lost connection, for clients of the official
openai client (which does not show SSE event ids): the request is sent with
`requests`, and after a break the stream is taken up at
/v1/jobs/<id>/events with Last-Event-ID, so each event arrives once.

    python docs/examples/reconnect.py "Name three rivers."

(docs/api.md, "Streaming and reconnecting"; tests/integration/test_examples.py
runs it against a real parkq, with its connection cut mid-stream.)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import requests

BASE = os.environ.get("PARKQ_URL", "http://127.0.0.1:8000")


def chat_stream(body: dict[str, Any], base: str = BASE, tries: int = 20) -> Iterator[str]:
    """The text of a streamed chat completion, piece by piece, reconnecting
    (``tries`` times at most) when the connection breaks."""
    headers = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'unused')}"}
    job_id, last = None, None
    for _ in range(tries):
        try:
            if job_id is None:  # the request itself
                resp = requests.post(f"{base}/v1/chat/completions", json={**body, "stream": True},
                                     headers=headers, stream=True, timeout=(10, 300))  # fmt: skip
            else:  # the rest of its stream: the events after `last`
                resume = {**headers, "Last-Event-ID": last or "0"}
                resp = requests.get(f"{base}/v1/jobs/{job_id}/events", headers=resume,
                                    stream=True, timeout=(10, 300))  # fmt: skip
            with resp:
                if resp.status_code == 204:  # the [DONE] event had already come
                    return
                resp.raise_for_status()
                job_id = job_id or resp.headers["X-Job-Id"]
                # SSE ends lines at LF only; str.splitlines (iter_lines' default)
                # would also cut an event's text at U+2028 or NEL.
                event_id = None
                for raw in resp.iter_lines(delimiter=b"\n"):
                    line = raw.decode().removesuffix("\r")
                    if line.startswith("id: "):
                        event_id = line[4:]  # the last id once its event is read
                    elif line == "data: [DONE]":
                        return
                    elif line.startswith("data: "):
                        for choice in json.loads(line[6:]).get("choices", []):
                            yield choice.get("delta", {}).get("content") or ""
                        last = event_id or last
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            if job_id is None:
                raise  # not sent, or its answer lost before it began: nothing to take up
            time.sleep(0.5)
    raise RuntimeError(f"job {job_id}: the stream broke {tries} times")


if __name__ == "__main__":
    question = " ".join(sys.argv[1:]) or "Name three rivers."
    for piece in chat_stream(
        {"model": "parkq", "messages": [{"role": "user", "content": question}]}
    ):
        print(piece, end="", flush=True)
    print()
