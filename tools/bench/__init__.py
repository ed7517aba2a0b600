"""Every benchmark: `parkq bench` (the mixed workload against its peers:
workload.py, modes.py, report.py, llama_server.py) and the scripts that print
their figures and write JSON (``python -m tools.bench.<name>``: pipeline,
parking, throughput, conversation, concurrency, structured, memory, streams,
durable, fleet). Not tests."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jobs.engine.llama import LlamaEngine


#: The sampling arms: each system's request fields for it. ``default`` is what
#: the openai client sends when told nothing (no temperature, no top_p: parkq's
#: defaults, 1.0 and 1.0); llama-server is asked for the same distribution
#: (its own defaults add top_k 40 and min_p 0.05).
SAMPLING: dict[str, dict[str, dict[str, Any]]] = {
    "greedy": {
        "parkq": {"temperature": 0},
        "llama-server": {"temperature": 0, "repeat_penalty": 1.0},
    },
    "default": {
        "parkq": {},
        "llama-server": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
        },
    },
}


def model_and_chat_format(path: str | None) -> tuple[str, str | None]:
    """The model to measure: ``path``, or the demo model (assembled once)."""
    if path is not None:
        return path, None
    from jobs.engine.demo_model import DEMO_CHAT_FORMAT, assemble_demo_model, demo_model_target

    target = demo_model_target(None)
    return str(target if target.exists() else assemble_demo_model(target)), DEMO_CHAT_FORMAT


def greedy_decode(engine: LlamaEngine, prompt: str, tokens: int) -> float:
    """Seconds for parkq's engine alone (no Redis, no HTTP) to decode ``tokens``
    greedy tokens after ``prompt``: the decode loop the worker runs."""
    ids = engine.tokenize(prompt)
    logits, pos = engine.eval(ids, 0), len(ids)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = engine.eval([int(np.argmax(logits))], pos)
        pos += 1
    return time.perf_counter() - t0


def command_line(
    doc: str | None, name: str, model: str = "the demo model"
) -> argparse.ArgumentParser:
    """A benchmark's options: ``--model`` (default: ``model``) and ``--out``
    (``bench-results/<name>.json``); the benchmark adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help=f"GGUF path (default: {model})")
    ap.add_argument("--out", default=f"bench-results/{name}.json")
    return ap


def write_results(path: str, results: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def redis_server(workdir: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """A `redis-server` on loopback ``port`` (no snapshots; ``extra`` options),
    answering once this returns."""
    import redis

    from tools.launcher import embedded_redis_server

    binary = shutil.which("redis-server") or embedded_redis_server()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                             "--save", "", "--logfile", os.path.join(workdir, f"{port}.log"),
                             *extra])  # fmt: skip
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def scratch_redis(name: str, *extra: str) -> Iterator[str]:
    """A :func:`redis_server` of its own in a temporary folder, for a Redis-only
    benchmark: its URL; stopped and removed on exit."""
    from tools.launcher import free_port

    work = tempfile.mkdtemp(prefix=f"parkq-{name}-")
    port = free_port()
    proc = redis_server(work, port, *extra)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(work, ignore_errors=True)


def machine() -> str:
    """This machine in a benchmark's results: its processor and usable CPUs."""
    return f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
