"""What llama.cpp's kernel switches cost: decode calls of 1..N sequences and a
prefill chunk, under each setting, each in a fresh process (llama.cpp reads
its switches once per process).

    python -m tools.bench.kernels [--model PATH] [--widths 1,4,7,8]
        [--settings default,GGML_CPU_TILED_MM_MIN_ROWS=9,GGML_CPU_TILED_MM=0,...]
        [--repeat 7] [--out FILE.json]

For each setting: the best of ``--repeat`` times of one decode call of each
width (one token per sequence, the engine parkq's worker runs: no flash
attention, extra buffers off), and the tokens per second of a 256-token
prefill chunk (best of 3). Engine calls only: no sampling, so no sampling arms.
Prints a table and writes JSON (figures, the command, the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

PREFILL = 256


def _child(model: str, widths: list[int], repeat: int) -> dict[str, Any]:
    from jobs.engine.llama import LlamaEngine

    engine = LlamaEngine(model, n_ctx=1024, n_batch=PREFILL, n_seq_max=max(widths),
                         extra_buffers=False)  # fmt: skip
    out: dict[str, Any] = {
        f"decode_{k}_ms": round(1000 * engine._time_step(k, repeat=repeat), 2) for k in widths
    }
    text = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 60)[:PREFILL]
    best = float("inf")
    for _ in range(3):
        engine.clear(-1)
        t0 = time.perf_counter()
        engine.eval(text, 0, 0)
        best = min(best, time.perf_counter() - t0)
    out["prefill_tok_s"] = round(len(text) / best, 1)
    engine.close()
    return out


def _run(model: str, setting: str, widths: list[int], repeat: int) -> dict[str, Any]:
    env = dict(os.environ)
    if setting != "default":
        name, _, value = setting.partition("=")
        env[name] = value
    cmd = [sys.executable, "-m", "tools.bench.kernels", "--child", "--model", model,
           "--widths", ",".join(map(str, widths)), "--repeat", str(repeat)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="GGUF path (default: the demo model)")
    ap.add_argument("--widths", default="1,4,7,8")
    ap.add_argument(
        "--settings",
        default="default,GGML_CPU_TILED_MM_MIN_ROWS=9,GGML_CPU_TILED_MM=0,GGML_CPU_TILED_MM_FORCE=1",
    )
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default="bench-results/kernels.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    model = args.model
    if model is None:
        from jobs.engine.demo_model import assemble_demo_model, demo_model_target

        model = str(assemble_demo_model(demo_model_target(None)))
    if args.child:
        print(json.dumps(_child(model, widths, args.repeat)))
        return
    rows = {s: _run(model, s, widths, args.repeat) for s in args.settings.split(",")}
    head = ["setting", *(f"{k} in a call" for k in widths), "prefill tok/s"]
    print(" | ".join(head))
    for setting, r in rows.items():
        cells = [f"{r[f'decode_{k}_ms']} ms" for k in widths]
        print(" | ".join([setting, *cells, str(r["prefill_tok_s"])]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "rows": rows, "command": sys.argv,
                               "machine": platform.platform(), "cpus": os.cpu_count(),
                               "when": time.strftime("%Y-%m-%d %H:%M")}, indent=2))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
