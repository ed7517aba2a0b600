"""How large a fleet one Redis carries: simulated workers doing exactly the Redis
work of real ones, with no engine, and simulated streaming clients.

    python -m tools.bench.fleet [--seqs 8] [--rate 30] [--fleets 1,2,4,8,16,32]
        [--seconds 15] [--out FILE.json]

Starts one `redis-server` (loopback) and, for each fleet size W in --fleets,
W simulated workers for --seconds seconds. Each worker runs --seqs sequences
at --rate tokens per second each, through parkq's own code (jobs/store/scheduling.py,
jobs/store/registry.py) and keys:

- one step write per step for all its sequences (the step script, pipelined:
  one stream entry and one publish per token, the job's counters, the flags;
  the queue head read once per step), and its inter-token latencies written
  once per heartbeat;
- a job of 200 tokens ends with the finish script, and the sequence claims the
  next (the claim script; the queue is kept full);
- a heartbeat and a dead-worker check (CLIENT LIST) every 0.5 s, and a reap;
- one streaming client per sequence, as `parkq web` reads a job: a pub/sub
  subscription, and every 15 s (the keep-alive) the job's state.

The workers run as threads of --procs processes (2 by default: this machine's
cores are shared with Redis itself, so the load generator competes with what
it measures; a larger machine measures further). Figures per fleet size: step
write p50 / p99 (ms), tokens written per second against the tokens asked for,
Redis CPU (seconds per second), its ops per second, and which commands took
its time (INFO commandstats). The run stops after the first size whose p99
passes 5 ms or whose Redis CPU passes 0.9 s/s.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import redis

from jobs.store.scheduling import StepCall, Store
from jobs.store.telemetry import bucket_of
from scheduler.settings import load_settings
from scheduler.state import JobState
from tools.bench import command_line, redis_server, write_results
from tools.launcher import free_port

JOB_TOKENS = 200
PAYLOAD = json.dumps({"id": "cmpl-0123456789abcdef01234567", "object": "text_completion",
                      "created": 1796400000, "model": "gemma-3-270m-q4_k_m",
                      "choices": [{"index": 0, "text": " token", "logprobs": None,
                                   "finish_reason": None}]})  # fmt: skip


def _fill_queue(store: Store, n: int, start: int) -> None:
    for i in range(n):
        store.enqueue(f"fleet-{start + i}", "completion", {"prompt": "x"}, 0, time.time())


def _worker(name: str, url: str, prefix: str, seqs: int, rate: float, until: float,
            out: list[float], tokens: list[int]) -> None:  # fmt: skip
    """One simulated worker: ``seqs`` sequences stepping at ``rate`` tok/s each."""
    settings = load_settings(redis_url=url, key_prefix=prefix, queue_name=prefix,
                             max_queue=10**7)  # fmt: skip
    client = redis.Redis.from_url(url, client_name=settings.keys.client_name(name))
    store = Store(client, settings)
    slots = [f"{name}.{s}" for s in range(seqs)]
    for slot in slots:
        store.workers.heartbeat(slot, time.time(), 10, proc=name)
    running: dict[str, Any] = {}
    made: dict[str, int] = {}
    readers = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
    next_beat = 0.0
    next_keepalive = time.monotonic() + 15
    period = 1.0 / rate
    gaps: dict[str, int] = {}
    bucket = bucket_of(period * 1000)
    step_at = time.monotonic()
    while time.monotonic() < until:
        now = time.time()
        if now >= next_beat:  # heartbeat, dead-worker check, reap, latencies: every 0.5 s
            next_beat = now + 0.5
            for slot in slots:
                store.workers.heartbeat(slot, now, 10, proc=name)
            store.workers.disconnected(now, name)
            store.reap(now, name)
            if gaps:
                store.telemetry.observe_many(
                    "inter_token_ms", gaps, sum(gaps.values()) * period * 1000
                )
                gaps.clear()
        for slot in slots:
            if slot not in running:
                claim = store.claim(slot, now, name)
                if claim is not None:
                    running[slot] = claim
                    made[slot] = 0
                    readers.subscribe(settings.keys.channel(claim.job_id))
        calls = []
        for slot, claim in running.items():
            made[slot] += 1
            calls.append(StepCall(claim.job_id, claim.exec_token, slot, made[slot], made[slot],
                                  [PAYLOAD]))  # fmt: skip
            gaps[bucket] = gaps.get(bucket, 0) + 1  # (a worker keeps them until its beat)
        if calls:
            t0 = time.perf_counter()
            store.steps(calls)
            out.append(time.perf_counter() - t0)
            tokens[0] += len(calls)
        for slot in [s for s, n in made.items() if n >= JOB_TOKENS and s in running]:
            claim = running.pop(slot)
            if gaps:  # (a worker writes its latencies before a job's end)
                store.telemetry.observe_many("inter_token_ms", gaps,
                                             sum(gaps.values()) * period * 1000)  # fmt: skip
                gaps.clear()
            store.finish(claim.job_id, claim.exec_token, slot, JobState.FINISHED,
                         {"finish_reason": "length"}, made[slot] + 1, ["[DONE]"],
                         time.time())  # fmt: skip
            readers.unsubscribe(settings.keys.channel(claim.job_id))
        # The clients: what pub/sub delivered, and a keep-alive's look at each job.
        while readers.get_message(timeout=0) is not None:
            pass
        if time.monotonic() >= next_keepalive:
            next_keepalive += 15
            for claim in running.values():
                store.ending(claim.job_id)
        step_at += period
        time.sleep(max(0.0, step_at - time.monotonic()))
    for slot in slots:
        store.workers.retire(slot)


def _process(url: str, prefix: str, names: list[str], seqs: int, rate: float, until: float,
             results: Any) -> None:  # fmt: skip
    latencies: list[float] = []
    tokens = [0]
    threads = [
        threading.Thread(
            target=_worker, args=(n, url, prefix, seqs, rate, until, latencies, tokens)
        )
        for n in names
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((latencies, tokens[0]))


def _cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def run_fleet(url: str, workers: int, seqs: int, rate: float, seconds: float,
              procs: int) -> dict[str, Any]:  # fmt: skip
    r = redis.Redis.from_url(url)
    r.flushall()
    prefix = f"fleet{workers}"
    settings = load_settings(redis_url=url, key_prefix=prefix, queue_name=prefix,
                             max_queue=10**7)  # fmt: skip
    store = Store(r, settings)
    # Enough jobs for every sequence's every job during the run.
    _fill_queue(store, int(workers * seqs * (seconds * rate / JOB_TOKENS + 2)), 0)
    r.config_resetstat()
    cpu0, t0 = _cpu(r), time.monotonic()
    until = time.monotonic() + seconds
    results: Any = mp.Queue()
    names = [f"sim{w}" for w in range(workers)]
    groups = [names[i::procs] for i in range(procs) if names[i::procs]]
    children = [mp.Process(target=_process, args=(url, prefix, g, seqs, rate, until, results))
                for g in groups]  # fmt: skip
    for c in children:
        c.start()
    latencies: list[float] = []
    tokens = 0
    for _ in children:
        got, n = results.get(timeout=seconds + 120)
        latencies += got
        tokens += n
    for c in children:
        c.join()
    wall = time.monotonic() - t0
    cpu = (_cpu(r) - cpu0) / wall
    stats = r.info("commandstats")
    total = sum(float(v["usec"]) for v in stats.values()) or 1.0
    top = sorted(stats.items(), key=lambda kv: -float(kv[1]["usec"]))[:6]
    ms = sorted(1000 * x for x in latencies) or [0.0]
    return {
        "workers": workers,
        "sequences": workers * seqs,
        "tokens_per_second_asked": workers * seqs * rate,
        "tokens_per_second_written": round(tokens / wall),
        "step_write_p50_ms": round(statistics.median(ms), 2),
        "step_write_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "redis_cpu_seconds_per_second": round(cpu, 2),
        "redis_ops_per_second": round(sum(int(v["calls"]) for v in stats.values()) / wall),
        "redis_time_by_command": {
            name.removeprefix("cmdstat_"): f"{100 * float(v['usec']) / total:.0f}%"
            for name, v in top
        },
    }


def main() -> None:
    ap = command_line(__doc__, "fleet", model="none (Redis only)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per worker")
    ap.add_argument("--rate", type=float, default=30.0, help="tokens per second per sequence")
    ap.add_argument("--fleets", default="1,2,4,8,16,32,64", help="worker counts to try")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds per fleet size")
    ap.add_argument("--procs", type=int, default=2, help="load-generator processes")
    args = ap.parse_args()
    random.seed(0)
    work = tempfile.mkdtemp(prefix="parkq-fleet-")
    port = free_port()
    proc = redis_server(work, port, "--maxclients", "20000")
    url = f"redis://127.0.0.1:{port}/0"
    rows = []
    try:
        for w in (int(x) for x in args.fleets.split(",")):
            row = run_fleet(url, w, args.seqs, args.rate, args.seconds, args.procs)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["step_write_p99_ms"] > 5 or row["redis_cpu_seconds_per_second"] > 0.9:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs",
        "seqs_per_worker": args.seqs,
        "tokens_per_second_per_seq": args.rate,
        "seconds_per_size": args.seconds,
        "load_processes": args.procs,
        "fleets": rows,
        "command": "python -m tools.bench.fleet " + " ".join(sys.argv[1:]),
    }
    write_results(args.out, results)


if __name__ == "__main__":
    main()
