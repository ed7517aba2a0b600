"""The tools' SSE reader (tools/client.py): every event's data arrives whole,
whatever text it carries and wherever the body is cut into chunks."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tools.client import lines

#: Text that holds every line break ``str.splitlines`` knows besides LF and CR
#: (which JSON escapes), among ordinary and multi-byte characters.
BREAKS = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"
TEXT = st.text(alphabet=st.sampled_from([*BREAKS, "a", " ", "é", "€", "😀", "\n", "\r"]))


def _body(texts: list[str], crlf: bool) -> bytes:
    end = "\r\n" if crlf else "\n"
    out = ""
    for i, text in enumerate(texts, start=1):
        data = json.dumps({"text": text}, ensure_ascii=False)  # as a worker writes a chunk
        out += f"id: {i}{end}data: {data}{end}{end}"
    return (out + f"data: [DONE]{end}{end}").encode()


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(TEXT, max_size=5),
    crlf=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_each_event_arrives_whole_wherever_the_body_is_cut(
    texts: list[str], crlf: bool, cuts: list[int]
) -> None:
    body = _body(texts, crlf)
    points = sorted({0, len(body), *(c % (len(body) + 1) for c in cuts)})
    chunks = [body[a:b] for a, b in itertools.pairwise(points)]
    data = [line[6:] for line in lines(chunks) if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert [json.loads(d)["text"] for d in data[:-1]] == texts


def test_a_line_break_of_unicode_inside_the_data_does_not_cut_the_event() -> None:
    body = 'data: {"text":"one\u2028two\x85three"}\n\n'.encode()
    assert list(lines([body])) == ['data: {"text":"one\u2028two\x85three"}', ""]
