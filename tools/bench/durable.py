"""What waiting for a replica (Redis WAIT) costs per accepted request and would
cost per decoding step.

    python -m tools.bench.durable [--n 2000] [--out FILE.json]

Starts a primary and one replica (`redis-server`, loopback) and times, --n
times each, with parkq's own scripts and keys (jobs/store/scheduling.py):

- accepting a job (the enqueue script) alone, and followed by ``WAIT 1`` on the
  same connection (what PARKQ_DURABLE_REPLICAS=1 does, the default with a
  Sentinel URL);
- one step write of 8 sequences (the step script for each, one pipeline: a
  worker's write per step) alone, and followed by ``WAIT 1`` (what parkq does
  not do: a step lost in a failover is noticed and replayed instead).

Prints and writes (JSON) p50 / p99 / mean in ms for each.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import redis

from jobs.store.scheduling import StepCall, Store
from scheduler.settings import load_settings
from tools.bench import command_line, redis_server, write_results
from tools.launcher import free_port


def _figures(seconds: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in seconds)
    return {
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


def measure(n: int) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="parkq-durable-")
    primary_port = free_port()
    procs = [redis_server(work, primary_port)]
    replica_port = free_port()  # picked once the primary holds its own
    procs.append(redis_server(work, replica_port, "--replicaof", "127.0.0.1", str(primary_port)))
    try:
        replica = redis.Redis(port=replica_port)
        while replica.info("replication").get("master_link_status") != "up":
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{primary_port}/0"
        results: dict[str, Any] = {}
        for replicas in (0, 1):
            settings = load_settings(redis_url=url, durable_replicas=replicas,
                                     max_queue=10 * n, key_prefix=f"durable{replicas}")  # fmt: skip
            store = Store(redis.Redis.from_url(url), settings)
            took = []
            for i in range(n):
                t0 = time.perf_counter()
                store.enqueue(f"j{i}", "completion", {"prompt": "x" * 200}, 10, time.time())
                took.append(time.perf_counter() - t0)
            results[f"accept_wait_{replicas}"] = _figures(took)
            # Eight running jobs: claimed, then one step write each per step.
            store.workers.heartbeat("w", time.time(), 3600)
            claims = [store.claim(f"w{s}", time.time()) for s in range(8)]
            for s in range(8):
                store.workers.heartbeat(f"w{s}", time.time(), 3600)
            payload = json.dumps({"choices": [{"text": " token", "index": 0}], "object": "x"})
            took = []
            for step in range(1, n + 1):
                calls = [StepCall(c.job_id, c.exec_token, f"w{s}", step, step, [payload])
                         for s, c in enumerate(claims) if c is not None]  # fmt: skip
                t0 = time.perf_counter()
                if replicas:
                    script = store._scripts["step"]
                    with store.r.pipeline(transaction=False) as p:
                        for n, call in enumerate(calls):
                            keys, args = store._step_args(call, head=n == 0)
                            p.evalsha(script.sha, len(keys), *keys, *args)
                        p.execute_command("WAIT", 1, 1000)
                        p.execute()
                else:
                    store.steps(calls)
                took.append(time.perf_counter() - t0)
            results[f"step_write_8_seqs_wait_{replicas}"] = _figures(took)
        return {
            "machine": f"{platform.processor() or platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} CPUs",
            "redis": redis.Redis(port=primary_port).info("server")["redis_version"],
            "n": n,
            **results,
        }
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = command_line(__doc__, "durable", model="none (Redis only)")
    ap.add_argument("--n", type=int, default=2000, help="requests and steps per arm")
    args = ap.parse_args()
    results = measure(args.n)
    results["command"] = "python -m tools.bench.durable " + " ".join(sys.argv[1:])
    print(json.dumps(results, indent=1))
    write_results(args.out, results)


if __name__ == "__main__":
    main()
