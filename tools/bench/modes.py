"""Run the workload against each system under test and reduce what was seen."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis
import requests

from jobs.engine.kernels import peer_server_command, worker_attention, worker_kernels
from jobs.engine.llama import gpu_layers, reference_generate, set_llama_extra_buffers
from jobs.store.scheduling import Store
from scheduler.settings import Settings
from tools.bench.llama_server import serving
from tools.bench.workload import SHORT_BODY, Observed, Request, Workload, play, stream
from tools.client import percentile
from tools.launcher import Stack, free_port

__all__ = [
    "bare_decode_rate",
    "idle_ttft",
    "run_llama_server",
    "run_parkq",
    "run_peer",
    "summarize",
]


def _ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values]
    return {
        "p50": percentile(ms, 50),
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
        "n": len(ms),
    }


def summarize(obs: Observed) -> dict[str, Any]:
    end = obs.start + obs.duration

    def in_window(reqs: list[Request]) -> int:
        return sum(1 for r in reqs for t in r.tokens if t <= end)

    shorts, longs = obs.of("short"), obs.of("long")
    long_tokens = in_window(longs)
    return {
        "short_ttft_ms": _ms([r.ttft for r in shorts if r.ttft is not None]),
        "short_requests": len(shorts),
        "short_unanswered": sum(1 for r in shorts if r.first is None),
        "short_tokens_mean": float(np.mean([len(r.tokens) for r in shorts])) if shorts else None,
        "long_tokens_per_s": long_tokens / obs.duration,
        "aggregate_tokens_per_s": (long_tokens + in_window(shorts)) / obs.duration,
        "long_jobs": len(longs),
    }


def timeline(obs: Observed) -> dict[str, Any]:
    """Token arrival times, short arrivals and first tokens, relative to the start."""

    def rel(ts: list[float]) -> list[float]:
        return [round(t - obs.start, 4) for t in ts]

    return {
        "long_tokens": rel([t for r in obs.of("long") for t in r.tokens]),
        "short_tokens": rel([t for r in obs.of("short") for t in r.tokens]),
        "short_arrivals": rel([r.sent for r in obs.of("short")]),
        "short_first": rel([r.first for r in obs.of("short") if r.first is not None]),
        "short_ttft_ms": [round(r.ttft * 1000, 2) for r in obs.of("short") if r.ttft is not None],
    }


def run_parkq(settings: Settings, workload: Workload) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workload against `parkq up` (its own embedded Redis)."""
    with Stack(settings) as stack:
        _warm(stack.base_url)
        obs = play(stack.base_url, workload, {"ignore_eos": True})
        client = redis.Redis.from_url(stack.settings.redis_url or "")
        telemetry = Store(client, stack.settings).telemetry
        preemptions = 0
        for r in obs.of("long"):
            if r.job_id:
                status = requests.get(f"{stack.base_url}/v1/jobs/{r.job_id}", timeout=10).json()
                preemptions += int(status.get("preemptions", 0))
        result = summarize(obs)
        result.update(
            preemptions=preemptions,
            park_ms=_quantiles(telemetry.samples("park_ms")),
            resume_ms=_quantiles(telemetry.samples("resume_ms")),
            checkpoint_bytes=_quantiles(telemetry.samples("checkpoint_bytes")),
        )
        client.close()
    return result, timeline(obs)


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "n": len(values)}


@contextmanager
def peer_server(settings: Settings) -> Iterator[str]:
    """llama-cpp-python's own OpenAI server on the same model file."""
    port = free_port()
    threads = str(settings.n_threads or len(os.sched_getaffinity(0)))
    # The peer runs the kernels parkq's worker chose for this machine and model.
    extra = worker_kernels(settings)
    argv = [*peer_server_command(extra.extra_buffers), "--model", settings.model or "",
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(settings.n_ctx),
            "--n_threads", threads, "--n_threads_batch", threads]  # fmt: skip
    with serving(argv, f"http://127.0.0.1:{port}", "/v1/models", "llama_cpp.server") as base:
        yield base


def run_peer(
    settings: Settings, workload: Workload, eos: list[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    with peer_server(settings) as base:
        _warm(base)
        bias = {str(t): -100.0 for t in eos}  # the peer has no ignore_eos
        obs = play(base, workload, {"logit_bias": bias})
    return summarize(obs), timeline(obs)


def run_llama_server(
    settings: Settings, workload: Workload, binary: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workload against llama.cpp's own server (continuous batching, no
    priorities) with as many slots as parkq's worker has sequences, the same
    threads, context per sequence and kernel path."""
    from tools.bench.llama_server import running_llama_server

    extra = worker_kernels(settings)
    threads = settings.n_threads or len(os.sched_getaffinity(0))
    seqs = max(2, settings.max_seqs or 1)
    with running_llama_server(binary, model=settings.model or "", seqs=seqs,
                              n_ctx=settings.n_ctx, threads=threads,
                              extra_buffers=extra.extra_buffers,
                              gpu_layers=gpu_layers(settings.n_gpu_layers),
                              flash_attn=worker_attention(settings)) as base:  # fmt: skip
        _warm(base)
        obs = play(base, workload, {"ignore_eos": True})
    return summarize(obs), timeline(obs)


def idle_ttft(settings: Settings, workload: Workload, samples: int) -> dict[str, Any]:
    """Short requests one at a time on an idle parkq engine: the baseline."""
    with Stack(settings) as stack:
        _warm(stack.base_url)
        ttfts = []
        short = {k: v for k, v in SHORT_BODY.items() if k != "temperature"}
        body = {**short, "max_tokens": workload.short_tokens, "ignore_eos": True,
                **workload.sampling_fields}  # fmt: skip
        for _ in range(samples):
            req = Request("short", time.monotonic())
            stream(f"{stack.base_url}/v1/completions", body, req)
            if req.ttft is not None:
                ttfts.append(req.ttft)
    return {"short_ttft_ms": _ms(ttfts), "samples_ms": [round(t * 1000, 2) for t in ttfts]}


def bare_decode_rate(settings: Settings, tokens: int) -> float:
    """llama-cpp-python's own generation loop on the same model: tokens/s."""
    set_llama_extra_buffers(worker_kernels(settings).extra_buffers)
    threads = settings.n_threads or len(os.sched_getaffinity(0))
    model, prompt = settings.model or "", "The history of the printing press"
    _, rest = reference_generate(model, prompt, tokens, settings.n_ctx, settings.n_batch, threads)
    return (tokens - 1) / rest


def _warm(base: str) -> None:
    body = {"prompt": "warm up", "max_tokens": 4, "temperature": 0}
    requests.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
