"""Long greedy completion: the whole parkq pipeline versus bare llama-cpp-python.

    python -m benchmarks.throughput [--model PATH] [--tokens 512] [--out FILE.json]

Without --model it uses the demo model. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import requests

from benchmarks import model_and_chat_format, write_results

PROMPT = "The history of the printing press"


def bare_llama(model: str, n_ctx: int, tokens: int, chat_format: str | None) -> dict[str, float]:
    """llama-cpp-python's own generation loop: ``Llama.generate``, greedy."""
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))  # the same thread count parkq's engine uses
    llm = Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=256,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    ids = llm.tokenize(PROMPT.encode())
    t0 = first = time.perf_counter()
    for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), start=1):
        if n == 1:
            first = time.perf_counter()  # exclude the prompt, as the pipeline figure does
        if n >= tokens:
            break
    dt = time.perf_counter() - first
    llm.close()
    return {
        "tokens": tokens,
        "ttft_s": first - t0,
        "seconds": dt,
        "tokens_per_s": (tokens - 1) / dt,
    }


def bare_engine(model: str, n_ctx: int, tokens: int) -> dict[str, float]:
    """parkq's engine alone (no Redis, no HTTP): the decode loop the worker runs."""
    from jobs.engine import LlamaEngine

    engine = LlamaEngine(model, n_ctx=n_ctx, n_batch=256)
    ids = engine.tokenize(PROMPT)
    logits = engine.eval(ids, 0)
    pos = len(ids)
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = int(np.argmax(logits))
        logits = engine.eval([tok], pos)
        pos += 1
    dt = time.perf_counter() - t0
    engine.close()
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def pipeline(model: str, n_ctx: int, tokens: int, chat_format: str | None) -> dict[str, float]:
    """`parkq up` (embedded Redis, web, one worker), one streamed completion over HTTP."""
    from scheduler.settings import load_settings
    from web.launcher import Stack

    settings = load_settings(
        model=model, port=0, n_ctx=n_ctx, chat_format=chat_format, log_level="WARNING"
    )
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with Stack(settings) as stack:
        t0 = time.perf_counter()
        first = last = None
        n = 0
        url = stack.base_url + "/v1/completions"
        with requests.post(url, json=body, stream=True, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
    assert first is not None and last is not None
    return {
        "tokens": tokens,
        "events": n,
        "ttft_s": first - t0,
        "seconds": last - first,
        "tokens_per_s": (tokens - 1) / (last - first),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--out", default="bench-results/throughput.json")
    args = ap.parse_args()
    model, chat_format = model_and_chat_format(args.model)
    results = {
        "model": Path(model).name,
        "llama_cpp_python": bare_llama(model, args.n_ctx, args.tokens, chat_format),
        "parkq_engine": bare_engine(model, args.n_ctx, args.tokens),
        "parkq_pipeline": pipeline(model, args.n_ctx, args.tokens, chat_format),
    }
    base = results["llama_cpp_python"]["tokens_per_s"]
    print(f"model {results['model']}, {args.tokens} greedy tokens")
    for name in ("llama_cpp_python", "parkq_engine", "parkq_pipeline"):
        r = results[name]
        print(f"  {name:<18} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens_per_s'] / base:.3f}x)")
    print(f"  pipeline time to first token: {results['parkq_pipeline']['ttft_s'] * 1000:.0f} ms")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
