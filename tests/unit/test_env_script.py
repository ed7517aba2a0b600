"""scripts/env.sh, which both quickstart commands source: a machine without a
C++ compiler is told so in one line before pip spends minutes (a warning: a
cached or prebuilt wheel needs none)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What env.sh needs from the system besides a compiler.
TOOLS = ("bash", "ls", "dirname", "rm", "touch")


def _checkout(tmp: Path, python: str) -> Path:
    """A copy of scripts/env.sh beside a `.venv/bin/python` that runs ``python``
    (a shell script body)."""
    root = tmp / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "env.sh", root / "scripts" / "env.sh")
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/bash\n" + python)
    (venv / "python").chmod(0o755)
    return root


def _run(root: Path, tmp: Path, tools: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    path = tmp / "bin"
    path.mkdir(exist_ok=True)
    for tool in tools:
        found = shutil.which(tool)
        assert found, tool
        (path / tool).symlink_to(found)
    env = {"PATH": str(path), "HOME": str(tmp / "home"), "PARKQ_CACHE_DIR": str(tmp / "cache")}
    return subprocess.run(
        [str(path / "bash"), "-c", "source scripts/env.sh && ensure_venv demo"],
        cwd=root, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_no_cpp_compiler_is_said_in_one_line_before_the_build(tmp_path: Path) -> None:
    # pip answers; llama_cpp is not installed; the (fake) build runs after it.
    root = _checkout(tmp_path, 'case "$*" in *"import llama_cpp"*) exit 1;; esac\n'
                     'echo "python $*" >> calls\nexit 0\n')  # fmt: skip
    run = _run(root, tmp_path, TOOLS)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().splitlines()[0] == (
        "parkq: building llama.cpp needs a C++ compiler and none was found "
        "(Debian, Ubuntu: sudo apt-get install g++)"
    )
    assert "-m tools.llamapatch ensure" in (root / "calls").read_text()


def test_with_a_compiler_it_goes_on_to_build(tmp_path: Path) -> None:
    # The same machine with a C++ compiler: no such line; the (fake) build runs.
    root = _checkout(tmp_path, 'case "$*" in *"import llama_cpp"*) exit 1;; esac\n'
                     'echo "python $*" >> calls\nexit 0\n')  # fmt: skip
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "the suite's machine has a C++ compiler (scripts/test installs one)"
    run = _run(root, tmp_path, (*TOOLS, os.path.basename(compiler)))
    assert run.returncode == 0, run.stderr
    assert "C++ compiler" not in run.stderr
    calls = (root / "calls").read_text()
    assert "-m tools.llamapatch ensure" in calls and "pip install" in calls
