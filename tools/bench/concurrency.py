"""Many people at once: k simultaneous interactive streams, for each PARKQ_MAX_SEQS,
greedy and with the openai client's default sampling, beside llama.cpp's own server.

    python -m tools.bench.concurrency [--model PATH] [--seqs 1,default] [--clients 1,2,4,8]
                                     [--tokens 64] [--threads N] [--n-ctx N]
                                     [--sampling greedy,default] [--peer-server PATH]
                                     [--routes completions,responses]

For each sequence count (``default``: unset, what parkq chooses on this
machine), starts `parkq up` (embedded Redis, web, one worker) on the model
(default: the demo model), warms it, then for each sampling arm and client
count sends that many completions at the same moment (each burst's prompts
new ones, so that no server evaluates less of them from a cache) and records
when each token arrives (``--routes responses``: also the same prompts as streamed
responses of the Responses API, rows ``parkq responses``; through the chat
template, so their prompts are a few tokens longer). Each round sends the
same burst to ``llama-server`` too (``--peer-server``, default the one
``python -m tools.bench.llama_server build`` cached; ``none`` to skip),
started before parkq and idle while parkq answers, with ``-np`` equal to the
largest sequence count, the same threads, context per sequence and kernel
path, asked for the same distributions: a machine whose speed drifts moves
both sides of each comparison alike. ``--exact-off``: a second parkq stack,
PARKQ_EXACT=0, idle likewise, gets each round's burst too (what exactness
costs, paired the same way). A round's bursts go one after the other, each
followed by the same rest, in one order in even rounds and the reverse in odd
ones. Prints, per cell: failed
requests, TTFT p50 / p95 / max over the answered ones, inter-token p95, the
aggregate tokens per second (all tokens over the wall time from the first
request to the last ``[DONE]``), each the median of ``--repeat`` bursts (3; the
cells interleaved, so a machine whose speed drifts spreads it over all of them)
and, for parkq, where the worker's busy time went
(``parkq_step_seconds_total``: engine, sampling, Redis, other); writes them as
JSON.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import threading
import time
from typing import Any, TypeVar

import requests

from jobs.engine.llama import gpu_layers
from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, write_results
from tools.bench.llama_server import llama_server_path, running_llama_server
from tools.bench.workload import Request, stream, stream_response
from tools.client import percentile

#: Bursts so far in this process (each one's prompts are its own).
ROUNDS = itertools.count()


def burst(
    base_url: str,
    clients: int,
    tokens: int,
    sampling: dict[str, Any] | None = None,
    route: str = "completions",
) -> dict[str, Any]:
    """``clients`` simultaneous streamed completions of ``tokens`` tokens (each
    with its own seed; ``route`` ``responses``: the same prompts as responses of
    the Responses API); TTFT, inter-token and aggregate figures."""
    url = f"{base_url}/v1/{route}"
    reqs = [Request("short", 0.0) for _ in range(clients)]
    fields = SAMPLING["greedy"]["parkq"] if sampling is None else sampling
    # Every prompt differs from the last nine bursts' from its first token on
    # (the round's number, last digit first: one token per digit, a new first
    # digit in each burst, one length for all), so that neither server
    # evaluates less of it from a cache: llama-server keeps each slot's last
    # prompt and evaluates only what follows the part a new prompt shares with
    # it (a repeated 13-token prompt: 5 tokens evaluated).
    round_ = next(ROUNDS)
    bodies = [
        {"prompt": f"{str(round_).zfill(5)[::-1]}. Question {i}: what is a parking "
                   "queue?\nAnswer:",
         "max_tokens": tokens,
         "ignore_eos": True, "priority": "interactive", "seed": i,
         "stream_options": {"include_usage": True}, **fields}
        for i in range(clients)
    ]  # fmt: skip
    if route == "responses":
        bodies = [{"input": b["prompt"], "max_output_tokens": tokens, "ignore_eos": True,
                   "priority": "interactive", "seed": b["seed"], **fields}
                  for b in bodies]  # fmt: skip
    read = stream_response if route == "responses" else stream

    def one(body: dict[str, Any], req: Request) -> None:
        with contextlib.suppress(requests.RequestException):  # no end: counted as failed
            read(url, body, req)

    threads = [threading.Thread(target=one, args=(b, r)) for b, r in zip(bodies, reqs, strict=True)]
    t0 = time.monotonic()
    for r in reqs:
        r.sent = t0
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r.end or t0 for r in reqs) - t0
    # A request whose stream did not end with [DONE] failed: counted as such,
    # never as a fast one. Tokens as the server's usage counts them (a text
    # piece can hold several tokens: a character of several byte tokens).
    answered = [r for r in reqs if r.done and r.ttft is not None]
    ttft = [1000 * r.ttft for r in answered if r.ttft is not None]
    gaps = [1000 * (b - a) for r in answered for a, b in zip(r.tokens, r.tokens[1:], strict=False)]
    n = sum(r.completion_tokens if r.completion_tokens is not None else len(r.tokens)
            for r in reqs)  # fmt: skip

    def ms(q: float | None) -> float | None:
        return None if q is None else round(q, 1)

    return {
        "clients": clients,
        "failed": clients - len(answered),
        "ttft_ms_p50": ms(statistics.median(ttft)) if ttft else None,
        "ttft_ms_p95": ms(percentile(ttft, 95)),
        "ttft_ms_max": ms(max(ttft)) if ttft else None,
        "inter_token_ms_p95": ms(percentile(gaps, 95)),
        "aggregate_tok_s": round(n / wall, 1),
        "tokens": n,
    }


A = TypeVar("A")


def rounds(repeat: int, arms: list[A], clients: list[int]) -> list[tuple[int, A, int]]:
    """Every (round, arm, clients) cell, the arms and client counts interleaved in
    each round: a machine whose speed drifts spreads the drift over all cells."""
    return [(r, a, c) for r in range(repeat) for a in arms for c in clients]


def _system(route: str) -> str:
    """A parkq row's name: ``parkq``, or ``parkq responses`` for the Responses API."""
    return "parkq" if route == "completions" else f"parkq {route}"


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's runs: the median of each figure (failures summed), every run kept."""
    out: dict[str, Any] = {"clients": runs[0]["clients"], "repeats": len(runs)}
    for key in ("ttft_ms_p50", "ttft_ms_p95", "ttft_ms_max", "inter_token_ms_p95",
                "aggregate_tok_s"):  # fmt: skip
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    out["failed"] = sum(r["failed"] for r in runs)
    out["tokens"] = sum(r["tokens"] for r in runs)
    splits = [r["step_split_pct"] for r in runs if r.get("step_split_pct")]
    if splits:
        out["step_split_pct"] = {p: round(statistics.median(s[p] for s in splits), 1)
                                 for p in splits[0]}  # fmt: skip
    out["runs"] = runs
    return out


def counters(redis_url: str, settings: Any) -> dict[str, float]:
    """The fleet's counters (jobs/store/telemetry.py) of the stack at ``redis_url``."""
    import redis as redis_lib

    from jobs.store.scheduling import Store

    client = redis_lib.Redis.from_url(redis_url)
    try:
        return Store(client, settings).telemetry.counters()
    finally:
        client.close()


def step_split(redis_url: str, settings: Any, before: dict[str, float]) -> dict[str, float]:
    """The share of each part of the workers' busy time since ``before`` (the
    counters read then), after the next heartbeat has flushed them."""
    from jobs.worker.stepclock import PARTS

    time.sleep(settings.heartbeat_seconds + 0.3)
    now = counters(redis_url, settings)
    spent = {p: now.get(f"step_seconds:{p}", 0.0) - before.get(f"step_seconds:{p}", 0.0)
             for p in PARTS}  # fmt: skip
    total = sum(spent.values()) or 1.0
    return {p: round(100 * v / total, 1) for p, v in spent.items()}


def _peer_binary(given: str | None) -> str | None:
    if given == "none":
        return None
    if given:
        return given
    cached = llama_server_path()
    if cached.exists():
        return str(cached)
    print(f"no llama-server at {cached} (python -m tools.bench.llama_server build): no peer")
    return None


def _demo_model() -> str:
    from jobs.engine.demo_model import assemble_demo_model, demo_model_target

    target = demo_model_target(None)
    return str(target if target.exists() else assemble_demo_model(target))


def main() -> None:
    ap = command_line(__doc__, "concurrency")
    ap.add_argument(
        "--seqs",
        default="1,default",
        help="PARKQ_MAX_SEQS values to compare; default: unset (what parkq chooses)",
    )
    ap.add_argument("--n-ctx", type=int, help="PARKQ_N_CTX (default: parkq's, 4096)")
    ap.add_argument("--clients", default="1,2,4,8", help="simultaneous streams")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3,
                    help="bursts per cell, interleaved; the table shows medians")  # fmt: skip
    ap.add_argument("--threads", type=int, help="llama.cpp threads (default: PARKQ_N_THREADS)")
    ap.add_argument("--peer-server", help="llama-server binary (default: the cached build)")
    ap.add_argument("--sampling", default="greedy,default",
                    help="arms: greedy, default (the openai client's: temperature 1)")  # fmt: skip
    ap.add_argument("--exact-off", action="store_true",
                    help="also a second stack with PARKQ_EXACT=0, each burst sent to it "
                    "in each round beside parkq's defaults (rows 'parkq EXACT=0')")  # fmt: skip
    ap.add_argument("--routes", default="completions",
                    help="parkq's routes to send the bursts to: completions, responses "
                    "(the Responses API: its cost per token beside completions')")  # fmt: skip
    args = ap.parse_args()

    from jobs.engine.kernels import worker_attention, worker_kernels
    from tools.launcher import Stack

    clients_list = [int(x) for x in args.clients.split(",")]
    routes = [r for r in args.routes.split(",") if r]
    if set(routes) - {"completions", "responses"}:
        ap.error("--routes takes completions, responses")
    arms = [a for a in args.sampling.split(",") if a]
    unknown = [a for a in arms if a not in SAMPLING]
    if unknown:
        ap.error(f"--sampling takes {', '.join(SAMPLING)}, not {', '.join(unknown)}")
    from jobs.engine.capacity import sequence_plan

    # "default": PARKQ_MAX_SEQS unset, what `parkq up` chooses here.
    seqs_list = [None if x == "default" else int(x) for x in args.seqs.split(",")]
    rows = []
    plans: list[tuple[str, Any]] = []
    for seqs in seqs_list:
        overrides: dict[str, Any] = {"port": 0, "log_level": "WARNING", "max_seqs": seqs}
        overrides["model"] = args.model or _demo_model()
        if not args.model:  # a base model: chat (the Responses API) needs its format
            from jobs.engine.demo_model import DEMO_CHAT_FORMAT

            overrides["chat_format"] = DEMO_CHAT_FORMAT
        if args.threads:
            overrides["n_threads"] = args.threads
        if args.n_ctx:
            overrides["n_ctx"] = args.n_ctx
        settings = load_settings(**overrides)
        plan = sequence_plan(settings)
        chosen = plan.max_seqs
        # The worker gets what was planned here (it would plan the same, unless
        # the free memory moved in between).
        settings = settings.model_copy(update={"max_seqs": chosen, "parked_seqs": plan.parked_seqs})
        plans.append((f"{chosen}" if seqs is not None else f"default ({chosen})", settings))
    most = max(s.max_seqs or 1 for _, s in plans)
    peer = _peer_binary(args.peer_server)
    peer_runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as held:
        base = None
        if peer is not None:
            # Started first and left idle while parkq answers (and parkq idle
            # while it answers): each round sends its burst to both, one after
            # the other, so a machine whose speed drifts (a shared VM) moves
            # both sides of every comparison alike.
            settings = settings.model_copy(update={"max_seqs": most})
            extra = worker_kernels(settings)
            threads = settings.n_threads or len(os.sched_getaffinity(0))
            layers = gpu_layers(settings.n_gpu_layers)
            base = held.enter_context(running_llama_server(
                peer, model=settings.model or "", seqs=most, n_ctx=settings.n_ctx,
                threads=threads, extra_buffers=extra.extra_buffers, gpu_layers=layers,
                flash_attn=worker_attention(settings)))  # fmt: skip
            burst(base, 1, 8)  # warm
        for label, settings in plans:
            with contextlib.ExitStack() as stacks:
                stack = stacks.enter_context(Stack(settings))
                burst(stack.base_url, 1, 8)  # warm: the model's pages, the first prefill
                fast = None
                if args.exact_off and settings.exact:
                    fast = stacks.enter_context(Stack(settings.model_copy(update={"exact": False})))
                    burst(fast.base_url, 1, 8)
                runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
                cells = [(arm, route) for arm in arms for route in routes]
                for n, (arm, route), clients in rounds(args.repeat, cells, clients_list):
                    fields = SAMPLING[arm]["parkq"]
                    # Each system's burst, then the same rest (the heartbeat the
                    # step split waits for); the order is reversed in odd rounds,
                    # so that neither parkq nor the peer always goes first.
                    turns: list[tuple[Stack | None, str]] = [(stack, route)]
                    if fast is not None:
                        turns.append((fast, route + " EXACT=0"))
                    if base is not None and route == routes[0]:
                        turns.append((None, "llama-server"))
                    for which, key in turns if n % 2 == 0 else turns[::-1]:
                        if which is None:
                            assert base is not None
                            run = burst(base, clients, args.tokens, SAMPLING[arm]["llama-server"])
                            peer_runs.setdefault((arm, clients), []).append(run)
                            print({"system": "llama-server", "sampling": arm, **run}, flush=True)
                            time.sleep(stack.settings.heartbeat_seconds + 0.3)
                            continue
                        s_url = which.settings.redis_url or ""
                        before = counters(s_url, which.settings)
                        run = burst(which.base_url, clients, args.tokens, fields, route)
                        run["step_split_pct"] = step_split(s_url, which.settings, before)
                        runs.setdefault((arm, key, clients), []).append(run)
                        system = _system(route) + key.removeprefix(route)
                        print({"system": system, "max_seqs": label, "sampling": arm, **run},
                              flush=True)  # fmt: skip
                for (arm, route, _n), got in runs.items():
                    name = route.removesuffix(" EXACT=0")
                    system = _system(name) + (" EXACT=0" if name != route else "")
                    rows.append({"system": system, "max_seqs": label, "sampling": arm,
                                 **median_row(got)})  # fmt: skip
    for (arm, _n), got in peer_runs.items():
        rows.append({"system": "llama-server", "max_seqs": most, "sampling": arm,
                     **median_row(got)})  # fmt: skip
    print(f"\n{'system':>22} {'seqs':>11} {'sampling':>8} {'clients':>7} {'failed':>6} "
          f"{'TTFT p50':>9} {'p95':>8} {'max':>8} {'ITL p95':>8} {'tok/s':>7}  "
          "step: engine/sampling/redis/other %")  # fmt: skip
    for r in rows:
        split = r.get("step_split_pct")
        cells = [r["system"], r["max_seqs"], r["sampling"], r["clients"], r["failed"],
                 r["ttft_ms_p50"], r["ttft_ms_p95"], r["ttft_ms_max"], r["inter_token_ms_p95"],
                 r["aggregate_tok_s"]]  # fmt: skip
        widths = (22, 11, 8, 7, 6, 9, 8, 8, 8, 7)
        line = " ".join(f"{c!s:>{w}}" for c, w in zip(cells, widths, strict=True))
        if split:
            line += "  " + "/".join(f"{split[p]:.0f}" for p in split)
        print(line)
    write_results(args.out, {"model": settings.model, "threads": settings.n_threads,
                             "tokens": args.tokens, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
