"""A long completion, greedy and with the openai client's default sampling: the
whole parkq pipeline versus bare llama-cpp-python.

    python -m tools.bench.throughput [--model PATH] [--tokens 512] [--out FILE.json]

Without --model it uses the demo model. Prints a table and writes JSON.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from jobs.engine.llama import LlamaEngine, reference_generate
from tools.bench import SAMPLING, command_line, greedy_decode, model_and_chat_format, write_results
from tools.bench.workload import Request, stream

PROMPT = "The history of the printing press"


def bare_llama(model: str, n_ctx: int, tokens: int, temperature: float) -> dict[str, float]:
    """llama-cpp-python's own generation loop: ``Llama.generate``."""
    threads = len(os.sched_getaffinity(0))  # the same thread count parkq's engine uses
    ttft, dt = reference_generate(model, PROMPT, tokens, n_ctx, 256, threads, temperature)
    return {"tokens": tokens, "ttft_s": ttft, "seconds": dt, "tokens_per_s": (tokens - 1) / dt}


def bare_engine(model: str, n_ctx: int, tokens: int) -> dict[str, float]:
    """parkq's engine alone (no Redis, no HTTP): the decode loop the worker runs."""
    engine = LlamaEngine(model, n_ctx=n_ctx, n_batch=256)
    dt = greedy_decode(engine, PROMPT, tokens)
    engine.close()
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def pipeline(
    model: str, n_ctx: int, tokens: int, chat_format: str | None, sampling: dict[str, Any]
) -> dict[str, float]:
    """`parkq up` (embedded Redis, web, one worker), one streamed completion over HTTP."""
    from scheduler.settings import load_settings
    from tools.launcher import Stack

    settings = load_settings(
        model=model, port=0, n_ctx=n_ctx, chat_format=chat_format, log_level="WARNING"
    )
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, **sampling}
    with Stack(settings) as stack:
        req = Request("long", time.monotonic())
        stream(stack.base_url + "/v1/completions", body, req)
    assert req.first is not None and req.tokens
    seconds = req.tokens[-1] - req.first
    return {
        "tokens": tokens,
        "events": len(req.tokens),
        "ttft_s": req.first - req.sent,
        "seconds": seconds,
        "tokens_per_s": (tokens - 1) / seconds,
    }


def main() -> None:
    ap = command_line(__doc__, "throughput")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()
    model, chat_format = model_and_chat_format(args.model)
    engine = bare_engine(model, args.n_ctx, args.tokens)
    results: dict[str, Any] = {"model": Path(model).name, "tokens": args.tokens,
                               "parkq_engine": engine}  # fmt: skip
    # Greedy, and what the openai client sends unasked (temperature 1, top_p 1:
    # llama-cpp-python asked for the same distribution).
    for arm, temperature in (("greedy", 0.0), ("default", 1.0)):
        fields = SAMPLING[arm]["parkq"]
        ours = pipeline(model, args.n_ctx, args.tokens, chat_format, fields)
        theirs = bare_llama(model, args.n_ctx, args.tokens, temperature)
        results[arm] = {"llama_cpp_python": theirs, "parkq_pipeline": ours}
        base = theirs["tokens_per_s"]
        print(f"model {results['model']}, {args.tokens} tokens, sampling {arm}")
        print(f"  {'llama_cpp_python':<18} {base:8.1f} tok/s")
        if arm == "greedy":
            r = results["parkq_engine"]["tokens_per_s"]
            print(f"  {'parkq_engine':<18} {r:8.1f} tok/s  ({r / base:.3f}x)")
        r = ours["tokens_per_s"]
        print(f"  {'parkq_pipeline':<18} {r:8.1f} tok/s  ({r / base:.3f}x)")
        print(f"  pipeline time to first token: {ours['ttft_s'] * 1000:.0f} ms")
    write_results(args.out, results)


if __name__ == "__main__":
    main()
