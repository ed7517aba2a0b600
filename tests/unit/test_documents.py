"""Token windows of long documents, durations of the soak."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tools.documents import Task, done_before, windows
from tools.soak import parse_duration


@given(
    n=st.integers(min_value=0, max_value=5000),
    size=st.integers(min_value=2, max_value=600),
    data=st.data(),
)
def test_windows_cover_the_document_with_the_overlap(
    n: int, size: int, data: st.DataObject
) -> None:
    overlap = data.draw(st.integers(min_value=0, max_value=size - 1))
    parts = windows(n, size, overlap)
    assert parts[0][0] == 0 and parts[-1][1] == n
    for start, end in parts:
        assert 0 < end - start <= size or n == 0
    for (_, end), (start, _) in itertools.pairwise(parts):
        assert end - start == overlap  # consecutive parts share exactly the overlap
    if n <= size:
        assert parts == [(0, n)]


def test_windows_need_room_beyond_the_overlap() -> None:
    with pytest.raises(ValueError):
        windows(100, 10, 10)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("10m", 600), ("1.5h", 5400), (" 2m ", 120)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "5d", "-3s"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@given(text=st.text())
@example(text="\x85").via("U+0085, which str.splitlines splits at")
@example(text="a\u2028b\u2029c").via("the line and paragraph separators")
def test_a_document_done_is_known_whatever_its_answer_holds(tmp_path_factory, text: str) -> None:
    """A rerun skips the documents whose rows are in the output, whatever
    characters their answers hold (line and paragraph separators included)."""
    out = tmp_path_factory.mktemp("out") / "results.jsonl"
    task = Task()
    rows = [
        {"source": f"doc{i}.txt", "sha256": f"d{i}", "task": task.fingerprint(), "answer": text}
        for i in range(2)
    ]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + '{"cut')
    assert done_before(out, task) == {"doc0.txt": "d0", "doc1.txt": "d1"}
