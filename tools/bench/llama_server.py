"""llama.cpp's own server as a benchmark peer, built from the llama.cpp source
that the installed llama-cpp-python vendors (so both run the same kernels).

    python -m tools.bench.llama_server build      # once: about 25 minutes on 2 cores
    python -m tools.bench.llama_server path       # where the binary is (or would be)

The sdist comes from the package registry (``pip download --no-binary``), is
built with CMake (server only, no curl, no OpenSSL) and the binary is cached
under ``~/.cache/parkq/llama-server/<version>/``. A build that fails leaves
nothing in the cache, so the next call starts over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import requests

from scheduler.settings import cache_root

__all__ = [
    "build_llama_server",
    "llama_server_path",
    "running_llama_server",
    "server_args",
    "serving",
]


def llama_server_path(cache_dir: str | None = None) -> Path:
    """Where ``llama-server`` for the installed llama-cpp-python is cached."""
    # The release it was built from: llama-server is stock llama.cpp, as its users run it.
    version = metadata.version("llama-cpp-python").split("+", 1)[0]
    return cache_root(cache_dir) / "llama-server" / version / "llama-server"


def server_args(
    binary: str | Path,
    *,
    model: str,
    port: int,
    seqs: int,
    n_ctx: int,
    threads: int,
    extra_buffers: bool,
    gpu_layers: int = 0,
    flash_attn: bool = False,
) -> list[str]:
    """The peer's command line, matched to a parkq worker's settings: ``seqs``
    parallel slots of ``n_ctx`` positions each, the same threads, the same
    layers on the GPU (``gpu_layers``, -1: all), flash attention where the
    worker runs it (``flash_attn``: jobs.engine.kernels.worker_attention) and the
    same kernel path (``--no-repack`` where parkq turns extra buffer types off)."""
    argv = [str(binary), "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(seqs), "-c", str(n_ctx * seqs), "-t", str(threads), "-tb", str(threads),
            "-ngl", str(999 if gpu_layers < 0 else gpu_layers),
            "-fa", "on" if flash_attn else "off",
            "--cont-batching", "--no-webui", "--log-disable"]  # fmt: skip
    if not extra_buffers:
        argv.append("--no-repack")
    return argv


@contextmanager
def serving(argv: list[str], base: str, ready_path: str, what: str) -> Iterator[str]:
    """Run a peer server (``argv``) until the block ends, once ``base + ready_path``
    answers 200; yields ``base``. Its exit or 300 s of silence is a RuntimeError."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode}")
            try:
                if requests.get(base + ready_path, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start within 300 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_llama_server(
    binary: str | Path,
    *,
    model: str,
    seqs: int,
    n_ctx: int,
    threads: int,
    extra_buffers: bool,
    gpu_layers: int = 0,
    flash_attn: bool = False,
) -> Iterator[str]:
    """``llama-server`` on a free loopback port, until the block ends; its base URL."""
    from tools.launcher import free_port

    port = free_port()
    argv = server_args(binary, model=model, port=port, seqs=seqs, n_ctx=n_ctx,
                       threads=threads, extra_buffers=extra_buffers,
                       gpu_layers=gpu_layers, flash_attn=flash_attn)  # fmt: skip
    with serving(argv, f"http://127.0.0.1:{port}", "/health", "llama-server") as base:
        yield base


def build_llama_server(cache_dir: str | None = None, jobs: int | None = None) -> Path:
    """Build (once) and return the cached ``llama-server`` binary."""
    target = llama_server_path(cache_dir)
    if target.exists():
        return target
    version = target.parent.name
    jobs = jobs or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="parkq-llama-server-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", "-d", str(work), f"llama-cpp-python=={version}"],
            check=True,
        )  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = (p / "vendor" / "llama.cpp" for p in work.glob("llama_cpp_python-*/"))
        build = work / "build"
        subprocess.run(
            ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
            check=True,
        )  # fmt: skip
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
            check=True,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(target)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["build", "path"])
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: the cores)")
    args = ap.parse_args()
    print(build_llama_server(jobs=args.jobs) if args.action == "build" else llama_server_path())


if __name__ == "__main__":
    main()
