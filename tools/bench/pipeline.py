"""One long job through the whole pipeline, beside the bare decode loop.

    python -m tools.bench.pipeline [--model PATH] [--tokens 2000] [--runs 3] [--threads N]
    ../shared/tools/under-load -- .venv/bin/python -m tools.bench.pipeline   # on a busy machine

Starts `parkq up` (embedded Redis, web, one worker) on the model (default: the
tiny test model), streams ``--tokens`` tokens ``--runs`` times, greedy and with
the openai client's default sampling, and times each from the request to
``[DONE]``; then times the bare
llama-cpp-python loop (``eval([argmax(logits)])``) for as many steps. The gap
between the two is what parkq's hops (worker → Redis → web → client) cost.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from jobs.engine.llama import LlamaEngine
from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, greedy_decode, write_results
from tools.bench.workload import Request, stream


def _pipeline(base_url: str, tokens: int, sampling: dict[str, Any]) -> dict[str, float]:
    body = {"prompt": "hello", "max_tokens": tokens, "ignore_eos": True, **sampling}
    req = Request("long", time.monotonic())
    stream(f"{base_url}/v1/completions", body, req)
    t0, first = req.sent, req.first
    wall = (req.end or t0) - t0
    return {
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall),
        "ttft_ms": round(((first or t0) - t0) * 1000, 1),
    }


def _bare(model: str, tokens: int, threads: int | None) -> float:
    engine = LlamaEngine(model, n_ctx=tokens + 64, n_batch=16, n_threads=threads)
    return tokens / greedy_decode(engine, "hello", tokens)


def main() -> None:
    ap = command_line(__doc__, "pipeline", "the tiny test model")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, help="llama.cpp threads (default: PARKQ_N_THREADS)")
    args = ap.parse_args()

    from jobs.engine.testmodel import write_test_model
    from tools.launcher import Stack

    model = args.model or str(write_test_model(Path(tempfile.mkdtemp()) / "tiny.gguf"))
    overrides: dict[str, Any] = {"model": model, "port": 0, "log_level": "WARNING",
                                 "n_ctx": args.tokens + 64}  # fmt: skip
    if args.threads:
        overrides["n_threads"] = args.threads
    settings = load_settings(**overrides)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in SAMPLING}
    with Stack(settings) as stack:
        for n in range(args.runs):
            for arm in SAMPLING:  # interleaved: drift spreads over both
                fields = SAMPLING[arm]["parkq"]
                runs[arm].append(_pipeline(stack.base_url, args.tokens, fields))
                print(f"pipeline run {n} ({arm}): {runs[arm][-1]}", flush=True)
    bare = _bare(model, args.tokens, settings.n_threads)
    for arm, got in runs.items():
        best = max(r["tok_s"] for r in got)
        print(f"{arm}: pipeline best {best} tok/s; bare greedy decode loop {bare:.0f} tok/s "
              f"(pipeline/bare {best / bare:.2f})")  # fmt: skip
    write_results(
        args.out,
        {
            "model": model,
            "tokens": args.tokens,
            "threads": settings.n_threads,
            "write_interval_seconds": settings.write_interval_seconds,
            "pipeline": runs,
            "bare_tok_s": round(bare),
        },
    )


if __name__ == "__main__":
    main()
