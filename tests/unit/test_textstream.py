from hypothesis import given
from hypothesis import strategies as st

from jobs.engine.textstream import StopMatcher, Utf8Decoder


def test_multibyte_character_is_held_until_complete() -> None:
    d = Utf8Decoder()
    data = "é日🙂".encode()
    out = [d.feed(bytes([b])) for b in data]
    assert "".join(out) == "é日🙂"
    assert out[0] == ""  # first byte of é alone is not emitted
    assert all(ch == "" or len(ch) == 1 for ch in out)


def test_invalid_bytes_become_replacement_characters() -> None:
    d = Utf8Decoder()
    assert d.feed(b"a\xffb") == "a\ufffdb"
    assert d.feed(b"\xe6\x97") == ""
    assert d.feed(b"", final=True) == "\ufffd"


@given(st.text(), st.lists(st.integers(1, 5), max_size=50))
def test_any_split_of_utf8_decodes_to_the_same_text(text, cuts) -> None:
    data = text.encode()
    d, out, i = Utf8Decoder(), [], 0
    for c in cuts:
        out.append(d.feed(data[i : i + c]))
        i += c
    out.append(d.feed(data[i:], final=True))
    assert "".join(out) == text


def test_stop_sequence_split_across_pieces() -> None:
    m = StopMatcher(("END",))
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dmore") == ("", True)


def test_false_start_is_released() -> None:
    m = StopMatcher(("END",))
    assert m.feed("EN") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.flush() == ""


@given(st.text(alphabet="abE ND", max_size=40), st.lists(st.integers(1, 4), max_size=40))
def test_stop_matcher_matches_whole_text_search(text, cuts) -> None:
    m = StopMatcher(("END", "bb"))
    out, i, stopped = [], 0, False
    pieces = []
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    for piece in pieces:
        emitted, stopped = m.feed(piece)
        out.append(emitted)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    hits = [j for s in ("END", "bb") if (j := text.find(s)) != -1]
    expected = text[: min(hits)] if hits else text
    assert "".join(out) == expected
    assert stopped == bool(hits)
