"""Many people at once: k simultaneous interactive streams, for each PARKQ_MAX_SEQS.

    python -m benchmarks.concurrency [--model PATH] [--seqs 1,8] [--clients 1,2,4,8]
                                     [--tokens 64] [--threads N]

For each sequence count, starts `parkq up` (embedded Redis, web, one worker)
on the model (default: the demo model), warms it, then for each client count
sends that many greedy completions at the same moment and records when each
token arrives. Prints, per cell: TTFT p50 / p95 / max, inter-token p95, and the
aggregate tokens per second (all tokens over the wall time from the first
request to the last ``[DONE]``); writes them as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from benchmarks import write_results
from scheduler.settings import load_settings
from web.bench.workload import Request, stream


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _burst(base_url: str, clients: int, tokens: int) -> dict[str, Any]:
    url = f"{base_url}/v1/completions"
    reqs = [Request("short", 0.0) for _ in range(clients)]
    bodies = [
        {"prompt": f"Question {i}: what is a parking queue?\nAnswer:", "max_tokens": tokens,
         "temperature": 0, "ignore_eos": True, "priority": "interactive"}
        for i in range(clients)
    ]  # fmt: skip
    threads = [
        threading.Thread(target=stream, args=(url, b, r)) for b, r in zip(bodies, reqs, strict=True)
    ]
    t0 = time.monotonic()
    for r in reqs:
        r.sent = t0
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r.end or t0 for r in reqs) - t0
    ttft = [1000 * (r.ttft or 0.0) for r in reqs]
    gaps = [1000 * (b - a) for r in reqs for a, b in zip(r.tokens, r.tokens[1:], strict=False)]
    n = sum(len(r.tokens) for r in reqs)
    return {
        "clients": clients,
        "ttft_ms_p50": round(statistics.median(ttft), 1),
        "ttft_ms_p95": round(_pct(ttft, 95), 1),
        "ttft_ms_max": round(max(ttft), 1),
        "inter_token_ms_p95": round(_pct(gaps, 95), 1) if gaps else None,
        "aggregate_tok_s": round(n / wall, 1),
        "tokens": n,
    }


def _demo_model() -> str:
    from jobs.demo_model import assemble_demo_model, demo_model_target

    target = demo_model_target(None)
    return str(target if target.exists() else assemble_demo_model(target))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF model (default: the demo model)")
    ap.add_argument("--seqs", default="1,8", help="PARKQ_MAX_SEQS values to compare")
    ap.add_argument("--clients", default="1,2,4,8", help="simultaneous streams")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, help="llama.cpp threads (default: PARKQ_N_THREADS)")
    ap.add_argument("--out", default="bench-results/concurrency.json")
    args = ap.parse_args()

    from web.launcher import Stack

    rows = []
    for seqs in (int(x) for x in args.seqs.split(",")):
        overrides: dict[str, Any] = {"port": 0, "log_level": "WARNING", "n_ctx": 1024,
                                     "max_seqs": seqs}  # fmt: skip
        overrides["model"] = args.model or _demo_model()
        if args.threads:
            overrides["n_threads"] = args.threads
        settings = load_settings(**overrides)
        with Stack(settings) as stack:
            _burst(stack.base_url, 1, 8)  # warm: the model's pages, the first prefill
            for clients in (int(x) for x in args.clients.split(",")):
                row = {"max_seqs": seqs, **_burst(stack.base_url, clients, args.tokens)}
                rows.append(row)
                print(row, flush=True)
    print(f"\n{'max_seqs':>8} {'clients':>7} {'TTFT p50':>9} {'p95':>8} {'max':>8} "
          f"{'ITL p95':>8} {'tok/s':>7}")  # fmt: skip
    for r in rows:
        cells = [r["max_seqs"], r["clients"], r["ttft_ms_p50"], r["ttft_ms_p95"],
                 r["ttft_ms_max"], r["inter_token_ms_p95"], r["aggregate_tok_s"]]  # fmt: skip
        print(" ".join(f"{c!s:>{w}}" for c, w in zip(cells, (8, 7, 9, 8, 8, 8, 7), strict=True)))
    write_results(args.out, {"model": settings.model, "threads": settings.n_threads,
                             "tokens": args.tokens, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
