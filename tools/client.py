"""The client side of parkq's HTTP API, for the tools: an SSE event reader, a
session that retries, a /metrics counter and percentiles of what was measured."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

__all__ = ["DONE", "events", "lines", "percentile", "read_counter", "retrying_session"]

DONE = "[DONE]"


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of an SSE body that arrives in ``chunks`` (cut anywhere, even
    inside a character), each without its end: LF or CR LF, as the servers
    here end them. Only those end a line: text that holds other line breaks of
    Unicode (U+2028, NEL, a form feed; a JSON string may carry them
    unescaped) stays in its line, where ``str.splitlines`` (requests'
    ``iter_lines``) would cut it."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *done, pending = pending.split(b"\n")
        for line in done:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", "replace")


def events(resp: requests.Response) -> Iterator[tuple[str, str]]:
    """``(id, data)`` of each event of an SSE response as it arrives, to the
    ``[DONE]`` event (included) or the end of the stream."""
    event_id = ""
    for line in lines(resp.iter_content(chunk_size=None)):
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]
            if line[6:] == DONE:
                return


def retrying_session(retries: int, backoff_max: float = 10.0) -> requests.Session:
    """A session whose requests are retried (urllib3's ``Retry``) when the server
    cannot be reached or answers 429 or 5xx, with exponential back-off from 0.5 s
    (or the server's Retry-After); after the last try the last answer is returned."""
    retry = Retry(
        total=retries,
        backoff_factor=0.5,
        backoff_max=backoff_max,
        status_forcelist=(429, 500, 502, 503, 504),
        allowed_methods=None,  # parkq's POSTs are safe to repeat: a job per request
        respect_retry_after_header=True,
        raise_on_status=False,
    )
    session = requests.Session()
    adapter = HTTPAdapter(max_retries=retry)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def read_counter(base_url: str, headers: dict[str, str], name: str) -> float:
    """A sample's value from a running parkq's /metrics (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile (0-100, linear interpolation); None without values."""
    return float(np.percentile(values, p)) if len(values) else None
