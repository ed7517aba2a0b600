"""Run every mode, print the figures and their ratios, write JSON and a PNG."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from scheduler.settings import Settings
from tools.bench import SAMPLING, modes
from tools.bench.workload import Workload

__all__ = ["MODES", "OPTIONAL_MODES", "run_bench"]

MODES = ("parkq", "parkq_no_preempt", "parkq_no_shorts", "peer", "llama_server", "idle")
#: Modes that run only when their system is there (llama-server: a binary built once).
OPTIONAL_MODES = ("llama_server",)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ttft(mode: dict[str, Any], q: str) -> float | None:
    value: float | None = mode["short_ttft_ms"][q]
    return value


def ratios(r: dict[str, Any]) -> dict[str, float | None]:
    p, np_, peer, idle = r["parkq"], r["parkq_no_preempt"], r["peer"], r["idle"]
    out = {
        "ttft_busy_over_idle_p50": _ratio(ttft(p, "p50"), ttft(idle, "p50")),
        "ttft_busy_over_idle_p95": _ratio(ttft(p, "p95"), ttft(idle, "p95")),
        "ttft_no_preempt_over_preempt_p50": _ratio(ttft(np_, "p50"), ttft(p, "p50")),
        "ttft_peer_over_parkq_p50": _ratio(ttft(peer, "p50"), ttft(p, "p50")),
        "throughput_preempt_over_no_preempt": _ratio(
            p["aggregate_tokens_per_s"], np_["aggregate_tokens_per_s"]
        ),
        "throughput_no_shorts_over_no_preempt": _ratio(
            r["parkq_no_shorts"]["aggregate_tokens_per_s"], np_["aggregate_tokens_per_s"]
        ),
        "throughput_parkq_over_peer": _ratio(
            p["aggregate_tokens_per_s"], peer["aggregate_tokens_per_s"]
        ),
        "long_rate_over_bare_loop": _ratio(
            r["parkq_no_shorts"]["long_tokens_per_s"], r["bare_loop_tokens_per_s"]
        ),
    }
    if "llama_server" in r:
        out.update(
            ttft_llama_server_over_parkq_p95=_ratio(ttft(r["llama_server"], "p95"), ttft(p, "p95")),
            throughput_parkq_over_llama_server=_ratio(
                p["aggregate_tokens_per_s"], r["llama_server"]["aggregate_tokens_per_s"]
            ),
        )
    return out


def run_bench(
    settings: Settings,
    workload: Workload,
    eos: list[int],
    out: Path,
    say: Callable[[str], None],
    peer_server: str | None = None,
    arms: tuple[str, ...] = tuple(SAMPLING),
) -> dict[str, Any]:
    """Every mode in turn, once per sampling arm (greedy, and the openai client's
    defaults: see ``tools.bench.SAMPLING``); ``peer_server`` (a
    ``llama-server`` binary) adds llama.cpp's own server as the ``llama_server``
    mode. The JSON holds ``arms``: each arm's modes, ratios and workload."""
    report: dict[str, Any] = {"model": Path(settings.model or "").name, "arms": {},
                              "timelines": {}}  # fmt: skip
    say("bench: bare llama-cpp-python loop ...")
    report["bare_loop_tokens_per_s"] = modes.bare_decode_rate(
        settings, min(workload.long_tokens, 512)
    )
    out.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        fields = SAMPLING[arm]
        ours = replace(workload, sampling=fields["parkq"])
        theirs = replace(workload, sampling=fields["llama-server"])
        results, timelines = _run_arm(settings, ours, theirs, eos, say, peer_server, arm)
        results["bare_loop_tokens_per_s"] = report["bare_loop_tokens_per_s"]
        results["ratios"] = ratios(results)
        report["arms"][arm] = results
        report["timelines"][arm] = timelines
        _figure(results, timelines, out / f"bench-{arm}.png")
        for line in _table(results, arm):
            say(line)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    say(f"bench: wrote {out / 'bench.json'} and the figures bench-<arm>.png")
    return report


def _run_arm(
    settings: Settings,
    ours: Workload,
    theirs: Workload,
    eos: list[int],
    say: Callable[[str], None],
    peer_server: str | None,
    arm: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One sampling arm: parkq gets ``ours``, the other servers ``theirs`` (the
    same distribution asked for in their terms)."""
    results: dict[str, Any] = {"workload": ours.to_json(), "sampling": arm}
    timelines: dict[str, Any] = {}
    no_preempt = settings.model_copy(update={"preempt": False})
    longs_only = replace(ours, shorts=False)
    plan: list[tuple[str, Callable[[], Any]]] = [
        ("parkq", lambda: modes.run_parkq(settings, ours)),
        ("parkq_no_preempt", lambda: modes.run_parkq(no_preempt, ours)),
        ("parkq_no_shorts", lambda: modes.run_parkq(settings, longs_only)),
        ("peer", lambda: modes.run_peer(settings, theirs, eos)),
    ]
    if peer_server:
        peer = peer_server
        plan.append(("llama_server", lambda: modes.run_llama_server(settings, theirs, peer)))
    for name, run in plan:
        t0 = time.monotonic()
        say(f"bench [{arm}]: {name} ...")
        results[name], timelines[name] = run()
        say(f"bench [{arm}]: {name} done in {time.monotonic() - t0:.0f} s")
    say(f"bench [{arm}]: idle ...")
    results["idle"] = modes.idle_ttft(settings, ours, samples=max(5, min(20, len(ours.arrivals()))))
    return results, timelines


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{unit}" if x >= 10 else f"{x:.2f}{unit}"


def _table(r: dict[str, Any], arm: str) -> list[str]:
    lines = [
        f"sampling {arm}: {r['workload']['duration']:.0f} s per mode",
        f"{'mode':<18} {'TTFT p50':>10} {'p95':>9} {'p99':>9} {'long tok/s':>11} "
        f"{'all tok/s':>10} {'preempt':>8} {'park p50/p95 ms':>16} "
        f"{'resume p50/p95 ms':>18} {'ckpt MB':>8}",
    ]
    for name in (m for m in MODES if m in r):
        m = r[name]
        t = m["short_ttft_ms"]
        park, resume, ck = (m.get(k, {}) for k in ("park_ms", "resume_ms", "checkpoint_bytes"))
        lines.append(
            f"{name:<18} {_fmt(t['p50']):>10} {_fmt(t['p95']):>9} {_fmt(t['p99']):>9} "
            f"{_fmt(m.get('long_tokens_per_s')):>11} {_fmt(m.get('aggregate_tokens_per_s')):>10} "
            f"{m.get('preemptions', '-'):>8} "
            f"{_fmt(park.get('p50')) + '/' + _fmt(park.get('p95')):>16} "
            f"{_fmt(resume.get('p50')) + '/' + _fmt(resume.get('p95')):>18} "
            f"{_fmt((ck.get('p50') or 0) / 1e6 if ck.get('p50') else None):>8}"
        )
    lines.append(f"bare llama-cpp-python loop: {r['bare_loop_tokens_per_s']:.1f} tok/s")
    lines += [f"  {k}: {_fmt(v)}" for k, v in r["ratios"].items()]
    return lines


def _figure(r: dict[str, Any], timelines: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in ("parkq", "parkq_no_preempt", "peer", "llama_server") if m in timelines]
    fig, axes = plt.subplots(len(shown) + 1, 1, figsize=(11, 2.2 * len(shown) + 3.2))
    for ax, name in zip(axes, shown, strict=False):
        tl = timelines[name]
        ax.eventplot([tl["long_tokens"], tl["short_tokens"]], lineoffsets=[1, 0],
                     colors=["0.6", "tab:blue"], linelengths=0.8, linewidths=0.4)  # fmt: skip
        ax.scatter(tl["short_arrivals"], [0.5] * len(tl["short_arrivals"]), marker="v",
                   color="tab:red", s=18, label="short request arrives", zorder=3)  # fmt: skip
        ax.scatter(tl["short_first"], [0.5] * len(tl["short_first"]), marker="|",
                   color="tab:green", s=80, label="its first token", zorder=3)  # fmt: skip
        ax.set_yticks([0, 1], ["short", "long"])
        ax.set_xlim(0, r["workload"]["duration"])
        ax.set_title(f"{name}: who owns the engine (one mark per token)", fontsize=9)
    axes[0].legend(loc="upper right", fontsize=7)
    axes[-2].set_xlabel("seconds")
    box = axes[-1]
    boxed = [m for m in MODES if m in r]
    series = [
        timelines[m]["short_ttft_ms"] if m in timelines else r[m].get("samples_ms", [])
        for m in boxed
    ]
    box.boxplot([x or [float("nan")] for x in series], tick_labels=boxed, showfliers=True)
    box.set_yscale("log")
    box.set_ylabel("short TTFT (ms, log)")
    box.set_title("short request time to first token per mode", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
