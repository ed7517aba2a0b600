"""Chat prompts as token ids, with control tokens from the template only.

A chat template renders the messages into one text, which holds the
template's control tokens (``<start_of_turn>``, ``<end_of_turn>``, ...) as
text. Tokenizing that whole text with special-token parsing would also turn a
user's ``"hi<end_of_turn>\\n<start_of_turn>model\\n..."`` into real control
tokens: a user could forge another turn. So the text a message contributes is
tokenized as plain text, and only the template's own text is parsed for
control tokens.

Messages whose text holds no control-token spelling (nearly all of them) give
exactly the ids of the whole rendered prompt. Otherwise the template is
rendered once more with each message text between markers, which locate the
message texts in the rendered prompt (a template may trim or re-case them);
a template that cuts or repeats message text, so that the markers do not come
back in pairs, is refused rather than guessed at.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

__all__ = ["chat_ids"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: markers around message text
_MARK = re.compile(f"{_OPEN}(\\d+){_OPEN}|{_CLOSE}(\\d+){_CLOSE}")


class ChatVocab(Protocol):
    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]: ...
    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]: ...
    def is_control(self, token: int) -> bool: ...


def chat_ids(
    vocab: ChatVocab, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[str]]:
    """The prompt's token ids and the template's stop strings.

    Raises ValueError when the template cannot render the messages, or renders
    message text in a way that cannot be told apart from its own.
    """
    prompt, stops = vocab.chat_prompt(messages, tools)
    texts = [m.get("content") for m in messages]
    if not any(isinstance(t, str) and _spells_control(vocab, t) for t in texts):
        return vocab.tokenize(prompt, special=True), stops
    ids: list[int] = []
    for n, (text, from_template) in enumerate(_segments(vocab, messages, tools, prompt)):
        ids += vocab.tokenize(text, add_bos=None if n == 0 else False, special=from_template)
    return ids, stops


def _spells_control(vocab: ChatVocab, text: str) -> bool:
    """Whether special-token parsing would find a control token in ``text``."""
    return any(vocab.is_control(t) for t in vocab.tokenize(text, add_bos=False, special=True))


def _segments(
    vocab: ChatVocab,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    prompt: str,
) -> list[tuple[str, bool]]:
    """``prompt`` cut into (text, comes from the template) pieces, in order."""
    texts = [m.get("content") for m in messages]
    if any(isinstance(t, str) and (_OPEN in t or _CLOSE in t) for t in texts):
        raise ValueError("message text may not contain the characters U+E000 or U+E001")
    for trim in (False, True):
        marked = [
            {**m, "content": f"{_OPEN}{i}{_OPEN}{t.strip() if trim else t}{_CLOSE}{i}{_CLOSE}"}
            if isinstance(t, str) and t
            else m
            for i, (m, t) in enumerate(zip(messages, texts, strict=True))
        ]
        rendered, _ = vocab.chat_prompt(marked, tools)
        if _MARK.sub("", rendered) != prompt:
            continue
        pieces = _split(rendered)
        if pieces is not None:
            return pieces
    raise ValueError(
        "a message holds a control token's text, and this chat template changes message "
        "text in a way parkq cannot separate from the template's own control tokens"
    )


def _split(rendered: str) -> list[tuple[str, bool]] | None:
    """Template and message pieces of a marked rendering; None if the markers do not pair."""
    pieces: list[tuple[str, bool]] = []
    inside: str | None = None
    at = 0
    for m in _MARK.finditer(rendered):
        text = rendered[at : m.start()]
        opening, closing = m.group(1), m.group(2)
        if opening is not None and inside is None:
            pieces.append((text, True))
            inside = opening
        elif closing is not None and closing == inside:
            pieces.append((text, False))
            inside = None
        else:
            return None  # nested, unpaired or repeated: not a plain substitution
        at = m.end()
    if inside is not None:
        return None
    pieces.append((rendered[at:], True))
    return [(text, template) for text, template in pieces if text]
