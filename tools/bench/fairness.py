"""Tenants' fair turns at scale, against a running parkq (issue 36).

    python -m tools.bench.fairness [--model PATH] [--lines 2000] [--small 20]
        [--seconds 60] [--clients 8] [--seqs 2] [--out FILE.json]

Starts `parkq up` (embedded Redis, web, one worker of ``--seqs`` sequences) on
``--model`` (default: the tiny generated test model, so the scheduler, not the
engine, is what is measured) with a keys file of four tenants, then:

- **batches**: one tenant's batch of ``--lines`` lines, and once 50 of them
  have run another's of ``--small`` lines at the same level (each line two
  tokens): how many of the large batch's lines started while the small one
  ran (first come, first served: all of the large one's left; by turns:
  about as many as the small one has), and each batch's wall time;
- **weights**: two tenants of weights 2 and 1, each keeping ``--clients``
  requests in flight (more than the worker's sequences, so both always have
  jobs waiting) for ``--seconds``, once with greedy sampling and once with the
  openai client's defaults: each tenant's completion tokens of the requests
  that ended in the window, and their ratio (2 is the weights');
- **capped**: a tenant capped at one running job (``max_running = 1``) keeps
  ``--clients`` interactive requests in flight, so its waiting ones hold the
  queue's head, which no free sequence may take, while another tenant keeps
  two batch-priority requests running beside it (the worker's other
  sequences free), each request 256 tokens, for ``--seconds`` / 2, greedy and
  with the openai client's defaults: Redis commands and Redis CPU time per
  generated token (INFO's total_commands_processed and used_cpu_sys +
  used_cpu_user: every process's calls), each tenant's tokens, and the jobs
  waiting and running on average (read every 0.1 s).

``--parts`` picks some of them (default: all three).
"""

from __future__ import annotations

import io
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai
import requests

from scheduler.settings import load_settings
from tools.bench import command_line, machine, write_results
from tools.launcher import Stack

BIG, SMALL, HEAVY, LIGHT, ADMIN = "sk-big", "sk-small", "sk-heavy", "sk-light", "sk-admin"
CAPPED = "sk-capped"
KEYS = f"""
[tenants.big]
keys = ["{BIG}"]
[tenants.small]
keys = ["{SMALL}"]
[tenants.heavy]
keys = ["{HEAVY}"]
weight = 2
[tenants.light]
keys = ["{LIGHT}"]
[tenants.capped]
keys = ["{CAPPED}"]
max_running = 1
[tenants.admin]
keys = ["{ADMIN}"]
admin = true
"""


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600)


def _jobs(base: str, ids: list[str]) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with requests.Session() as s:
        return [s.get(f"{base}/v1/jobs/{i}", headers=headers, timeout=30).json() for i in ids]


def batches(base: str, lines: int, small: int) -> dict[str, Any]:
    made = {}
    for key, n in ((BIG, lines), (SMALL, small)):
        client = _client(base, key)
        rows = [{"custom_id": f"{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "m", "prompt": "Turns", "max_tokens": 2}}
                for i in range(n)]  # fmt: skip
        content = "".join(json.dumps(r) + "\n" for r in rows).encode()
        up = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        made[key] = client, client.batches.create(input_file_id=up.id, endpoint="/v1/completions",
                                                  completion_window="24h").id  # fmt: skip
        if key == BIG:  # the small one comes while the large one runs
            while (got := client.batches.retrieve(made[key][1])).status == "validating" or (
                got.request_counts is None or got.request_counts.completed < 50
            ):
                time.sleep(0.2)
    records: dict[str, list[dict[str, Any]]] = {}
    for key, (client, batch_id) in made.items():
        while (batch := client.batches.retrieve(batch_id)).status != "completed":
            if batch.status not in ("validating", "in_progress", "finalizing"):
                raise RuntimeError(f"batch {batch_id} ended {batch.status}")
            time.sleep(0.5)
        assert batch.output_file_id is not None
        out = client.files.content(batch.output_file_id).text.splitlines()
        records[key] = _jobs(base, [json.loads(x)["response"]["request_id"] for x in out])
    little = records[SMALL]
    start = min(j["started_at"] for j in little)
    end = max(j["finished_at"] for j in little)
    meanwhile = sum(start <= j["started_at"] < end for j in records[BIG])

    def wall(js: list[dict[str, Any]]) -> float:
        return round(
            float(max(j["finished_at"] for j in js)) - float(min(j["created_at"] for j in js)), 2
        )

    return {"lines": lines, "small": small, "big_lines_started_while_small_ran": meanwhile,
            "small_wall_s": wall(little), "big_wall_s": wall(records[BIG])}  # fmt: skip


def weights(base: str, seconds: float, clients: int, greedy: bool) -> dict[str, Any]:
    stop = time.monotonic() + seconds
    done: dict[str, list[tuple[float, float, int]]] = {HEAVY: [], LIGHT: []}
    extra: dict[str, Any] = {"temperature": 0} if greedy else {}

    def loop(key: str) -> None:
        client = _client(base, key)
        while time.monotonic() < stop:
            t0 = time.time()
            got = client.completions.create(model="m", prompt="Share", max_tokens=32,
                                            extra_body={"ignore_eos": True}, **extra)  # fmt: skip
            assert got.usage is not None
            done[key].append((t0, time.time(), got.usage.completion_tokens))

    threads = [threading.Thread(target=loop, args=(k,)) for k in done for _ in range(clients)]
    begin = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The window: from when both had a full queue (the first few seconds fill
    # it) to when the first client stopped sending.
    lo, hi = begin + min(5.0, seconds / 6), begin + seconds
    tokens = {k: sum(n for s, e, n in v if lo <= e <= hi) for k, v in done.items()}
    return {"sampling": "greedy" if greedy else "default", "seconds": seconds,
            "clients_per_tenant": clients, "window_s": round(hi - lo, 1),
            "tokens_heavy": tokens[HEAVY], "tokens_light": tokens[LIGHT],
            "ratio": round(tokens[HEAVY] / max(1, tokens[LIGHT]), 3)}  # fmt: skip


def capped(base: str, settings: Any, seconds: float, clients: int, greedy: bool) -> dict[str, Any]:
    import redis

    from jobs.store.scheduling import Store

    stop = time.monotonic() + seconds
    done: dict[str, list[int]] = {CAPPED: [], BIG: []}
    extra: dict[str, Any] = {"temperature": 0} if greedy else {}

    def loop(key: str, priority: str) -> None:
        client = _client(base, key)
        while time.monotonic() < stop:
            got = client.completions.create(
                model="m", prompt="Capped", max_tokens=256,
                extra_body={"ignore_eos": True, "priority": priority}, **extra,
            )  # fmt: skip
            assert got.usage is not None
            done[key].append(got.usage.completion_tokens)

    threads = [threading.Thread(target=loop, args=(CAPPED, "interactive")) for _ in range(clients)]
    threads += [threading.Thread(target=loop, args=(BIG, "batch")) for _ in range(2)]
    r = redis.Redis.from_url(settings.redis_url or "")
    keys = Store(r, settings).keys
    # What the run held: jobs waiting and running, read every 0.1 s.
    seen: list[tuple[int, int]] = []

    def watch() -> None:
        while time.monotonic() < stop:
            with r.pipeline(transaction=False) as p:
                p.zcard(keys.queue)
                p.zcard(keys.running)
                queued, running = p.execute()
            seen.append((int(queued), int(running)))
            time.sleep(0.1)

    def used() -> tuple[int, float]:
        info = r.info()
        return int(info["total_commands_processed"]), info["used_cpu_sys"] + info["used_cpu_user"]

    threads.append(threading.Thread(target=watch))
    before, cpu_before = used()
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    after, cpu_after = used()
    commands = after - before - 2 * len(seen)  # (not the watch's own)
    cpu = cpu_after - cpu_before
    r.close()
    tokens = {k: sum(v) for k, v in done.items()}
    total = sum(tokens.values())
    return {"sampling": "greedy" if greedy else "default", "seconds": round(wall, 1),
            "capped_clients": clients, "tokens_capped": tokens[CAPPED],
            "tokens_other": tokens[BIG], "tok_s": round(total / wall, 1),
            "redis_commands_per_token": round(commands / max(1, total), 2),
            "redis_cpu_us_per_token": round(1e6 * cpu / max(1, total), 1),
            "redis_cpu_pct": round(100 * cpu / wall, 1),
            "waiting_mean": round(sum(q for q, _ in seen) / max(1, len(seen)), 2),
            "running_mean": round(sum(n for _, n in seen) / max(1, len(seen)), 2)}  # fmt: skip


def main() -> None:
    ap = command_line(__doc__, "fairness", model="the tiny test model")
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--small", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--parts", default="batches,weights,capped")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="parkq-fairness-"))
    keys = work / "keys.toml"
    keys.write_text(KEYS)
    model = args.model
    if model is None:
        from jobs.engine.testmodel import write_test_model

        model = str(write_test_model(work / "tiny.gguf"))
    settings = load_settings(model=model, port=0, log_level="WARNING", max_seqs=args.seqs,
                             keys_file=str(keys), n_ctx=1024)  # fmt: skip
    results: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                               "model": Path(model).name, "max_seqs": args.seqs}  # fmt: skip
    with Stack(settings) as stack:
        if "batches" in parts:
            results["batches"] = batches(stack.base_url, args.lines, args.small)
            print(json.dumps(results["batches"]), flush=True)
        for part in ("weights", "capped"):
            if part not in parts:
                continue
            results[part] = []
            for greedy in (True, False):
                if part == "weights":
                    row = weights(stack.base_url, args.seconds, args.clients, greedy)
                else:
                    row = capped(stack.base_url, stack.settings, args.seconds / 2,
                                 args.clients, greedy)  # fmt: skip
                print(json.dumps(row), flush=True)
                results[part].append(row)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
