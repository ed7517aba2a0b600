"""What the GPU check carries: the trimmed llama.cpp source, the slim wheel, a
prebuilt that is taken only when it loads."""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

import llama_cpp
import pytest

from tools.bench.gpu_kit import PREBUILT, _loads, _without_libraries, build, cmake_args, pack
from tools.bench.gpu_kit import trim_filter as keeps


def _member(name: str, directory: bool = False) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    return m


@pytest.mark.parametrize(
    "name",
    [
        "CMakeLists.txt",
        "cmake/common.cmake",
        "ggml/src/ggml.c",
        "ggml/src/ggml-alloc.c",  # a core file whose name starts like a backend's folder
        "ggml/src/ggml-cuda/mmq.cu",
        "ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu",
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "src/llama.cpp",
        "common/common.cpp",
        "tools/server/server.cpp",
        "tools/ui/CMakeLists.txt",
        "tools/ui/ui.h.in",  # the UI step of a server build reads these
        "scripts/ui-assets.cmake",
        "vendor/cpp-httplib/httplib.h",
    ],
)
def test_the_trimmed_source_keeps_what_a_build_reads(name: str) -> None:
    assert keeps(_member(name))


@pytest.mark.parametrize(
    "name",
    [
        "models/ggml-vocab-llama-bpe.gguf",
        "docs/build.md",
        "tests/test-backend-ops.cpp",
        "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        "ggml/src/ggml-metal/ggml-metal.m",
        "tools/ui/src/lib/app.ts",
        "tools/server/tests/unit/test_basic.py",
        "scripts/sync-ggml.sh",
    ],
)
def test_the_trimmed_source_drops_what_no_build_reads(name: str) -> None:
    assert not keeps(_member(name))
    assert not keeps(_member("ggml/src/ggml-sycl", directory=True))


def test_the_cuda_build_targets_one_architecture_with_flash_attention_for_f16_caches(
    tmp_path: Path,
) -> None:
    """An exact worker on a GPU runs flash attention (GGML_CUDA_BATCH_INVARIANT)."""
    cuda = cmake_args(tmp_path / "src", tmp_path / "build", cuda=True, arch="90")
    assert "-DGGML_CUDA=ON" in cuda
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in cuda
    assert "-DGGML_CUDA_FA=ON" in cuda and "-DGGML_CUDA_FA_QUANTS=f16-f16" in cuda
    assert "-DBUILD_SHARED_LIBS=ON" in cuda  # what llama-cpp-python loads
    cpu = cmake_args(tmp_path / "src", tmp_path / "build", cuda=False)
    assert not any("CUDA" in a for a in cpu)


def test_the_slim_wheel_keeps_the_python_package_and_a_consistent_record(tmp_path: Path) -> None:
    wheel = tmp_path / "llama_cpp_python-0.0.0-py3-none-linux_x86_64.whl"
    files = {
        "llama_cpp/__init__.py": b"",
        "llama_cpp/llama_cpp.py": b"x = 1\n",
        "llama_cpp/lib/libllama.so": b"\x7fELF",
        "lib/libggml.so": b"\x7fELF",
        "include/llama.h": b"",
        "llama_cpp_python-0.0.0.dist-info/METADATA": b"Name: llama_cpp_python\n",
    }
    record = "".join(f"{n},sha256=x,1\n" for n in files)
    record += "llama_cpp_python-0.0.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("llama_cpp_python-0.0.0.dist-info/RECORD", record)
    _without_libraries(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        kept_record = z.read("llama_cpp_python-0.0.0.dist-info/RECORD").decode()
    assert names == {
        "llama_cpp/__init__.py",
        "llama_cpp/llama_cpp.py",
        "llama_cpp_python-0.0.0.dist-info/METADATA",
        "llama_cpp_python-0.0.0.dist-info/RECORD",
    }
    assert {line.split(",")[0] for line in kept_record.splitlines()} == names


def test_a_prebuilt_is_taken_only_when_it_loads(tmp_path: Path) -> None:
    lib = Path(llama_cpp.__file__).parent / "lib"
    real = next(p for p in sorted(lib.glob("libggml-base.so*")) if not p.is_symlink())
    kit = tmp_path / "kit"
    (kit / "lib").mkdir(parents=True)
    (kit / "bin").mkdir()
    # A library that loads (llama.cpp's own, standing in for the CUDA one).
    shutil.copy(real, kit / "lib" / "libggml-cuda.so")
    (kit / "bin" / "llama-server").write_bytes(b"#!/bin/sh\n")
    pack(kit, tmp_path / PREBUILT)
    shutil.rmtree(kit)
    kit.mkdir()
    shutil.move(tmp_path / PREBUILT, kit / PREBUILT)
    assert build(kit, cuda=True) == kit / "lib"
    assert (kit / "bin" / "llama-server").exists()
    assert _loads(kit / "lib" / "libggml-cuda.so") is None
    # A file that is no library is refused with the loader's reason.
    broken = tmp_path / "libbroken.so"
    broken.write_bytes(b"not a library")
    problem = _loads(broken)
    assert problem is not None and "libbroken.so" in problem
