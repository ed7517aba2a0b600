"""Benchmarks: scripts that print their figures and write JSON (not tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_and_chat_format(path: str | None) -> tuple[str, str | None]:
    """The model to measure: ``path``, or the demo model (assembled once)."""
    if path is not None:
        return path, None
    from jobs.demo_model import DEMO_CHAT_FORMAT, assemble_demo_model, demo_model_target

    target = demo_model_target(None)
    return str(target if target.exists() else assemble_demo_model(target)), DEMO_CHAT_FORMAT


def write_results(path: str, results: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
