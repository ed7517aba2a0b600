"""llama-cpp-python with parkq's llama.cpp patches, built once per machine.

    python -m tools.llamapatch ensure      # install the patched build into this Python
    python -m tools.llamapatch wheel       # build (or take the cached) wheel; print its path
    python -m tools.llamapatch apply DIR   # patch a llama.cpp source tree in place

The patches (``NNNN-*.patch`` beside this file, rooted at llama.cpp's top
folder, each with its reason) are small and written to be offered upstream as
build or run-time options; docs/design.md says what each one is for. The
build is the sdist of :data:`BASE_VERSION` with the patches applied and the
version labelled ``BASE_VERSION+parkq.N`` (so ``pip list`` and the worker's log
show which build runs); the wheel is cached under the cache directory
(``PARKQ_CACHE_DIR``, else ``~/.cache/parkq``) by patch contents, Python and
``CMAKE_ARGS``, so a second virtualenv installs it in seconds.

Runs on the standard library alone: ``scripts/env.sh`` and the Dockerfile call
it before parkq and its dependencies are installed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

__all__ = ["BASE_VERSION", "apply", "ensure", "label", "patches", "wheel"]

#: The llama-cpp-python release the patches are written against.
BASE_VERSION = "0.3.36"
#: Raised whenever a patch is added or changed (the local version label).
PATCH_LEVEL = 5

HERE = Path(__file__).resolve().parent


def patches() -> list[Path]:
    """The patch series, in order."""
    return sorted(HERE.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def label() -> str:
    """The version the patched build carries: ``0.3.36+parkq.1``."""
    return f"{BASE_VERSION}+parkq.{PATCH_LEVEL}"


def base_version(version: str) -> str:
    """``0.3.36+parkq.1`` -> ``0.3.36`` (the release on PyPI)."""
    return version.split("+", 1)[0]


#: A line each patch adds (checked after applying: a tool that reports success
#: without patching cannot pass).
_ADDS = {
    "0001-cpu-tiled-min-rows.patch": ("ggml/src/ggml-cpu/tiled/tiled.cpp",
                                      "GGML_CPU_TILED_MM_MIN_ROWS"),
    "0002-cpu-fa-split-kv-switch.patch": ("ggml/src/ggml-cpu/ops.cpp", "GGML_CPU_FA_SPLIT_KV"),
    "0003-cpu-run-time-tiled-floors.patch": ("ggml/include/ggml-cpu.h",
                                            "ggml_cpu_set_fa_tiled_min_rows"),
    "0004-cpu-fa-tiled-tile-rows.patch": ("ggml/src/ggml-cpu/ops.cpp",
                                          "short tile is not padded to Q_TILE_SZ"),
    "0005-cuda-batch-invariant.patch": ("ggml/src/ggml-cuda/common.cuh",
                                        "GGML_CUDA_BATCH_INVARIANT"),
}  # fmt: skip


def apply(llama_cpp_dir: Path) -> None:
    """Apply the series to a llama.cpp source tree (the sdist's ``vendor/llama.cpp``)."""
    for patch in patches():
        if shutil.which("git"):
            tool = ["git", "apply", "--whitespace=nowarn", str(patch)]
        elif shutil.which("patch"):
            tool = ["patch", "-p1", "--batch", "--forward", "-i", str(patch)]
        else:
            raise RuntimeError("applying llama.cpp patches needs git or patch (Debian: "
                               "apt-get install git)")  # fmt: skip
        done = subprocess.run(tool, cwd=llama_cpp_dir, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply to {llama_cpp_dir}: "
                               f"{(done.stderr or done.stdout).strip()}")  # fmt: skip
        path, added = _ADDS[patch.name]
        if added not in (llama_cpp_dir / path).read_text():
            raise RuntimeError(f"{patch.name} reported applied, but {path} lacks {added}")


def _cache_root() -> Path:
    given = os.environ.get("PARKQ_CACHE_DIR")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "parkq"


def _key() -> str:
    """What makes two builds the same: the patches, this Python, the CMake arguments."""
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(f"{label()}\0{sys.implementation.cache_tag}\0{sysconfig.get_platform()}".encode())
    cmake_args = os.environ.get("CMAKE_ARGS", "")
    h.update(cmake_args.encode())
    if "GGML_NATIVE=OFF" not in cmake_args.replace("-D", ""):
        # llama.cpp builds for this CPU by default: a cache shared between
        # machines must not hand one CPU's build to another.
        h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return sysconfig.get_platform()


def _pip(*args: str, **kw: object) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, **kw)  # type: ignore[call-overload]


def wheel(cache: Path | None = None) -> Path:
    """The patched wheel for this Python, built once and cached (one build at a
    time per cache: a second process waits for the first one's wheel)."""
    folder = (cache or _cache_root()) / "wheels" / f"llama-cpp-python-{label()}-{_key()}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = sorted(folder.glob("llama_cpp_python-*.whl"))
        return built[0] if built else _build(folder)


def _build(folder: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="parkq-llama-") as tmp:
        work = Path(tmp)
        _pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(work),
             f"llama-cpp-python=={BASE_VERSION}")  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (src,) = work.glob("llama_cpp_python-*/")
        apply(src / "vendor" / "llama.cpp")
        init = src / "llama_cpp" / "__init__.py"
        text = init.read_text()
        line = f'__version__ = "{BASE_VERSION}"'
        if line not in text:
            raise RuntimeError(f"{init} does not say {line}")
        init.write_text(text.replace(line, f'__version__ = "{label()}"'))
        out = work / "out"
        print(f"parkq: compiling llama.cpp {label()} (several minutes, once per machine)...",
              file=sys.stderr)  # fmt: skip
        _pip("wheel", "--quiet", "--no-deps", "-w", str(out), str(src))
        (made,) = out.glob("llama_cpp_python-*.whl")
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        shutil.copy2(made, partial / made.name)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        return folder / made.name


def installed() -> str | None:
    """The llama-cpp-python version installed in this Python, if any."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def _stamp() -> Path:
    """Where this Python records which patched build it installed (its key)."""
    return Path(sys.prefix) / ".parkq-llamapatch"


def ensure() -> None:
    """Install the patched build into this Python unless that very build (same
    patches, CMake arguments and CPU) is there already."""
    stamp = _stamp()
    try:
        same = installed() == label() and stamp.read_text().strip() == _key()
    except OSError:
        same = False
    if same:
        return
    _pip("install", "--quiet", "--no-deps", "--force-reinstall", str(wheel()))
    stamp.write_text(_key() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["ensure", "wheel", "apply"])
    ap.add_argument("dir", nargs="?", help="apply: the llama.cpp source folder")
    args = ap.parse_args()
    if args.action == "ensure":
        ensure()
    elif args.action == "wheel":
        print(wheel())
    else:
        if not args.dir:
            ap.error("apply needs the llama.cpp folder")
        apply(Path(args.dir))


if __name__ == "__main__":
    main()
