"""A real `parkq up` process (tiny model, the session's redis-server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests

from web.launcher import free_port


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)


@dataclass
class Server:
    base_url: str
    redis_url: str
    proc: subprocess.Popen[bytes]

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)


def start_parkq(
    model: Path, redis_url: str | None, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "web.cli", "up", "--model", str(model), "--port", str(port)]
    if redis_url:
        argv += ["--redis-url", redis_url]
    full_env = {**os.environ, "PARKQ_LOG_LEVEL": "WARNING", **(env or {})}
    proc = subprocess.Popen([*argv, *extra], env=full_env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"parkq up exited with {proc.returncode}")
        try:
            if requests.get(base + "/healthz", timeout=2).status_code == 200:
                return proc, base
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("parkq up did not become healthy")
        time.sleep(0.1)


def stop_parkq(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def server(redis_server, tiny_model: Path) -> Iterator[Server]:
    proc, base = start_parkq(tiny_model, redis_server.url, env={"PARKQ_N_CTX": "4096"})
    yield Server(base, redis_server.url, proc)
    stop_parkq(proc)
