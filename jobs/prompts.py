"""Chat prompts as token ids, with control tokens from the template only.

A chat template renders the messages (and tool definitions) into one text,
which holds the template's control tokens (``<start_of_turn>``,
``<end_of_turn>``, ...) as text. Tokenizing that whole text with special-token
parsing would also turn a user's ``"hi<end_of_turn>\\n<start_of_turn>model\\n..."``
into real control tokens: a user could forge another turn. So everything a
client sends (message text, names, tool calls and their arguments, tool
definitions, any extra field a template may render) is tokenized as plain
text, and only the template's own text is parsed for control tokens.

A client string is *risky* when it spells a control token, or could form one
with the template's text around it (it is part of a control token's text, or
starts with the end of one, or ends with the start of one); this is a search
of the vocabulary's control-token spellings, not a tokenization. A request
with no risky string (nearly all) gives exactly the ids of the whole rendered
prompt, tokenized once. Otherwise the template is rendered once more with each
risky string between markers (private-use characters, also found where a
template wrote the string as JSON: ``\\ue000``), which locate those strings in
the rendered prompt; the pieces between markers are tokenized as plain text.
A template that cuts, repeats or otherwise transforms such a string, so that
the markers do not come back in pairs, is refused rather than guessed at.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["Spellings", "chat_ids"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: markers around client text
# A marker as written into the prompt, or as a template's JSON (``tojson``) writes it.
_MARK = re.compile(
    r"(?:\ue000|\\ue000)(\d+)(?:\ue000|\\ue000)|(?:\ue001|\\ue001)(\d+)(?:\ue001|\\ue001)"
)
#: Fields whose value is not free text: validated to a few words (``role``) or a
#: fixed tag (a tool's and a tool call's ``type``), compared by templates.
_TAGS = ("role", "type")


class ChatVocab(Protocol):
    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]: ...
    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]: ...
    def control_texts(self) -> frozenset[str]: ...


class Spellings:
    """The spellings that special-token parsing turns into control tokens, and
    what may grow into one next to other text."""

    def __init__(self, texts: frozenset[str]) -> None:
        self.texts = sorted(t for t in texts if t)
        self.longest = max((len(t) for t in self.texts), default=0)
        self.prefixes = {t[:k] for t in self.texts for k in range(1, len(t))}
        self.suffixes = {t[k:] for t in self.texts for k in range(1, len(t))}
        self.pattern = re.compile(_trie(self.texts)) if self.texts else None

    def risky(self, text: str) -> bool:
        """Whether ``text`` spells a control token, or could make one with the
        text around it."""
        if not text or self.pattern is None:
            return False
        if self.pattern.search(text):
            return True
        if len(text) < self.longest and any(text in t for t in self.texts):
            return True
        edge = min(len(text), self.longest - 1)
        return any(text[:k] in self.suffixes or text[-k:] in self.prefixes
                   for k in range(1, edge + 1))  # fmt: skip


@functools.lru_cache(maxsize=8)
def spellings(texts: frozenset[str]) -> Spellings:
    return Spellings(texts)


def _trie(texts: list[str]) -> str:
    """A regular expression matching any of ``texts``, as a trie (one pass per
    position, whatever the number of texts)."""
    tree: dict[str, Any] = {}
    for text in texts:
        node = tree
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def walk(node: dict[str, Any]) -> str:
        options = [re.escape(ch) + walk(child) for ch, child in sorted(node.items()) if ch]
        if "" in node:
            options.append("")
        if len(options) == 1:
            return options[0]
        return "(?:" + "|".join(options) + ")"

    return walk(tree)


def chat_ids(
    vocab: ChatVocab, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[str]]:
    """The prompt's token ids and the template's stop strings.

    Raises ValueError when the template cannot render the messages, or renders
    a client's text in a way that cannot be told apart from its own.
    """
    prompt, stops = vocab.chat_prompt(messages, tools)
    spell = spellings(vocab.control_texts())
    request = {"messages": messages, "tools": tools}
    if not any(spell.risky(text) for text, _ in _texts(request)):
        return vocab.tokenize(prompt, special=True), stops
    ids: list[int] = []
    for n, (text, from_template) in enumerate(_segments(vocab, request, prompt, spell)):
        ids += vocab.tokenize(text, add_bos=None if n == 0 else False, special=from_template)
    return ids, stops


def _texts(value: Any, tag: bool = False) -> Iterator[tuple[str, bool]]:
    """Every client string in ``value`` (dict keys too): (text, is a tag value)."""
    if isinstance(value, str):
        yield value, tag
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield key, False
            yield from _texts(item, key in _TAGS)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def _marked(value: Any, spell: Spellings, trim: bool, count: list[int], tag: bool = False) -> Any:
    """``value`` with each risky client string between numbered markers."""
    if isinstance(value, str):
        if tag or not spell.risky(value):
            return value
        i = count[0]
        count[0] += 1
        return f"{_OPEN}{i}{_OPEN}{value.strip() if trim else value}{_CLOSE}{i}{_CLOSE}"
    if isinstance(value, dict):
        return {
            (_marked(k, spell, trim, count) if isinstance(k, str) else k): _marked(
                v, spell, trim, count, k in _TAGS
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_marked(v, spell, trim, count) for v in value]
    return value


def _segments(
    vocab: ChatVocab, request: dict[str, Any], prompt: str, spell: Spellings
) -> list[tuple[str, bool]]:
    """``prompt`` cut into (text, comes from the template) pieces, in order."""
    if any(_OPEN in t or _CLOSE in t or _MARK.search(t) for t, _ in _texts(request)):
        raise ValueError(
            "a request's text may not contain the characters U+E000 or U+E001 (nor their "
            "JSON escapes with a number) when it also holds a control token's text"
        )
    for trim in (False, True):
        marked = _marked(request, spell, trim, [0])
        rendered, _ = vocab.chat_prompt(marked["messages"], marked["tools"])
        if _MARK.sub("", rendered) != prompt:
            continue
        pieces = _split(rendered)
        if pieces is not None:
            return pieces
    raise ValueError(
        "the request holds a control token's text, and this chat template changes it in a "
        "way parkq cannot separate from the template's own control tokens"
    )


def _split(rendered: str) -> list[tuple[str, bool]] | None:
    """Template and client pieces of a marked rendering; None if the markers do not pair."""
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
