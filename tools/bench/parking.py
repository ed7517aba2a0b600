"""Park and resume latency, checkpoint size, and short-request TTFT under load.

    python -m tools.bench.parking [--model PATH] [--out FILE.json]

Part 1 (in process, real llama.cpp and a real Redis): a generation with about
500 and 1,500 tokens of context is parked and resumed 20 times each:
park = save the sequence KV + write the state and requeue (one Lua call);
resume = claim (one Lua call) + restore the state + load the KV.
Part 2 (`parkq up` over HTTP): a short interactive completion's time to first
token on an idle engine, and while a long batch job is running.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import requests

from jobs.engine.llama import LlamaEngine
from jobs.engine.request import GenerationRequest
from jobs.engine.sampling import SamplingParams
from jobs.store.scheduling import Store
from jobs.worker.generation import Generation
from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, model_and_chat_format, write_results
from tools.bench.workload import Request, stream
from tools.client import events, percentile
from tools.launcher import Stack, embedded_redis_server, free_port


def _p(values: list[float], p: float) -> float:
    got = percentile(values, p)
    assert got is not None, "no samples"
    return got


def park_resume(
    model: str, chat_format: str | None, contexts: list[int], rounds: int
) -> list[dict[str, Any]]:
    tmp = tempfile.mkdtemp()
    port = free_port()
    server = subprocess.Popen(
        [embedded_redis_server(), "--port", str(port), "--dir", tmp, "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    try:
        settings = load_settings(redis_url=f"redis://127.0.0.1:{port}/0", model=model)
        store = Store(redis.Redis.from_url(settings.redis_url or ""), settings)
        engine = LlamaEngine(model, n_ctx=4096, n_batch=256, chat_format=chat_format)
        results = []
        for n in contexts:
            job_id = f"park-{n}"
            prompt = engine.tokenize("word " * n)[: n - 8]
            req = GenerationRequest("completion", "m", prompt, 64, SamplingParams(temperature=0))
            gen = Generation(job_id, req, engine.token_bytes, engine.is_eog)
            engine.clear()
            for start in range(0, len(prompt), 256):
                logits = engine.eval(prompt[start : start + 256], start)
            gen.n_prefilled = len(prompt)
            pos = len(prompt)
            for _ in range(8):
                tok = int(np.argmax(logits))
                gen.accept(tok, logits)
                logits = engine.eval([tok], pos)
                pos += 1
            gen.accept(int(np.argmax(logits)), logits)  # the pending token
            store.enqueue(job_id, "completion", req.to_json(), 0, time.time())
            claim = store.claim("bench", time.time())
            assert claim is not None
            parks, resumes, size = [], [], 0
            for _ in range(rounds):
                t0 = time.perf_counter()
                kv = engine.save_seq()
                store.park(job_id, claim.exec_token, "bench", json.dumps(gen.state()), time.time())
                parks.append(time.perf_counter() - t0)
                size = len(kv)
                engine.clear()
                t0 = time.perf_counter()
                claim = store.claim("bench", time.time())
                assert claim is not None
                record = store.get(job_id) or {}
                gen = Generation.restore(
                    job_id, req, engine.token_bytes, engine.is_eog, json.loads(record["checkpoint"])
                )
                engine.load_seq(kv)
                resumes.append(time.perf_counter() - t0)
            store.cancel(job_id, time.time())
            results.append(
                {
                    "context_tokens": gen.n_past,
                    "checkpoint_bytes": size,
                    "park_ms_p50": _p(parks, 50) * 1000,
                    "park_ms_p95": _p(parks, 95) * 1000,
                    "resume_ms_p50": _p(resumes, 50) * 1000,
                    "resume_ms_p95": _p(resumes, 95) * 1000,
                }
            )
        engine.close()
        return results
    finally:
        server.terminate()
        server.wait()


def _ttft(base: str, body: dict[str, Any]) -> float:
    """Time to the first token; reads the stream to its end, so the job is over."""
    req = Request("short", time.monotonic())
    stream(f"{base}/v1/completions", body, req)
    if req.ttft is None:
        raise RuntimeError("no token")
    return req.ttft


def ttft_under_load(
    model: str, chat_format: str | None, samples: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    """A short request's TTFT on an idle engine and while a long batch job runs,
    on a worker of one sequence: every busy sample parks the long job."""
    settings = load_settings(model=model, port=0, chat_format=chat_format, log_level="WARNING",
                             max_seqs=1)  # fmt: skip
    short = {"prompt": "The capital of France is", "max_tokens": 8, **sampling}
    long = {
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
        "priority": "batch",
        **sampling,
    }
    with Stack(settings) as stack:
        base = stack.base_url
        _ttft(base, short)  # warm up
        idle = [_ttft(base, short) for _ in range(samples)]
        busy, preemptions = [], 0
        for _ in range(samples):
            r = requests.post(
                f"{base}/v1/completions", json={**long, "stream": True}, stream=True, timeout=600
            )
            job_id = r.headers["X-Job-Id"]
            lines = events(r)
            for _, data in lines:
                if data.startswith("{"):
                    break
            time.sleep(0.5)
            busy.append(_ttft(base, short))
            requests.delete(f"{base}/v1/jobs/{job_id}", timeout=10)
            for _ in lines:
                pass
            r.close()
            preemptions += requests.get(f"{base}/v1/jobs/{job_id}", timeout=10).json()[
                "preemptions"
            ]
    return {
        "idle_ms_p50": statistics.median(idle) * 1000,
        "idle_ms_p95": _p(idle, 95) * 1000,
        "busy_ms_p50": statistics.median(busy) * 1000,
        "busy_ms_p95": _p(busy, 95) * 1000,
        "samples": samples,
        "preemptions": preemptions,
    }


def main() -> None:
    ap = command_line(__doc__, "parking")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--samples", type=int, default=10)
    args = ap.parse_args()
    model, chat_format = model_and_chat_format(args.model)
    results: dict[str, Any] = {
        "model": Path(model).name,
        "park_resume": park_resume(model, chat_format, [500, 1500], args.rounds),
        # Greedy, and what the openai client sends unasked (temperature 1, top_p 1).
        "short_ttft": {
            arm: ttft_under_load(model, chat_format, args.samples, SAMPLING[arm]["parkq"])
            for arm in SAMPLING
        },
    }
    print(f"model {results['model']}")
    for r in results["park_resume"]:
        print(
            f"  {r['context_tokens']:>5} tokens of context: "
            f"checkpoint {r['checkpoint_bytes'] / 1e6:.2f} MB, "
            f"park p50 {r['park_ms_p50']:.2f} ms p95 {r['park_ms_p95']:.2f} ms, "
            f"resume p50 {r['resume_ms_p50']:.2f} ms p95 {r['resume_ms_p95']:.2f} ms"
        )
    for arm, t in results["short_ttft"].items():
        print(
            f"  short request TTFT ({arm}): idle p50 {t['idle_ms_p50']:.0f} ms "
            f"p95 {t['idle_ms_p95']:.0f} ms; while a long job runs p50 {t['busy_ms_p50']:.0f} ms "
            f"p95 {t['busy_ms_p95']:.0f} ms ({t['preemptions']} preemptions in "
            f"{t['samples']} samples)"
        )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
