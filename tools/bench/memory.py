"""Redis memory under sustained load: flat once finished jobs' per-token events
pass the replay window, or growing with every token?

    python -m tools.bench.memory [--tiny | --model PATH] [--tokens 200000]
        [--replay 60] [--clients 8] [--out FILE.json]

Starts `parkq up` (its own Redis, one worker, default settings but
PARKQ_REPLAY_SECONDS=--replay) and keeps it busy: --clients streaming clients
(half greedy, half the openai client's default sampling), each reading every
stream to its end, and every --batch-every seconds a Batch API batch of
--batch-lines lines that nobody ever reads. Redis's ``used_memory`` is printed
at the start, every --every seconds and at the end. The load runs until
--tokens tokens have been generated; the measuring goes on one replay window
and a minute more (a window of at most 2 minutes), so the last figure comes
after the window has passed for everything generated. Writes JSON (figures,
the command, the machine).

``--replay 86400`` is what parkq kept before the janitor (every event for a
day): the comparison arm.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import threading
import time
from typing import Any

import redis
import requests

from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, model_and_chat_format, write_results
from tools.launcher import Stack


def _stream(base: str, body: dict[str, Any]) -> int:
    """One streamed completion read to its end; its events."""
    n = 0
    with requests.post(f"{base}/v1/completions", json={**body, "stream": True}, stream=True,
                       timeout=600) as resp:  # fmt: skip
        for line in resp.iter_lines():
            n += line.startswith(b"data: ")
    return n


def _batch(base: str, lines: int, k: int) -> None:
    """A batch of ``lines`` 150-token completions, never read afterwards."""
    body = "\n".join(
        json.dumps(
            {
                "custom_id": f"b{k}-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": f"Document {k}.{i} says", "max_tokens": 150, "ignore_eos": True},
            }
        )
        for i in range(lines)
    )
    up = requests.post(f"{base}/v1/files", files={"file": ("in.jsonl", io.BytesIO(body.encode()))},
                       data={"purpose": "batch"}, timeout=60).json()  # fmt: skip
    requests.post(f"{base}/v1/batches", json={"input_file_id": up["id"], "completion_window": "24h",
                  "endpoint": "/v1/completions"}, timeout=60)  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, chat_format = model_and_chat_format(None if args.tiny else args.model)
    if args.tiny:
        from jobs.engine.testmodel import write_test_model

        model = str(write_test_model(f"/tmp/parkq-memory-tiny-{time.time_ns()}.gguf", seed=0))
        chat_format = None
    settings = load_settings(model=model, chat_format=chat_format, port=0, log_level="WARNING",
                             replay_seconds=args.replay, result_ttl=args.result_ttl)  # fmt: skip
    stack = Stack(settings)
    stack.start()
    samples: list[dict[str, Any]] = []
    try:
        stack.wait_healthy(timeout=300)
        base = stack.base_url
        r = redis.Redis.from_url(stack.settings.redis_url or "")
        counters = stack.settings.keys.counters
        t0 = time.monotonic()
        stop = threading.Event()
        done = {"streams": 0, "batches": 0}

        def sample(label: str) -> None:
            used = int(r.info("memory")["used_memory"])
            tokens = int(r.hget(counters, "tokens") or 0)
            keys = int(r.dbsize())
            row = {"s": round(time.monotonic() - t0, 1), "label": label, "used_memory": used,
                   "tokens": tokens, "keys": keys, "streams_done": done["streams"],
                   "batches": done["batches"]}  # fmt: skip
            samples.append(row)
            print(f"{samples[-1]['s']:7.1f} s  {label:8}  used_memory {used / 2**20:7.2f} MiB  "
                  f"tokens {tokens:>8,}  keys {keys:>6}", flush=True)  # fmt: skip

        def client(i: int) -> None:
            arm = SAMPLING["greedy" if i % 2 == 0 else "default"]["parkq"]
            k = 0
            while not stop.is_set():
                body = {"prompt": f"Client {i}, request {k}:", "max_tokens": 200,
                        "ignore_eos": True, "seed": k, **arm}  # fmt: skip
                with contextlib.suppress(requests.RequestException):
                    _stream(base, body)
                    done["streams"] += 1
                k += 1

        def batches() -> None:
            k = 0
            while not stop.wait(args.batch_every):
                with contextlib.suppress(requests.RequestException):
                    _batch(base, args.batch_lines, k)
                    done["batches"] += 1
                k += 1

        sample("start")
        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(args.clients)]  # fmt: skip
        threads.append(threading.Thread(target=batches, daemon=True))
        for t in threads:
            t.start()
        next_at = args.every
        while int(r.hget(counters, "tokens") or 0) < args.tokens:
            time.sleep(0.5)
            if time.monotonic() - t0 >= next_at:
                sample("load")
                next_at += args.every
        stop.set()
        load_end = time.monotonic() - t0
        sample("load end")
        # One replay window and a minute (at most 3 minutes: the comparison arm's
        # day-long window is not waited out).
        window = max(args.replay, args.result_ttl or 0)
        settle = min(window, 120) + 60 + 2 * load_settings().janitor_seconds
        end = time.monotonic() + settle
        while time.monotonic() < end:
            time.sleep(min(args.every, max(0.1, end - time.monotonic())))
            sample("after")
        sample("end")
        for t in threads:
            t.join(timeout=60)
    finally:
        stack.stop()
    tokens = samples[-1]["tokens"]
    start, end_ = samples[0]["used_memory"], samples[-1]["used_memory"]
    peak = max(s["used_memory"] for s in samples)
    jobs = samples[-1]["streams_done"] + samples[-1]["batches"] * args.batch_lines
    return {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs",
        "model": model,
        "replay_seconds": args.replay,
        "result_ttl": args.result_ttl or load_settings().result_ttl,
        "clients": args.clients,
        "batch_lines": args.batch_lines,
        "batch_every_s": args.batch_every,
        "load_seconds": round(load_end, 1),
        "tokens": tokens,
        "jobs": jobs,
        "used_memory_start": start,
        "used_memory_peak": peak,
        "used_memory_end": end_,
        "retained_bytes_per_job": round((end_ - start) / max(jobs, 1)),
        "samples": samples,
    }


def main() -> None:
    ap = command_line(__doc__, "memory")
    ap.add_argument("--tiny", action="store_true", help="the tiny generated test model")
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens to generate")
    ap.add_argument("--replay", type=int, default=60, help="PARKQ_REPLAY_SECONDS")
    ap.add_argument("--result-ttl", type=int, default=None,
                    help="PARKQ_RESULT_TTL (default: parkq's, a day)")  # fmt: skip
    ap.add_argument("--clients", type=int, default=8, help="streaming clients")
    ap.add_argument("--batch-lines", type=int, default=20, help="lines per batch")
    ap.add_argument("--batch-every", type=float, default=10.0, help="seconds between batches")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    args = ap.parse_args()
    results = run(args)
    results["command"] = "python -m tools.bench.memory " + " ".join(sys.argv[1:])
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1))
    write_results(args.out, results)


if __name__ == "__main__":
    main()
