"""Imports run one way: tools -> web -> jobs -> scheduler, and inside jobs the
worker joins the engine and the store, which know nothing of each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What each part may import of parkq (itself included).
ALLOWED = {
    "scheduler": {"scheduler"},
    "jobs.engine": {"jobs.engine", "scheduler"},
    "jobs.store": {"jobs.store", "scheduler"},
    "jobs.worker": {"jobs.worker", "jobs.engine", "jobs.store", "scheduler"},
    "web": {"web", "jobs", "scheduler"},
    "tools": {"tools", "web", "jobs", "scheduler"},
}
PARTS = ("scheduler", "jobs", "web", "tools")


def _part(module: str) -> str | None:
    """The part a module belongs to, or None for one outside parkq."""
    head = module.split(".")
    if head[0] not in PARTS:
        return None
    if head[0] == "jobs" and len(head) > 1:
        return f"jobs.{head[1]}"
    return head[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from jobs import engine` imports the room itself.
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _modules() -> list[Path]:
    return sorted(p for part in PARTS for p in (ROOT / part).rglob("*.py"))


def test_every_module_belongs_to_a_part_with_rules() -> None:
    for path in _modules():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        part = _part(module)
        assert part in ALLOWED or module == "jobs.__init__", module


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path: Path) -> None:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = _part(module)
    allowed = ALLOWED.get(mine or "", set())
    wrong = []
    for line, name in _imports(path):
        theirs = _part(name)
        if theirs is None or theirs in allowed or theirs.split(".")[0] in allowed:
            continue
        wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_a_wrong_import() -> None:
    """The check itself: an engine module importing the store is refused."""
    assert _part("jobs.store.scheduling") not in ALLOWED["jobs.engine"]
    assert _part("jobs.worker.loop") not in ALLOWED["jobs.store"]
    assert _part("web.api") not in ALLOWED["jobs.worker"]
    assert _part("jobs") not in ALLOWED["scheduler"]
