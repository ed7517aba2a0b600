"""Many open streams on one `parkq web`: what each costs, and whether /healthz
still answers.

    python -m tools.bench.streams [--streams 500] [--hold 20] [--out FILE.json]

Starts `parkq up` with no worker (its own Redis, the tiny generated model's
vocabulary, PARKQ_MAX_STREAMS=--streams), opens --streams streamed
completions (half greedy, half the openai client's default sampling: no
temperature given), each its own queued job whose stream stays open on
keep-alives, and holds them --hold seconds. Meanwhile /healthz and
GET /v1/models are timed every 50 ms. Then one more stream is asked for (past
the cap: 503 with Retry-After), every stream is closed, and the slots are
checked to come back. Prints and writes (JSON): the time to open them, the web
process's resident memory before and with the streams open (per stream), its
CPU while they idle, Redis's clients, the latencies (p50, p99, max) and the
refusal.

The web alone is measured: with no worker no token flows, so the streams cost
what an open stream waiting for its job costs (a thread, a Redis pub/sub
connection, a keep-alive every 15 s, a client check every 0.5 s).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
import requests

from scheduler.settings import load_settings
from tools.bench import SAMPLING, command_line, write_results
from tools.launcher import Stack


def _open_stream(host: str, port: int, body: dict[str, Any]) -> tuple[socket.socket | None, int]:
    """POST a streamed completion on a raw socket and read up to the headers:
    the open socket (None if refused) and the status code."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if status != 200:
        sock.close()
        return None, status
    return sock, status


class _Proc:
    """A process's figures from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def _status(self, field: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def rss(self) -> int:
        return self._status("VmRSS") * 1024

    def threads(self) -> int:
        return self._status("Threads")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _web_worker(stack: Stack) -> _Proc:
    """The gunicorn worker serving the requests (the web process's child)."""
    web = next(proc for name, proc in stack.children if name == "web")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == web.pid:
                return _Proc(int(entry))
    return _Proc(web.pid)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "n": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "max_ms": round(1000 * ordered[-1], 1),
    }


def measure(streams: int, hold: float) -> dict[str, Any]:
    from jobs.engine.testmodel import write_test_model

    model = str(write_test_model(f"/tmp/parkq-streams-tiny-{time.time_ns()}.gguf", seed=0))
    settings = load_settings(model=model, port=0, log_level="WARNING", max_streams=streams,
                             max_queue=streams + 100)  # fmt: skip
    stack = Stack(settings, workers=0)
    stack.start()
    sockets: list[socket.socket] = []
    try:
        base = stack.base_url
        deadline = time.monotonic() + 300
        while True:
            try:
                if requests.get(base + "/healthz", timeout=2).json().get("redis"):
                    break
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("parkq web did not answer in time")
            time.sleep(0.1)
        url = urlsplit(base)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        r = redis.Redis.from_url(stack.settings.redis_url or "")
        web = _web_worker(stack)
        rss_before = web.rss()
        clients_before = int(r.info("clients")["connected_clients"])

        health: list[float] = []
        models: list[float] = []
        failures: list[str] = []
        stop = threading.Event()

        def probe() -> None:
            while not stop.wait(0.05):
                for path, into in (("/healthz", health), ("/v1/models", models)):
                    t0 = time.monotonic()
                    try:
                        requests.get(base + path, timeout=10)
                    except requests.RequestException as exc:
                        failures.append(f"{path}: {exc}")
                        continue
                    into.append(time.monotonic() - t0)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        t0 = time.monotonic()
        for i in range(streams):
            arm = SAMPLING["greedy" if i % 2 == 0 else "default"]["parkq"]
            body = {"prompt": f"Stream {i}", "max_tokens": 16, "stream": True, **arm}
            sock, status = _open_stream(host, port, body)
            if sock is None:
                raise RuntimeError(f"stream {i} refused with {status} below the cap")
            sockets.append(sock)
        open_seconds = time.monotonic() - t0
        opening = _percentiles(health)
        health.clear()
        models.clear()
        cpu0 = web.cpu_seconds()
        time.sleep(hold)
        cpu1 = web.cpu_seconds()
        rss_open = web.rss()
        threads = web.threads()
        clients_open = int(r.info("clients")["connected_clients"])
        over, over_status = _open_stream(host, port, {"prompt": "one more", "stream": True})
        refused: dict[str, Any] = {"status": over_status}
        if over is not None:
            over.close()
        resp = requests.post(base + "/v1/completions", json={"prompt": "x", "stream": True},
                             timeout=10)  # fmt: skip
        refused.update(retry_after=resp.headers.get("Retry-After"),
                       code=(resp.json().get("error") or {}).get("code"))  # fmt: skip
        stop.set()
        prober.join(timeout=30)
        holding = (_percentiles(health), _percentiles(models))
        for sock in sockets:
            sock.close()
        sockets.clear()
        t1 = time.monotonic()
        back = False
        while time.monotonic() - t1 < 60 and not back:
            again, _ = _open_stream(host, port, {"prompt": "after", "stream": True})
            if again is not None:
                again.close()
                back = True
            else:
                time.sleep(0.2)
        busy = cpu1 - cpu0
        return {
            "machine": f"{platform.processor() or platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} CPUs",
            "streams": streams,
            "hold_seconds": hold,
            "open_seconds": round(open_seconds, 2),
            "web_threads": threads,
            "web_rss_before_mib": round(rss_before / 2**20, 1),
            "web_rss_open_mib": round(rss_open / 2**20, 1),
            "web_rss_per_stream_kib": round((rss_open - rss_before) / streams / 1024, 1),
            "web_cpu_while_idle_percent": round(100 * busy / hold, 1),
            "redis_clients_before": clients_before,
            "redis_clients_open": clients_open,
            "healthz_while_opening": opening,
            "healthz_while_open": holding[0],
            "models_while_open": holding[1],
            "probe_failures": failures[:10],
            "one_more": refused,
            "slots_back_after_close": back,
            "slots_back_seconds": round(time.monotonic() - t1, 2),
        }
    finally:
        for sock in sockets:
            sock.close()
        stack.stop()


def main() -> None:
    ap = command_line(__doc__, "streams", model="the tiny generated model")
    ap.add_argument("--streams", type=int, default=500, help="open streams (PARKQ_MAX_STREAMS)")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds to hold them open")
    args = ap.parse_args()
    results = measure(args.streams, args.hold)
    results["command"] = "python -m tools.bench.streams " + " ".join(sys.argv[1:])
    print(json.dumps(results, indent=1))
    write_results(args.out, results)


if __name__ == "__main__":
    main()
