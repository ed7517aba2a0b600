"""`parkq soak`: a long mixed workload that checks nothing is lost.

Batch clients keep long generations running back to back; interactive
requests arrive as a Poisson process and preempt them. Some requests are
cancelled, some readers drop their connection and come back with
``Last-Event-ID``. Every stream is checked as it is read: event ids without a
gap or a duplicate, one ``[DONE]``, and, since every request is greedy and
drawn from a small set, the same request always gives the same text (a park
and resume that changed a single token would show). At the end every accepted
job must have ended. Anything else is an unexpected error.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

from tools.client import events, percentile, read_counter

__all__ = ["SoakPlan", "SoakReport", "parse_duration", "run_soak"]

PROMPTS = (
    "The history of the printing press",
    "A recipe for bread, step by step:",
    "Q: Why is the sky blue?\nA:",
    "def fibonacci(n):",
    "Once upon a time, in a small harbour town,",
    "The three laws of thermodynamics are",
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"10m"`` or ``"1.5h"``."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 10m, 1h)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


@dataclass(frozen=True)
class SoakPlan:
    duration: float
    #: Interactive requests per second (Poisson arrivals).
    interactive_rate: float = 0.1
    #: Clients each keeping one batch job running at a time.
    batch_clients: int = 2
    interactive_tokens: tuple[int, ...] = (16, 32, 48)
    batch_tokens: tuple[int, ...] = (128, 256, 384)
    cancel_fraction: float = 0.04
    reconnect_fraction: float = 0.25
    seed: int = 0
    #: Most interactive requests in flight at once (arrivals beyond it are skipped).
    max_in_flight: int = 32


@dataclass
class SoakReport:
    duration_s: float = 0.0
    requests: int = 0
    completions: int = 0
    cancellations: int = 0
    refused_429: int = 0
    reconnects: int = 0
    preemptions: int = 0
    tokens: int = 0
    lost: int = 0
    unexpected_errors: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)
    worker_rss_start: int | None = None
    worker_rss_end: int | None = None

    @property
    def ok(self) -> bool:
        return self.unexpected_errors == 0 and self.lost == 0

    @property
    def unexercised(self) -> list[str]:
        """What a soak promises to go through but this run never did."""
        missing = []
        if not (self.ttft_ms.get("interactive") or {}).get("n"):
            missing.append("no interactive request completed")
        if not self.preemptions:
            missing.append("nothing was parked")
        if not self.reconnects:
            missing.append("no reader reconnected")
        return missing

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "unexercised": self.unexercised}


class _Run:
    """The shared state of one soak run (thread-safe counters and checks)."""

    def __init__(self, base_url: str, plan: SoakPlan, headers: dict[str, str]) -> None:
        self.base = base_url
        self.plan = plan
        self.headers = headers
        self.lock = threading.Lock()
        self.report = SoakReport()
        self.ttft: dict[str, list[float]] = {"interactive": [], "batch": []}
        self.texts: dict[tuple[str, int], str] = {}
        self.accepted: list[str] = []

    def error(self, message: str) -> None:
        with self.lock:
            self.report.unexpected_errors += 1
            if len(self.report.errors) < 50:
                self.report.errors.append(message)

    def bump(self, name: str, by: int = 1) -> None:
        with self.lock:
            setattr(self.report, name, getattr(self.report, name) + by)

    # -- one request ---------------------------------------------------------

    def request(self, rng: random.Random, priority: str) -> None:
        plan = self.plan
        lengths = plan.interactive_tokens if priority == "interactive" else plan.batch_tokens
        prompt = rng.choice(PROMPTS)
        max_tokens = rng.choice(lengths)
        cancel_at = rng.randint(1, max_tokens) if rng.random() < plan.cancel_fraction else None
        reconnect_at = (
            rng.randint(1, max_tokens) if rng.random() < plan.reconnect_fraction else None
        )
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "priority": priority,
            "stream": True,
        }
        self.bump("requests")
        sent = time.monotonic()
        try:
            resp = requests.post(
                f"{self.base}/v1/completions",
                json=body,
                headers=self.headers,
                stream=True,
                timeout=(10, 600),
            )
        except requests.RequestException as exc:
            self.error(f"submit failed: {exc}")
            return
        if resp.status_code == 429:
            resp.close()
            self.bump("refused_429")
            if "Retry-After" not in resp.headers:
                self.error("429 without Retry-After")
            return
        if resp.status_code != 200:
            self.error(f"submit answered {resp.status_code}: {resp.text[:200]}")
            return
        job_id = resp.headers.get("X-Job-Id", "")
        with self.lock:
            self.accepted.append(job_id)
        self._read(job_id, priority, resp, sent, (prompt, max_tokens), cancel_at, reconnect_at)

    def _read(
        self,
        job_id: str,
        priority: str,
        resp: requests.Response,
        sent: float,
        key: tuple[str, int],
        cancel_at: int | None,
        reconnect_at: int | None,
    ) -> None:
        last = 0
        text: list[str] = []
        first: float | None = None
        finish: str | None = None
        error_code: str | None = None
        done = False
        connections = 0
        deadline = time.monotonic() + 1800
        while not done:
            if time.monotonic() > deadline:
                self.error(f"job {job_id}: stream did not end within 30 minutes")
                return
            connections += 1
            if connections > 50:
                self.error(f"job {job_id}: more than 50 connections to read one stream")
                return
            try:
                for event_id, data in events(resp):
                    seq = int(event_id)
                    if seq != last + 1:
                        kind = "duplicate" if seq <= last else "gap"
                        self.error(f"job {job_id}: {kind}: event {seq} after {last}")
                    last = max(last, seq)
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error_code = chunk["error"].get("code")
                        continue
                    for choice in chunk.get("choices", []):
                        piece = choice.get("text") or ""
                        if piece and first is None:
                            first = time.monotonic()
                        text.append(piece)
                        finish = choice.get("finish_reason") or finish
                    if cancel_at is not None and last >= cancel_at:
                        cancel_at = None
                        self._cancel(job_id)
                    if reconnect_at is not None and last >= reconnect_at:
                        reconnect_at = None
                        break  # drop the connection; come back with Last-Event-ID
            except (requests.RequestException, ValueError) as exc:
                if isinstance(exc, ValueError):
                    self.error(f"job {job_id}: malformed event after {last}: {exc}")
                    return
            finally:
                resp.close()
            if done:
                break
            self.bump("reconnects")
            time.sleep(0.2)
            try:
                resp = requests.get(
                    f"{self.base}/v1/jobs/{job_id}/events",
                    headers={**self.headers, "Last-Event-ID": str(last)},
                    stream=True,
                    timeout=(10, 600),
                )
            except requests.RequestException:
                continue
            if resp.status_code != 200:
                self.error(f"job {job_id}: reconnect answered {resp.status_code}")
                return
        if first is not None:
            with self.lock:
                self.ttft[priority].append((first - sent) * 1000)
        self._outcome(job_id, key, "".join(text), finish, error_code)

    def _cancel(self, job_id: str) -> None:
        try:
            r = requests.delete(f"{self.base}/v1/jobs/{job_id}", headers=self.headers, timeout=30)
        except requests.RequestException as exc:
            self.error(f"job {job_id}: cancel failed: {exc}")
            return
        if r.status_code not in (200, 202, 409):
            self.error(f"job {job_id}: cancel answered {r.status_code}")

    def _outcome(
        self,
        job_id: str,
        key: tuple[str, int],
        text: str,
        finish: str | None,
        error_code: str | None,
    ) -> None:
        if error_code == "job_cancelled":
            self.bump("cancellations")
            return
        if error_code is not None or finish not in ("stop", "length"):
            self.error(f"job {job_id}: ended with error {error_code!r}, finish {finish!r}")
            return
        self.bump("completions")
        with self.lock:
            seen = self.texts.setdefault(key, text)
        if seen != text:
            self.error(f"job {job_id}: text differs from an earlier run of the same request")

    # -- the workload ---------------------------------------------------------

    def play(self) -> None:
        plan = self.plan
        start = time.monotonic()
        deadline = start + plan.duration
        threads: list[threading.Thread] = []

        def batch_client(i: int) -> None:
            rng = random.Random(plan.seed * 1000 + i)
            while time.monotonic() < deadline:
                self.request(rng, "batch")

        for i in range(plan.batch_clients):
            t = threading.Thread(target=batch_client, args=(i,), daemon=True)
            t.start()
            threads.append(t)
        arrivals = random.Random(plan.seed)
        at = start
        n = 0
        while plan.interactive_rate > 0:
            at += arrivals.expovariate(plan.interactive_rate)
            if at >= deadline:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            threads = [t for t in threads if t.is_alive()]
            if len(threads) - plan.batch_clients >= plan.max_in_flight:
                continue
            n += 1
            rng = random.Random(plan.seed * 1000 + 500 + n)
            t = threading.Thread(target=self.request, args=(rng, "interactive"), daemon=True)
            t.start()
            threads.append(t)
        time.sleep(max(0.0, deadline - time.monotonic()))
        for t in threads:
            t.join(timeout=max(1.0, start + plan.duration + 1800 - time.monotonic()))
            if t.is_alive():
                self.error("a client did not finish within 30 minutes of the end")
        self.report.duration_s = round(time.monotonic() - start, 1)

    def check_ended(self) -> None:
        """Every accepted job has ended (finished or cancelled), none is lost."""
        for job_id in self.accepted:
            try:
                r = requests.get(f"{self.base}/v1/jobs/{job_id}", headers=self.headers, timeout=30)
                state = r.json().get("state") if r.status_code == 200 else None
            except (requests.RequestException, ValueError):
                state = None
            if state not in ("finished", "cancelled"):
                self.report.lost += 1
                self.error(f"job {job_id}: lost (state {state!r} after the run)")


def _worker_rss(base: str, headers: dict[str, str]) -> int | None:
    state = requests.get(f"{base}/dashboard/state", headers=headers, timeout=30).json()
    sizes = [w.get("rss_bytes") for w in state.get("workers", [])]
    return sum(sizes) if sizes and None not in sizes else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_soak(
    base_url: str,
    plan: SoakPlan,
    api_key: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> SoakReport:
    """Play ``plan`` against a running parkq and report what happened."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run = _Run(base_url, plan, headers)
    report = run.report
    report.worker_rss_start = _worker_rss(base_url, headers)
    preempt0 = read_counter(base_url, headers, "parkq_preemptions_total")
    tokens0 = read_counter(base_url, headers, "parkq_tokens_generated_total")
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(60):
            if progress:
                r = run.report
                progress(
                    f"soak: {r.requests} requests, {r.completions} completed, "
                    f"{r.cancellations} cancelled, {r.unexpected_errors} errors"
                )

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        run.play()
    finally:
        stop.set()
    run.check_ended()
    report.preemptions = int(read_counter(base_url, headers, "parkq_preemptions_total") - preempt0)
    report.tokens = int(read_counter(base_url, headers, "parkq_tokens_generated_total") - tokens0)
    report.worker_rss_end = _worker_rss(base_url, headers)
    for priority, values in run.ttft.items():
        report.ttft_ms[priority] = {
            "p50": _rounded(percentile(values, 50)),
            "p95": _rounded(percentile(values, 95)),
            "n": len(values),
        }
    return report
