"""The documentation holds: every link and path in the README and docs/
resolves, no module cites a file or module that does not exist, the generated
settings table and .env.example match the code, the metrics table matches what
/metrics serves, and every figure in the README is in docs/benchmarks.md."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import fakeredis
import pytest

from scheduler.settings import Settings
from tests.fakes import FakeVocab
from tools.docgen import BLOCK, env_example, render
from web.app import create_app

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
TOP = ("scheduler", "jobs", "web", "tools", "tests", "docs", "scripts")
#: A path in the tree, as prose and code spans write one: `jobs/store/connect.py`.
PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
#: A dotted module path: `jobs.worker.loop.Worker`, `tools.bench.fleet`.
DOTTED = re.compile(r"(?<![\w./-])((?:scheduler|jobs|web|tools)(?:\.[A-Za-z_]\w*)+)")
#: A Markdown document named alone: README.md, CHANGELOG.md.
NAMED_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md)\b")
LINK = re.compile(r"\]\((?:<([^>]+)>|([^)\s]+))(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``."""
    return [angled or plain for angled, plain in LINK.findall(text)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _missing_path(text: str) -> list[str]:
    return [p for p in PATH.findall(text) if not (ROOT / p.rstrip("/")).exists()]


def _missing_module(dotted: str) -> bool:
    """True when ``dotted`` names nothing: its longest module prefix must exist,
    and the name after it (a class, a function) must be defined there."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        here = ROOT.joinpath(*parts[:i])
        module, package = here.with_suffix(".py"), here / "__init__.py"
        source = module if module.is_file() else package
        if source.is_file():
            return i < len(parts) and parts[i] not in _top_level_names(source)
    return True


def _top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for tgt in targets for n in ast.walk(tgt) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_in_the_docs_resolves(doc: Path) -> None:
    wrong = []
    for target in _links(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = (doc.parent / file).resolve() if file else doc
        if not where.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            wrong.append(f"{target}: no such heading")
    assert not wrong, f"{doc.name}: " + "; ".join(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = _missing_path(text)
    missing += [d for d in DOTTED.findall(text) if _missing_module(d)]
    assert not missing, f"{doc.name} names {missing}"


def _prose(path: Path) -> str:
    """A module's docstrings and comments: where it cites other files."""
    source = path.read_text()
    parts = [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (doc := ast.get_docstring(node))
    ]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    return "\n".join(parts)


MODULES = sorted(p for top in TOP for p in (ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_cites_a_file_that_does_not_exist(module: Path) -> None:
    prose = _prose(module)
    missing = _missing_path(prose)
    missing += [d for d in DOTTED.findall(prose) if _missing_module(d)]
    missing += [n for n in NAMED_DOC.findall(prose) if not (ROOT / n).exists()]
    assert not missing, f"{module.relative_to(ROOT)} cites {missing}"


def test_the_checks_catch_what_they_look_for() -> None:
    """The checks themselves: a stale path, module or anchor is found."""
    assert _missing_path("see jobs/engine.py and jobs/engine/llama.py") == ["jobs/engine.py"]
    assert _missing_module("jobs.engine.Vocab") and not _missing_module("jobs.engine.llama.Vocab")
    assert _missing_module("jobs.worker.loop.Wroker") and not _missing_module(
        "tools.bench.SAMPLING"
    )
    assert _links('[a](api.md#x) [b](<c d.md>) [e](f.md "title")') == [
        "api.md#x",
        "c d.md",
        "f.md",
    ]
    assert _figure_in("33 ms", "took 33 ms") and not _figure_in("3 ms", "took 33 ms")
    assert _slug("`parkq batch`: long documents") == "parkq-batch-long-documents"
    assert "settings" in _anchors(ROOT / "docs" / "operations.md")


def test_the_generated_settings_table_and_env_example_match_the_code() -> None:
    generated = 0
    for doc in DOCS:
        text = doc.read_text()
        generated += len(BLOCK.findall(text))
        assert render(text) == text, f"{doc.name} is stale: run scripts/gen_docs.py"
    assert generated >= 1
    assert (ROOT / ".env.example").read_text() == env_example(), "run scripts/gen_docs.py"


def test_the_metrics_table_lists_what_metrics_serves(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    page = client.get("/metrics").text
    served = set(re.findall(r"^# TYPE (parkq_\w+) \w+", page, re.M))
    assert served
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("## Metrics") :]
    table = table[: table.index("\n## ")]
    documented = set(re.findall(r"^\| `(parkq_\w+?)(?:\{[\w,]+\})?` \|", table, re.M))
    served = {re.sub(r"_total$", "", s) for s in served}
    documented = {re.sub(r"_total$", "", d) for d in documented}
    assert documented == served


def _figure_in(figure: str, text: str) -> bool:
    """``figure`` ("33 ms") stands in ``text`` as a figure of its own."""
    return re.search(r"(?<![\d.,])" + re.escape(figure) + r"(?!\w)", text) is not None


FIGURE = re.compile(r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?) ?(ms|s|tokens/s|tok/s)\b")


def test_every_figure_in_the_readme_is_in_the_benchmarks() -> None:
    readme = (ROOT / "README.md").read_text()
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    figures = {f"{n} {unit}" for n, unit in FIGURE.findall(readme)}
    assert figures, "the README shows what the demo measured"
    missing = [f for f in sorted(figures) if not _figure_in(f, benchmarks)]
    assert not missing, f"figures in the README but not in docs/benchmarks.md: {missing}"


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220
