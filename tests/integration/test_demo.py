"""`parkq demo` as a newcomer runs it: it shows a park, and says so plainly when it cannot."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.helpers import children, wait_until

CLI = [sys.executable, "-m", "tools.cli"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKQ_")}
    return {**env, "PARKQ_CACHE_DIR": str(tmp_path / "cache"), "PARKQ_N_THREADS": "1"}


def test_the_demo_parks_the_long_job_and_claims_only_what_it_showed(
    tiny_model: Path, tmp_path: Path
) -> None:
    run = subprocess.run(
        [*CLI, "demo", "--model", str(tiny_model)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = run.stdout
    assert "[short question arrives]" in out
    assert "the long job was parked for the question" in out
    waited = re.search(r"would have waited about (\d+\.\d) s", out)
    assert waited is not None and float(waited.group(1)) > 0, out[-1000:]
    long_job = re.search(r"-- long job: (\d+) tokens, (\w+), parked (\d+) time", out)
    assert long_job is not None, out[-1000:]
    asked = int(re.search(r"\[long batch job, (\d+) tokens\]", out).group(1))  # type: ignore[union-attr]
    assert int(long_job.group(1)) == asked and long_job.group(2) == "finished"
    assert int(long_job.group(3)) >= 1
    assert "Traceback" not in run.stderr


def _kill_worker_and_wait(proc: subprocess.Popen[str], seen: list[str]) -> tuple[int, str, float]:
    """SIGKILL the demo's worker once the stack is up; its exit status, stderr, kill time."""
    try:
        wait_until(lambda: any("parkq is up" in line for line in seen), timeout=300)
        workers = [pid for pid, cmd in children(proc.pid) if "tools.cli worker" in cmd]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)  # what a segfault or the OOM killer does
        t0 = time.monotonic()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with proc.stderr:  # type: ignore[union-attr]
        return code, proc.stderr.read(), t0  # type: ignore[union-attr]


def test_a_demo_whose_worker_dies_says_so_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*CLI, "demo", "--model", str(tiny_model)],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    code, err, t0 = _kill_worker_and_wait(proc, seen)
    reader.join(timeout=30)
    proc.stdout.close()  # type: ignore[union-attr]
    assert code == 1, err
    assert time.monotonic() - t0 < 60
    lines = [line for line in err.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("parkq demo failed:")]
    assert len(failed) == 1, err
    assert "worker0 process was killed by SIGKILL" in failed[0]
    log = re.search(r"its log: (\S+\.log)", failed[0])
    assert log is not None and Path(log.group(1)).is_file()
    assert "Traceback" not in err
