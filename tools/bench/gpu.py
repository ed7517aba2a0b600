"""The GPU check: what parkq's promises and speed are on the engine's backend,
measured in one run that fits one call of a lent GPU machine (docs/gpu.md).

    python -m tools.bench.gpu --out DIR [--cpu] [--server PATH] [--seconds N]

Sections, in order, each within what is left of ``--seconds`` (a section that
fails is recorded with its error and the next one runs):

- ``environment``: the card (nvidia-smi), llama.cpp's build and devices;
- ``models``: random-weight models of a real shape (``1b``: Llama 3.2 1B's
  shape; ``--cpu``: ``small``) in Q8_0 and Q4_0;
- ``opcheck``: the per-op check (jobs/engine/opcheck.py) of each model on the
  card (``--cpu``: the CPU): each matrix product and the attention at widths up
  to 16 and every KV length up to 4,096, naming the op that changes with the
  width;
- ``probe``: for each batch size up to 16 (``--cpu``: 4), whether every
  sequence decoded in one call gets, bit for bit, the logits it gets alone,
  and where it first differs; the size the worker would take;
- ``park``: saving and restoring one sequence's KV at 500 and 4,000 positions
  (the checkpoint copy), and whether the next logits after the restore are
  bit-identical to those of the uninterrupted run;
- ``step``: one decode call of 1 to 16 sequences, and sampling one token
  over the whole vocabulary (greedy, temperature 1): the engine's and the
  sampler's shares of a step;
- ``concurrency``: 1-16 simultaneous streams, greedy and the openai client's
  default sampling, against ``parkq up`` (PARKQ_MAX_SEQS 1, its default plan, and
  the plan with PARKQ_EXACT=0) and
  ``llama-server`` from the same build with 16 slots, all started first and
  each round's burst sent to each in turn (the order reversed in odd rounds);
- ``mixed``: a long batch job while short chats arrive, parkq against
  ``llama-server`` with the same slots, both sampling arms;
- ``exactness``: parkq's tests that run real llama.cpp (engine, batching,
  parking, quantized models), against this build.

Writes ``gpu-check.json`` and ``gpu-check.md`` into ``--out`` and prints the
Markdown last. ``--cpu`` is the dry run (small model, short runs): CI runs it so
the check cannot rot between the sessions that have a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Check", "main", "markdown"]

#: Seconds each section may take at most, as a share of the check's total.
SHARES = {
    "environment": 0.02,
    "models": 0.06,
    "opcheck": 0.06,
    "probe": 0.12,
    "park": 0.06,
    "step": 0.05,
    "concurrency": 0.29,
    "mixed": 0.22,
    "exactness": 1.0,  # the last: whatever is left
}


@dataclass
class Check:
    out: Path
    cpu: bool
    server: str | None
    deadline: float
    work: Path
    shape: str = "1b"
    clients: list[int] | None = None
    mixed_seconds: float | None = None
    tests: list[str] | None = None
    results: dict[str, Any] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def limit(self) -> int:
        """The most sequences one engine runs in this check."""
        return 4 if self.cpu else 16


def _run(cmd: list[str], timeout: float = 30) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({exc})"
    return (done.stdout or done.stderr).strip()


def environment(check: Check) -> dict[str, Any]:
    from jobs.engine.llama import build_info, devices

    smi = shutil.which("nvidia-smi")
    fields = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    return {
        "gpu": _run([smi, f"--query-gpu={fields}", "--format=csv,noheader"]) if smi else None,
        "llama_cpp": build_info(),
        "devices": [d.describe() + f" [{d.kind}]" for d in devices()],
        "python": sys.version.split()[0],
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "parkq_commit": _run(["git", "rev-parse", "--short", "HEAD"]) or None,
        "llama_cpp_python": metadata.version("llama-cpp-python"),
    }


def models(check: Check) -> dict[str, Any]:
    from jobs.engine.testmodel import write_shaped_model

    shape = check.shape
    out: dict[str, Any] = {"shape": shape}
    for quant in ("q8_0", "q4_0"):
        t0 = time.perf_counter()
        path = write_shaped_model(check.work / f"{shape}-{quant}.gguf", shape, quant)
        check.models[quant] = str(path)
        out[quant] = {"bytes": path.stat().st_size, "write_s": round(time.perf_counter() - t0, 1)}
    return out


def _engine(model: str, seqs: int, n_ctx: int, flash_attn: bool = False) -> Any:
    from jobs.engine.llama import LlamaEngine

    return LlamaEngine(model, n_ctx=n_ctx, n_batch=256, n_seq_max=seqs, extra_buffers=False,
                       flash_attn=flash_attn)  # fmt: skip


#: The CUDA build's switch an exact worker sets (jobs.engine.kernels.keep_cuda_invariant).
CUDA_SWITCH = "GGML_CUDA_BATCH_INVARIANT"


def opcheck(check: Check) -> dict[str, Any]:
    """The per-op check in a child per model, on the card (the CPU with ``--cpu``).
    On a card: with flash attention and CUDA's batch-invariant switch on, as an
    exact worker runs it, and for the first model once more with the switch off
    (stock llama.cpp's choices by width and KV length: what the switch changes)."""
    out: dict[str, Any] = {}
    arms: list[tuple[str, str, dict[str, str]]] = []
    for i, (quant, model) in enumerate(check.models.items()):
        if check.cpu:
            arms.append((quant, model, {}))
            continue
        arms.append((quant, model, {CUDA_SWITCH: "1"}))
        if i == 0:
            arms.append((f"{quant}, {CUDA_SWITCH}=0", model, {CUDA_SWITCH: "0"}))
    for i, (name, model, env) in enumerate(arms):
        if check.left() < 5:
            break
        where = [] if check.cpu else ["--gpu", "--flash-attn"]
        # The attention part's own time: a share of what is left, with room to load.
        seconds = max(2.0, check.left() / (len(arms) - i) - 10)
        cmd = [sys.executable, "-m", "jobs.engine.opcheck", model, "--widths",
               str(check.limit), "--ctx", "4096", "--json", "--seconds", f"{seconds:.0f}",
               *where]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=max(check.left(), 5.0),
                                  env={**os.environ, **env})  # fmt: skip
            out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def probe(check: Check) -> dict[str, Any]:
    """Every batch size, not only up to the first that fails: on CUDA the
    kernels change with the batch width, so a size can fail and a larger pass.
    The worker takes the largest size below the first that fails."""
    from jobs.engine.kernels import keep_attention_unsplit, keep_cuda_invariant

    out: dict[str, Any] = {}
    # As an exact worker runs the card: CUDA's switch on where the build has it
    # (read once, at this process's first CUDA op: the park and step sections
    # after this one run with it too), and flash attention where it is on.
    # Children started after this section do not inherit it (the inexact arms).
    had = os.environ.get(CUDA_SWITCH)
    switch, _ = keep_cuda_invariant(not check.cpu)
    flash = switch and keep_attention_unsplit(True)[0]
    try:
        return _probe(check, out, switch, flash)
    finally:
        if had is None:
            os.environ.pop(CUDA_SWITCH, None)


def _probe(check: Check, out: dict[str, Any], switch: bool, flash: bool) -> dict[str, Any]:
    for quant, model in check.models.items():
        if check.left() < 5:
            break
        t0 = time.perf_counter()
        engine = _engine(model, check.limit, 2048, flash_attn=flash)
        found = engine.probe_invariance(check.limit, seconds=max(check.left() / 4, 5.0),
                                        every_size=True)  # fmt: skip
        sizes: dict[str, Any] = {
            str(size): vars(found.failed[size]) if size in found.failed else "identical"
            for size in range(1, check.limit + 1)
        }
        verdict = found.size
        engine.plan_batching(verdict)
        out[quant] = {
            "device": engine.device,
            "placement": engine.placement(),
            CUDA_SWITCH: switch,
            "flash_attn": flash,
            "positions_checked": found.horizon,
            "sizes": sizes,
            "worker_takes": verdict,
            "worker_splits": engine.splits_described(),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        engine.close()
    return out


def _ms(samples: list[float]) -> float:
    return round(1000 * float(np.median(samples)), 3)


def park(check: Check) -> dict[str, Any]:
    """The checkpoint copy of one sequence (KV out of the device, and back) and
    the exactness of what follows it."""
    engine = _engine(check.models["q8_0"], 1, 4608)
    text = engine.tokenize("parkq parks a long generation for a short one and resumes it. ")
    out: dict[str, Any] = {"device": engine.device}
    for positions in (500, 4000):
        ids = [text[i % len(text)] for i in range(positions)]
        engine.clear(0)
        logits = None
        for start in range(0, positions, engine.n_batch):
            logits = engine.eval(ids[start : start + engine.n_batch], start, 0)
        assert logits is not None
        token = int(np.argmax(logits))
        saves, loads, identical = [], [], True
        size = 0
        for _ in range(5):
            t0 = time.perf_counter()
            data = bytes(engine.save_seq(0))
            t1 = time.perf_counter()
            engine.clear(0)
            engine.load_seq(data, 0)
            t2 = time.perf_counter()
            saves.append(t1 - t0)
            loads.append(t2 - t1)
            size = len(data)
        after = engine.eval([token], positions, 0)
        engine.truncate(positions, 0)
        engine.clear(0)
        for start in range(0, positions, engine.n_batch):
            engine.eval(ids[start : start + engine.n_batch], start, 0)
        uninterrupted = engine.eval([token], positions, 0)
        identical = bool(np.array_equal(after, uninterrupted))
        out[str(positions)] = {
            "bytes": size,
            "save_ms": _ms(saves),
            "load_ms": _ms(loads),
            "next_logits_identical": identical,
        }
    engine.close()
    return out


def step(check: Check) -> dict[str, Any]:
    """A decode call's time by batch size, and the sampler's time per token."""
    from jobs.engine.sampling import SamplingParams, sample

    engine = _engine(check.models["q8_0"], check.limit, 512)
    out: dict[str, Any] = {"device": engine.device, "n_vocab": engine.n_vocab}
    decode: dict[str, float] = {}
    for size in range(1, check.limit + 1):  # every width: CUDA switches kernels by it
        decode[str(size)] = round(1000 * engine._time_step(size, repeat=10), 3)
    out["decode_call_ms"] = decode
    engine.clear(-1)
    logits = engine.eval([max(engine.bos, 0)], 0, 0)
    arms = {"greedy": SamplingParams(temperature=0.0), "temperature_1": SamplingParams()}
    sampling: dict[str, float] = {}
    for name, params in arms.items():
        times = []
        for n in range(20):
            t0 = time.perf_counter()
            sample(logits, params, n)
            times.append(time.perf_counter() - t0)
        sampling[name] = _ms(times)
    out["sample_ms_per_token"] = sampling
    engine.close()
    return out


def _settings(check: Check, seqs: int | None, n_ctx: int = 1024, exact: bool = True) -> Any:
    """The check's settings; ``seqs`` None is parkq's own plan for the machine."""
    from scheduler.settings import load_settings

    return load_settings(
        model=check.models["q8_0"], port=0, log_level="WARNING", n_ctx=n_ctx, max_seqs=seqs,
        extra_buffers="off", cache_dir=str(check.work / "cache"),
        data_dir=str(check.work / "data"), exact=exact,
    )  # fmt: skip


def concurrency(check: Check) -> dict[str, Any]:
    """Simultaneous streams against every system at once: llama-server (the
    peer) and the parkq stacks are all started first and stay idle while
    another answers; each round sends the same burst to each of them, one
    after the other, in one order in even rounds and the reverse in odd ones,
    so that a host whose speed drifts moves every side of a comparison alike
    (tools/bench/concurrency.py pairs its bursts the same way)."""
    from jobs.engine.llama import gpu_layers
    from tools.bench import SAMPLING
    from tools.bench.concurrency import burst
    from tools.bench.llama_server import running_llama_server

    clients = check.clients or ([1, 2] if check.cpu else [1, 2, 4, 8, 16])
    tokens = 16 if check.cpu else 64
    rows: list[dict[str, Any]] = []
    budget_end = time.monotonic() + check.left()
    # (system, max_seqs, base URL, whose sampling fields, client counts)
    turns: list[tuple[str, Any, str, str, list[int]]] = []
    # parkq's default plan is made once, before any system takes memory, and
    # given to both default stacks (each stack's own would see the others'
    # memory gone).
    from jobs.engine.capacity import sequence_plan_elsewhere

    plan = sequence_plan_elsewhere(_settings(check, None))
    planned = {"max_seqs": plan.max_seqs, "parked_seqs": plan.parked_seqs}
    with contextlib.ExitStack() as held:
        if check.server:
            settings = _settings(check, check.limit)
            base = held.enter_context(running_llama_server(
                check.server, model=settings.model, seqs=check.limit, n_ctx=settings.n_ctx,
                threads=len(os.sched_getaffinity(0)), extra_buffers=False,
                gpu_layers=gpu_layers(settings.n_gpu_layers),
            ))  # fmt: skip
            burst(base, 1, 4, SAMPLING["greedy"]["llama-server"])  # warm
            turns.append(("llama-server", check.limit, base, "llama-server", clients))
        # parkq's default plan for the machine (exact); the same plan with
        # PARKQ_EXACT=0 (batches as wide as llama.cpp takes them, not bit-exact
        # across a park); one sequence per call, alone and at the most clients.
        for seqs, exact in ((None, True), (None, False), (1, True)):
            settings = _settings(check, seqs, exact=exact)
            if seqs is None:
                settings = settings.model_copy(update=planned)
            stack = held.enter_context(_stack(check, settings))
            burst(stack.base_url, 1, 4)  # warm
            turns.append(("parkq" if exact else "parkq inexact", seqs or "default",
                          stack.base_url, "parkq",
                          clients if seqs != 1 else sorted({1, clients[-1]})))  # fmt: skip
        cells = [(arm, n) for arm in SAMPLING for n in clients]
        for i, (arm, n) in enumerate(cells):
            if time.monotonic() > budget_end:
                break
            for system, seqs_label, url, whose, counts in turns if i % 2 == 0 else turns[::-1]:
                if n not in counts:
                    continue
                rows.append({"system": system, "max_seqs": seqs_label, "sampling": arm,
                             **burst(url, n, tokens, SAMPLING[arm][whose])})  # fmt: skip
                print(rows[-1], flush=True)
    return {"tokens": tokens, "rows": rows, "peer": check.server or "none (no llama-server)",
            "default_plan": planned,
            "order": "paired: each burst sent to every system in turn, the order reversed "
                     "in odd rounds"}  # fmt: skip


@contextmanager
def _stack(check: Check, settings: Any) -> Iterator[Any]:
    """`parkq up` that must be healthy within the section's time."""
    from tools.launcher import Stack

    stack = Stack(settings)
    try:
        stack.start()
        stack.wait_healthy(timeout=max(10.0, min(check.left(), 180.0)))
        yield stack
    finally:
        stack.stop()


def mixed(check: Check) -> dict[str, Any]:
    from tools.bench import SAMPLING
    from tools.bench.modes import run_llama_server, run_parkq
    from tools.bench.workload import Workload

    seqs = 2 if check.cpu else 4
    duration = check.mixed_seconds or (6.0 if check.cpu else 15.0)
    out: dict[str, Any] = {"max_seqs": seqs}
    for arm, fields in SAMPLING.items():
        workload = Workload(duration=duration, short_rate=1.0, short_tokens=16 if check.cpu
                            else 32, long_tokens=128 if check.cpu else 1024,
                            sampling=fields["parkq"])  # fmt: skip
        settings = _settings(check, seqs, n_ctx=2048)
        parkq, _ = run_parkq(settings, workload)
        out[f"parkq_{arm}"] = _mixed_row(parkq)
        print("mixed", arm, out[f"parkq_{arm}"], flush=True)
        if check.server:
            peer_workload = Workload(**{**workload.to_json(), "sampling": fields["llama-server"]})
            peer, _ = run_llama_server(settings, peer_workload, check.server)
            out[f"llama_server_{arm}"] = _mixed_row(peer)
            print("mixed llama-server", arm, out[f"llama_server_{arm}"], flush=True)
    return out


def _mixed_row(summary: dict[str, Any]) -> dict[str, Any]:
    keep = ("short_ttft_ms", "short_requests", "short_unanswered", "long_tokens_per_s",
            "aggregate_tokens_per_s", "preemptions", "park_ms", "resume_ms")  # fmt: skip
    return {k: summary[k] for k in keep if k in summary}


def exactness(check: Check) -> dict[str, Any]:
    names = check.tests or (["engine"] if check.cpu else ["engine", "batching", "parking",
                                                          "quantized", "opcheck"])  # fmt: skip
    tests = [f"tests/integration/test_{name}.py" for name in names]
    # Another machine's packages may warn where this one's do not: a warning is no failure here.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "120",
           "-rfE", "--tb=short", "-W", "ignore::DeprecationWarning", *tests]  # fmt: skip
    t0 = time.monotonic()
    log = check.out / "gpu-exactness.log"  # the whole pytest output: why a test failed there
    try:
        with log.open("w") as sink:
            rc: int | None = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                            timeout=max(check.left(), 10)).returncode  # fmt: skip
        lines = log.read_text().strip().splitlines()
        tail = lines[-1:] or [""]
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    except subprocess.TimeoutExpired:
        tail, rc, failed = ["(stopped at the check's time limit)"], None, []
    return {"summary": tail[0], "returncode": rc, "failed": failed[:20], "log": log.name,
            "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


SECTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "environment": environment,
    "models": models,
    "opcheck": opcheck,
    "probe": probe,
    "park": park,
    "step": step,
    "concurrency": concurrency,
    "mixed": mixed,
    "exactness": exactness,
}


def run(check: Check, only: list[str] | None = None) -> None:
    total = check.left()
    for name, section in SECTIONS.items():
        if only and name not in only:
            continue
        need_model = name not in ("environment", "models", "exactness")
        if need_model and not check.models:
            check.results[name] = {"skipped": "no model"}
            continue
        left = check.left()
        if left < 5:
            check.results[name] = {"skipped": "out of time"}
            continue
        section_end = time.monotonic() + min(left, max(SHARES[name] * total, 20.0))
        saved, check.deadline = check.deadline, section_end
        t0 = time.monotonic()
        print(f"gpu-check: {name} ({section_end - t0:.0f} s at most)", flush=True)
        try:
            check.results[name] = section(check)
        except Exception as exc:  # a section's failure is a result; the next one runs
            check.results[name] = {"error": f"{type(exc).__name__}: {exc}",
                                   "trace": traceback.format_exc()[-2000:]}  # fmt: skip
        check.results[name]["section_seconds"] = round(time.monotonic() - t0, 1)
        check.deadline = saved
        _write(check)


def _write(check: Check) -> None:
    check.out.mkdir(parents=True, exist_ok=True)
    (check.out / "gpu-check.json").write_text(json.dumps(check.results, indent=2))
    (check.out / "gpu-check.md").write_text(markdown(check.results))


def _round(x: Any) -> Any:
    return round(x, 1) if isinstance(x, float) else x


def _cell(x: Any) -> str:
    return "-" if x is None else str(x)


def markdown(r: dict[str, Any]) -> str:
    """The summary: a few tables a person reads first."""
    lines = ["# parkq GPU check", ""]
    env = r.get("environment", {})
    lines += [f"- GPU: {env.get('gpu')}", f"- devices: {', '.join(env.get('devices', []))}",
              f"- {env.get('llama_cpp')}", f"- parkq {env.get('parkq_commit')}, "
              f"{env.get('cpus')} CPUs, Python {env.get('python')}", ""]  # fmt: skip
    for name, section in r.items():
        if isinstance(section, dict) and ("error" in section or "skipped" in section):
            lines.append(f"- **{name}**: {section.get('error') or section.get('skipped')}")
    for quant, v in r.get("opcheck", {}).items():
        if not isinstance(v, dict) or "ops" not in v:
            continue
        lines += ["", f"## Per-op check, {quant} ({v['device']}, widths 1..{v['widths']}, KV up "
                  f"to {v['n_ctx']})", "", "| op | first width that differs | where |",
                  "|---|---|---|"]  # fmt: skip
        for op in v["ops"]:
            lines.append(f"| {op['name']} | {op['first_differs'] or 'none'} | "
                         f"{op['where'] or '-'} |")  # fmt: skip
        lines += ["", f"Every op agrees up to width {v['size']}."]
    probe_r = r.get("probe", {})
    for quant, p in probe_r.items():
        if not isinstance(p, dict) or "sizes" not in p:
            continue
        how = f", {CUDA_SWITCH}=1" if p.get(CUDA_SWITCH) else ""
        how += ", flash attention" if p.get("flash_attn") else ""
        lines += ["", f"## Batch invariance, {quant} ({p['placement']}{how})", "",
                  "| size | " + " | ".join(p["sizes"]) + " |",
                  "|---|" + "---|" * len(p["sizes"]),
                  "| same logits as alone | " + " | ".join(
                      "yes" if v == "identical" else f"no (pos {v['position']})"
                      for v in p["sizes"].values()) + " |",
                  "", f"The worker takes {p['worker_takes']} per call; splits "
                  f"{p['worker_splits'] or '-'}."]  # fmt: skip
    park_r = r.get("park", {})
    if "500" in park_r:
        lines += ["", "## Checkpoint copy of one sequence", "",
                  "| positions | bytes | save ms | load ms | next logits identical |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for pos in ("500", "4000"):
            p = park_r.get(pos)
            if p:
                lines.append(f"| {pos} | {p['bytes']} | {p['save_ms']} | {p['load_ms']} | "
                             f"{p['next_logits_identical']} |")  # fmt: skip
    st = r.get("step", {})
    if "decode_call_ms" in st:
        lines += ["", "## One step's parts", "",
                  f"- decode call (ms) by sequences: {st['decode_call_ms']}",
                  f"- sampling one token over {st['n_vocab']} logits (ms): "
                  f"{st['sample_ms_per_token']}"]  # fmt: skip
    conc = r.get("concurrency", {})
    if conc.get("rows"):
        # The peer's burst of the same round, for each (sampling, clients).
        peer = {(row["sampling"], row["clients"]): row for row in conc["rows"]
                if row["system"] == "llama-server"}  # fmt: skip
        plan = conc.get("default_plan") or {}
        lines += ["", f"## Simultaneous streams ({conc['tokens']} tokens each; the default "
                  f"plan: {plan.get('max_seqs')} sequences)", "",
                  "| system | seqs | sampling | clients | TTFT p50 | TTFT p95 | ITL p95 | tok/s "
                  "| tok/s vs llama-server |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in sorted(conc["rows"], key=lambda r: (r["system"], str(r["max_seqs"]),
                                                       r["sampling"], r["clients"])):  # fmt: skip
            other = peer.get((row["sampling"], row["clients"]))
            ratio = None
            if other and other is not row and other["aggregate_tok_s"]:
                ratio = f"{row['aggregate_tok_s'] / other['aggregate_tok_s']:.2f}x"
            lines.append(
                f"| {row['system']} | {row['max_seqs']} | {row['sampling']} | {row['clients']} | "
                f"{row['ttft_ms_p50']} | {row['ttft_ms_p95']} | "
                f"{_cell(row['inter_token_ms_p95'])} | {row['aggregate_tok_s']} | "
                f"{_cell(ratio)} |"
            )
    mix = r.get("mixed", {})
    rows = {k: v for k, v in mix.items() if isinstance(v, dict)}
    if rows:
        lines += ["", f"## Mixed workload ({mix.get('max_seqs')} slots)", "",
                  "| run | short TTFT p50 / p95 ms | long tok/s | preemptions |",
                  "|---|---|---|---|"]  # fmt: skip
        for name, row in rows.items():
            t = row.get("short_ttft_ms") or {}
            lines.append(f"| {name} | {_cell(_round(t.get('p50')))} / "
                         f"{_cell(_round(t.get('p95')))} | "
                         f"{_cell(_round(row.get('long_tokens_per_s')))} | "
                         f"{_cell(row.get('preemptions'))} |")  # fmt: skip
    ex = r.get("exactness", {})
    if "summary" in ex:
        lines += ["", f"## parkq's exactness tests on this build: {ex['summary']}"]
        lines += [f"- {f}" for f in ex.get("failed", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu-check.json and gpu-check.md")
    ap.add_argument("--cpu", action="store_true", help="the dry run: small model, short runs")
    ap.add_argument("--server", help="llama-server binary of the same build (the peer)")
    ap.add_argument("--seconds", type=float, default=420.0, help="the whole check's time")
    ap.add_argument("--only", help="comma-separated sections (default: all)")
    ap.add_argument("--shape", help="the models' shape (default: 1b; --cpu: small)")
    ap.add_argument("--clients", help="concurrency: simultaneous streams (default 1,2,4,8,16)")
    ap.add_argument("--mixed-seconds", type=float, help="mixed: the workload's length")
    ap.add_argument(
        "--tests", help="exactness: test files by name (default: engine,batching,parking,quantized)"
    )
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="parkq-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("small" if args.cpu else "1b")
    check = Check(out=Path(args.out), cpu=args.cpu, server=args.server,
                  deadline=time.monotonic() + args.seconds, work=work, shape=shape,
                  clients=[int(c) for c in args.clients.split(",")] if args.clients else None,
                  mixed_seconds=args.mixed_seconds,
                  tests=args.tests.split(",") if args.tests else None)  # fmt: skip
    run(check, args.only.split(",") if args.only else None)
    _write(check)
    print(markdown(check.results), flush=True)


if __name__ == "__main__":
    main()
