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


def _imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``, the module ``module``;
    relative imports resolved, ``from jobs import engine`` as ``jobs.engine``."""
    out = []
    package = module.split(".")[:-1]  # __init__ is a module of its package too
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            where = ".".join([*base, *([node.module] if node.module else [])])
            out += [(node.lineno, f"{where}.{alias.name}") for alias in node.names]
    return out


def _wrong(source: str, module: str) -> list[str]:
    """The imports of ``module`` its part may not make."""
    allowed = ALLOWED.get(_part(module) or "", set())
    wrong = []
    for line, name in _imports(source, module):
        theirs = _part(name)
        if theirs is None or theirs in allowed or theirs.split(".")[0] in allowed:
            continue
        wrong.append(f"{module}:{line} imports {name}")
    return wrong


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
    wrong = _wrong(path.read_text(), module)
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_a_wrong_import() -> None:
    """The check itself: wrong imports are found, in every form."""
    engine = "jobs.engine.sampling"
    assert _wrong("from jobs.store.scheduling import Store", engine)
    assert _wrong("from ..store import scheduling", engine)
    assert _wrong("import jobs.worker.loop", engine)
    assert _wrong("def f():\n    from web.api import bp", "jobs.worker.loop")
    assert _wrong("from jobs import store", "scheduler.policy")
    assert not _wrong("from .llama import Vocab\nfrom scheduler.policy import Policy", engine)
    assert not _wrong("from jobs.engine.llama import Engine", "jobs.worker.loop")
