"""A real `parkq up` process (tiny model, the session's redis-server)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
import requests

from jobs.engine.testmodel import write_test_model
from tests.conftest import fresh_port

if TYPE_CHECKING:
    from tests.integration.test_sentinel import Sentinels


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


#: Settings of the test deployments: short timers so that tests stay quick.
TEST_ENV = {
    "PARKQ_N_CTX": "4096",
    # One sequence per worker: these deployments test parking on a full engine
    # (tests that batch set their own; test_cli runs the defaults).
    "PARKQ_MAX_SEQS": "1",
    "PARKQ_N_BATCH": "16",
    "PARKQ_MIN_RUN_SECONDS": "0.05",
    "PARKQ_PREEMPT_MARGIN": "0.2",
    "PARKQ_PRIORITY_LEVEL_SECONDS": "0.5",
    "PARKQ_WORKER_TTL": "3",
    "PARKQ_HEARTBEAT_SECONDS": "0.5",
    "PARKQ_DISCONNECT_GRACE_SECONDS": "1",
}


@dataclass
class Server:
    base_url: str
    redis_url: str
    proc: subprocess.Popen[str]

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)


def start_parkq(
    model: Path,
    redis_url: str | None,
    *extra: str,
    env: dict[str, str] | None = None,
    said: list[str] | None = None,
    errors: Path | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """`parkq up`; the lines it printed before it was up go to ``said``, its
    standard error to the file ``errors``."""
    port = fresh_port()
    argv = [sys.executable, "-m", "tools.cli", "up", "--model", str(model), "--port", str(port)]
    if redis_url:
        argv += ["--redis-url", redis_url]
    elif "--data-dir" not in extra and "--ephemeral" not in extra:
        argv += ["--data-dir", tempfile.mkdtemp(prefix="parkq-data-")]  # its own, kept
    full_env = {**os.environ, "PARKQ_LOG_LEVEL": "WARNING", **(env or {})}
    err = errors.open("w") if errors is not None else None
    proc = subprocess.Popen(
        [*argv, *extra], env=full_env, stdout=subprocess.PIPE, stderr=err, text=True
    )
    if err is not None:
        err.close()  # the child has its own descriptor
    assert proc.stdout is not None
    # The contract: one line with the base URL once everything answers.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if said is not None:
                said.append(line)
            if line.startswith("parkq is up at "):
                base = line.split()[4]
                assert base == f"http://127.0.0.1:{port}"
                assert requests.get(base + "/healthz", timeout=5).status_code == 200
                return proc, base
    proc.kill()
    raise RuntimeError(f"parkq up did not come up (exit status {proc.poll()})")


def stop_parkq(proc: subprocess.Popen[str]) -> int:
    """SIGTERM `parkq up` as Ctrl-C would; return its exit status."""
    proc.terminate()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return code


@pytest.fixture(scope="session")
def q8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Q8_0 weights: the quantized kernels real models take."""
    root = tmp_path_factory.mktemp("tiny-q8")
    return write_test_model(root / "tiny-q8_0.gguf", seed=0, quant="q8_0")


@pytest.fixture(scope="session")
def server(redis_server, tiny_model: Path) -> Iterator[Server]:
    proc, base = start_parkq(tiny_model, redis_server.url, env=TEST_ENV)
    yield Server(base, redis_server.url, proc)
    stop_parkq(proc)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[Sentinels]:
    """A primary, its replica and three sentinels (tests/integration/test_sentinel.py)."""
    from tests.integration.test_sentinel import Sentinels

    s = Sentinels(tmp_path / "redis")
    try:
        s.start()
        yield s
    finally:
        s.stop()  # whatever started, also when the start failed
