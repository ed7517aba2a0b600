"""What batched prefill costs in the engine: N prompts prefilled in one call
(:meth:`LlamaEngine.prefill`) against N calls of their own, with parkq's
prompt floors (the exact worker's engine) and with llama.cpp's own floors.

    python -m tools.bench.prefill [--model PATH] [--prompts 8] [--repeat 5] [--out FILE.json]

The prompts are the concurrency bench's ("Question i: what is a parking
queue?\\nAnswer:"); flash attention on with its KV split off, extra buffers
off, the decode floor an exact worker sets. Engine calls only: no sampling,
so no sampling arms. Prints best and median milliseconds per arm and writes
JSON (figures, the command, the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _measure(model: str, n: int, repeat: int, floors: bool) -> dict[str, Any]:
    from jobs.engine.llama import LlamaEngine

    engine = LlamaEngine(model, n_ctx=1024, n_batch=256, n_seq_max=n, extra_buffers=False,
                         n_gpu_layers=0, flash_attn=True, prompt_floors=floors)  # fmt: skip
    engine.plan_prefill(n)
    prompts = [engine.tokenize(f"Question {i}: what is a parking queue?\nAnswer:")
               for i in range(n)]  # fmt: skip

    def together() -> float:
        engine.clear(-1)
        t0 = time.perf_counter()
        engine.prefill([(s, prompts[s], 0) for s in range(n)])
        return time.perf_counter() - t0

    def alone() -> float:
        engine.clear(-1)
        t0 = time.perf_counter()
        for s in range(n):
            engine.eval(prompts[s], 0, s)
        return time.perf_counter() - t0

    out: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts]}
    for name, arm in (("one_call_ms", together), ("calls_of_their_own_ms", alone)):
        times = sorted(arm() * 1000 for _ in range(repeat))
        out[name] = {"best": round(times[0], 1), "median": round(statistics.median(times), 1)}
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="GGUF path (default: the demo model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="bench-results/prefill.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("GGML_CPU_TILED_MM_MIN_ROWS", "17")  # what an exact worker sets
    os.environ.setdefault("GGML_CPU_FA_SPLIT_KV", "0")
    model = args.model
    if model is None:
        from jobs.engine.demo_model import assemble_demo_model, demo_model_target

        model = str(assemble_demo_model(demo_model_target(None)))
    arms = {"parkq prompt floors": True, "llama.cpp's own floors": False}
    results = {name: _measure(model, args.prompts, args.repeat, floors)
               for name, floors in arms.items()}  # fmt: skip
    for name, r in results.items():
        print(f"{name:<24} one call {r['one_call_ms']['best']:7.1f} ms (median "
              f"{r['one_call_ms']['median']:.1f})   calls of their own "
              f"{r['calls_of_their_own_ms']['best']:7.1f} ms (median "
              f"{r['calls_of_their_own_ms']['median']:.1f})")  # fmt: skip
    report = {"command": " ".join([sys.executable, "-m", "tools.bench.prefill", *sys.argv[1:]]),
              "machine": platform.processor() or platform.machine(), "model": model,
              "prompts": args.prompts, "results": results}  # fmt: skip
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
