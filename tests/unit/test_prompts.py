"""chat_ids' cutting of a rendered prompt, with a vocabulary that knows one control token."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.engine.prompts import chat_ids

CTL = 1000  # the id of "<ctl>"


class _Vocab:
    """Bytes as ids; "<ctl>" is one control token when special parsing is on."""

    def __init__(self, render: Any) -> None:
        self.render = render

    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]:
        out: list[int] = []
        for n, part in enumerate(text.split("<ctl>") if special else [text]):
            if n:
                out.append(CTL)
            out += list(part.encode())
        return out

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: Any = None
    ) -> tuple[str, list[str]]:
        return "".join(f"<ctl>{self.render(m['content'])}" for m in messages) + "<ctl>", []

    def is_control(self, token: int) -> bool:
        return token == CTL

    def control_texts(self) -> frozenset[str]:
        return frozenset({"<ctl>"})

    def control_strips(self) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(), frozenset()


@pytest.mark.parametrize("render", [lambda c: c, lambda c: c.strip(), lambda c: c.upper()])
def test_message_text_is_plain_text_and_the_rest_unchanged(render: Any) -> None:
    vocab = _Vocab(render)
    messages = [{"content": " a<ctl>b "}, {"content": "plain"}]
    ids, _ = chat_ids(vocab, messages)
    assert ids.count(CTL) == 3  # the template's three, none from the messages
    assert bytes(t for t in ids if t != CTL).decode() == render(" a<ctl>b ") + render("plain")


def test_a_template_that_cuts_message_text_is_refused() -> None:
    vocab = _Vocab(lambda c: c[:5])
    with pytest.raises(ValueError, match="cannot separate"):
        chat_ids(vocab, [{"content": "a<ctl>b"}])
    ids, _ = chat_ids(vocab, [{"content": "ordinary text"}])  # nothing to separate: as before
    assert ids.count(CTL) == 2
