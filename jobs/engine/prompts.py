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
starts with the end of one, or ends with the start of one); this is a lookup
in the vocabulary's control-token spellings, not a tokenization. A request
with no risky string (nearly all) gives exactly the ids of the whole rendered
prompt, tokenized once. Otherwise the template is rendered once more with each
risky string between markers (private-use characters, also found where a
template wrote the string as JSON: ``\\ue000``), which locate those strings in
the rendered prompt. The prompt is then tokenized as llama.cpp's special-token
parsing does it, but with only the template's control tokens as specials: the
text between two of them (template text and client text alike) is one piece
of plain text, so a request whose risky strings hold no control token gets the
same ids as the whole prompt, and one that holds some gets them as text. A
template that cuts, repeats or otherwise transforms such a string, so that the
markers do not come back in pairs, is refused rather than guessed at.

Only a message's ``role`` (validated to a few words) and the ``type`` of a tool
or tool call that is exactly ``"function"`` are left unmarked (templates
compare them); every other string, under any key, is client text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["ChatVocab", "Spellings", "TemplateError", "chat_ids", "spellings"]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: markers around client text
# A marker as written into the prompt, or as a template's JSON (``tojson``) writes it.
_MARK = re.compile(
    r"(?:\ue000|\\ue000)(\d+)(?:\ue000|\\ue000)|(?:\ue001|\\ue001)(\d+)(?:\ue001|\\ue001)"
)


class TemplateError(ValueError):
    """The chat template failed on the request's messages or tools (a field of
    a type or shape it did not expect, a ``raise_exception`` of its own): the
    request's fault, since the same template renders well-formed requests."""


def _render(
    vocab: ChatVocab, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[str, list[str]]:
    """``vocab.chat_prompt``, any error of the template's a :class:`TemplateError`.

    Whatever a template raises on a client's data (jinja2's UndefinedError or
    TemplateError, a TypeError of a filter, ...) is caught, not a list of the
    ones seen so far; only running out of memory is not the request's fault."""
    try:
        return vocab.chat_prompt(messages, tools)
    except MemoryError:
        raise
    except Exception as exc:
        text = str(exc).split("\n", 1)[0][:300]
        raise TemplateError(
            f"the chat template could not render the messages: {type(exc).__name__}: {text}"
        ) from exc


class ChatVocab(Protocol):
    def tokenize(
        self, text: str, *, add_bos: bool | None = None, special: bool = True
    ) -> list[int]: ...
    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[str]]: ...
    def control_texts(self) -> frozenset[str]: ...
    def control_strips(self) -> tuple[frozenset[str], frozenset[str]]: ...


class Spellings:
    """The spellings that special-token parsing turns into control tokens, and
    what may grow into one next to other text."""

    def __init__(self, texts: frozenset[str]) -> None:
        self.texts = sorted(t for t in texts if t)
        self.longest = max((len(t) for t in self.texts), default=0)
        self.prefixes = {t[:k] for t in self.texts for k in range(1, len(t))}
        self.suffixes = {t[k:] for t in self.texts for k in range(1, len(t))}
        #: Every piece of every spelling (a string this short, inside one, risks
        #: completing it with the template's text on both sides).
        self.pieces = {t[i:j] for t in self.texts for i in range(len(t))
                       for j in range(i + 1, len(t) + 1)}  # fmt: skip
        self.pattern = re.compile(_trie(self.texts)) if self.texts else None

    def risky(self, text: str) -> bool:
        """Whether ``text`` spells a control token, or could make one with the
        text around it."""
        if not text or self.pattern is None:
            return False
        if len(text) < self.longest and text in self.pieces:
            return True
        if self.pattern.search(text):
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
    prompt, stops = _render(vocab, messages, tools)
    spell = spellings(vocab.control_texts())
    request = {"messages": messages, "tools": tools}
    if not any(spell.risky(text) for text in _texts(request)):
        return vocab.tokenize(prompt, special=True), stops
    pieces = _segments(vocab, request, prompt, spell)
    return _tokenize(vocab, pieces, spell), stops


def _tag(path: tuple[Any, ...], value: str) -> bool:
    """Whether the string at ``path`` is a tag a template compares, not text: a
    message's role, or a tool's or tool call's type ``function``."""
    if len(path) == 3 and path[0] == "messages" and path[2] == "role":
        return True
    if value != "function":
        return False
    return (len(path) == 3 and path[0] == "tools" and path[2] == "type") or (
        len(path) == 5 and path[0] == "messages" and path[2] == "tool_calls" and path[4] == "type"
    )


def _texts(value: Any, path: tuple[Any, ...] = ()) -> Iterator[str]:
    """Every client string in ``value`` (dict keys too), tags (:func:`_tag`) left out."""
    if isinstance(value, str):
        if not _tag(path, value):
            yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield key
            yield from _texts(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _texts(item, (*path, i))


def _marked(
    value: Any, spell: Spellings, trim: bool, count: list[int], path: tuple[Any, ...] = ()
) -> Any:
    """``value`` with each risky client string (dict keys too) between numbered
    markers; tags (:func:`_tag`) are left as they are."""
    if isinstance(value, str):
        if _tag(path, value) or not spell.risky(value):
            return value
        i = count[0]
        count[0] += 1
        return f"{_OPEN}{i}{_OPEN}{value.strip() if trim else value}{_CLOSE}{i}{_CLOSE}"
    if isinstance(value, dict):
        return {
            (_marked(k, spell, trim, count) if isinstance(k, str) else k): _marked(
                v, spell, trim, count, (*path, k)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_marked(v, spell, trim, count, (*path, i)) for i, v in enumerate(value)]
    return value


def _tokenize(vocab: ChatVocab, pieces: list[tuple[str, bool]], spell: Spellings) -> list[int]:
    """The ids of the prompt cut into ``pieces``, as special-token parsing would
    give them with the template's control tokens as the only specials: the text
    between two of them is one piece of plain text; whitespace is stripped
    beside a token that strips it, as llama.cpp does."""
    assert spell.pattern is not None
    lstrip, rstrip = vocab.control_strips()
    ids: list[int] = []
    fragment = ""
    strip_next = False
    first = True

    def add(text: str) -> None:
        nonlocal fragment, strip_next
        if strip_next and not fragment:
            text = text.lstrip()
            strip_next = not text
        fragment += text

    def flush() -> None:
        nonlocal fragment, first, ids
        if fragment:
            ids += vocab.tokenize(fragment, add_bos=None if first else False, special=False)
            first = False
        fragment = ""

    for text, from_template in pieces:
        if not from_template:
            add(text)
            continue
        at = 0
        for match in spell.pattern.finditer(text):
            add(text[at : match.start()])
            token = match.group(0)
            if token in lstrip:
                fragment = fragment.rstrip()
            flush()
            ids += vocab.tokenize(token, add_bos=None if first else False, special=True)
            first = False
            strip_next = token in rstrip
            at = match.end()
        add(text[at:])
    flush()
    return ids


def _segments(
    vocab: ChatVocab, request: dict[str, Any], prompt: str, spell: Spellings
) -> list[tuple[str, bool]]:
    """``prompt`` cut into (text, comes from the template) pieces, in order."""
    if any(_OPEN in t or _CLOSE in t or _MARK.search(t) for t in _texts(request)):
        raise ValueError(
            "a request's text may not contain the characters U+E000 or U+E001 (nor their "
            "JSON escapes with a number) when it also holds a control token's text"
        )
    for trim in (False, True):
        marked = _marked(request, spell, trim, [0])
        rendered, _ = _render(vocab, marked["messages"], marked["tools"])
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
