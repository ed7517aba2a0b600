"""`parkq batch`: one result per document, however long the document.

A document that fits the model's context (after the instruction and room for
the answer) is one request. A longer one is cut into token windows that
overlap; each window is processed (map), and the partial results are
combined (reduce) as many times as needed until one result is left. Every
request runs at batch priority, so interactive traffic preempts it.

Results go to a JSONL file, one line per document, written as each document
completes; a second run skips the documents whose line is already there
(same content and same task).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tools.client import read_counter, retrying_session

__all__ = [
    "SUFFIXES",
    "Client",
    "DocumentError",
    "Task",
    "collect",
    "process",
    "run_batch",
    "windows",
]

SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst")

SUMMARIZE = "Summarize the following document in a few sentences."
#: Tokens kept free beside a window: chat template, instruction, part label.
MARGIN = 16


class DocumentError(Exception):
    """A document could not be processed (its message says why)."""


@dataclass(frozen=True)
class Task:
    instruction: str = SUMMARIZE
    max_tokens: int = 256
    overlap: int = 64
    temperature: float = 0.0
    seed: int = 0
    #: A JSON schema every answer follows (``parkq batch --schema``), or None: text.
    schema: dict[str, Any] | None = None

    def fingerprint(self) -> str:
        fields = [self.instruction, self.max_tokens, self.overlap, self.temperature, self.seed]
        if self.schema is not None:
            fields.append(self.schema)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def parse(self, answer: str, finish_reason: str | None) -> Any:
        """A document's final answer: the text, or (with a schema) the JSON value."""
        if self.schema is None:
            return answer
        if finish_reason == "length":
            raise DocumentError(
                f"the answer reached --max-tokens ({self.max_tokens}) before its JSON was "
                "complete; give a larger --max-tokens"
            )
        return json.loads(answer)

    def map_prompt(self, name: str, part: int, parts: int, text: str) -> str:
        if parts == 1:
            return f"{self.instruction}\n\n{text}"
        return (
            f"{self.instruction}\n\nThis is part {part} of {parts} of the document "
            f"{name}; answer for this part only.\n\n{text}"
        )

    def reduce_prompt(self, name: str, partials: list[str]) -> str:
        joined = "\n\n".join(f"Part {i}:\n{p.strip()}" for i, p in enumerate(partials, 1))
        return (
            f"{self.instruction}\n\nThe document {name} was processed in {len(partials)} "
            f"parts. Combine the results of the parts below into one answer for the whole "
            f"document.\n\n{joined}"
        )


class Client:
    """The few parkq routes `parkq batch` uses, with retries on 429 and lost connections."""

    def __init__(self, base_url: str, api_key: str | None = None, retries: int = 8) -> None:
        self.base = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = retrying_session(retries)
        self._context: int | None = None

    def post(self, path: str, body: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
        try:
            resp = self.http.post(
                self.base + path, json=body, headers=self.headers, timeout=(10, timeout)
            )
        except requests.ConnectionError as exc:
            raise DocumentError(f"cannot reach {self.base}: {exc}") from None
        if resp.status_code != 200:
            raise DocumentError(f"{path} answered {resp.status_code}: {_message(resp)}")
        result: dict[str, Any] = resp.json()
        return result

    def tokenize(self, text: str) -> list[int]:
        got = self.post("/v1/tokenize", {"text": text})
        self._context = int(got["context_length"])
        return [int(t) for t in got["tokens"]]

    def chat_tokens(self, content: str) -> int:
        got = self.post("/v1/tokenize", {"messages": [{"role": "user", "content": content}]})
        return int(got["count"])

    def detokenize(self, ids: list[int]) -> str:
        return str(self.post("/v1/detokenize", {"tokens": ids})["text"])

    @property
    def context(self) -> int:
        if self._context is None:
            self.tokenize("")
        assert self._context is not None
        return self._context

    def chat(self, content: str, task: Task) -> tuple[str, dict[str, Any]]:
        """One answer: its text and usage (with the choice's ``finish_reason``)."""
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": task.max_tokens,
            "temperature": task.temperature,
            "seed": task.seed,
            "priority": "batch",
        }
        if task.schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "result", "strict": True, "schema": task.schema},
            }
        got = self.post("/v1/chat/completions", body)
        choice = got["choices"][0]
        text = choice["message"]["content"] or ""
        return text, {**(got.get("usage") or {}), "finish_reason": choice.get("finish_reason")}

    def counter(self, name: str) -> float | None:
        """A counter from /metrics (None when it cannot be read)."""
        try:
            return read_counter(self.base, self.headers, name)
        except (requests.RequestException, ValueError):
            return None


def _message(resp: requests.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


def windows(n: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) token windows of at most ``size`` covering ``n`` tokens, each
    starting ``overlap`` tokens before the previous one ended."""
    if size <= overlap:
        raise ValueError("the window must be larger than the overlap")
    if n <= size:
        return [(0, n)]
    out, start = [], 0
    while True:
        end = min(n, start + size)
        out.append((start, end))
        if end == n:
            return out
        start = end - overlap


@dataclass
class Progress:
    """What the progress bar shows, updated from the worker threads."""

    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, usage: dict[str, Any]) -> None:
        with self.lock:
            self.tokens += int(usage.get("completion_tokens", 0))


def process(
    client: Client, name: str, text: str, task: Task, progress: Progress | None = None
) -> dict[str, Any]:
    """One document's result: map over its windows, then reduce to one answer."""
    counts = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    ended: list[str | None] = []  # each answer's finish_reason

    def call(content: str) -> str:
        answer, usage = client.chat(content, task)
        ended.append(usage.get("finish_reason"))
        counts["calls"] += 1
        counts["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
        counts["completion_tokens"] += int(usage.get("completion_tokens", 0))
        if progress is not None:
            progress.add(usage)
        return answer

    ids = client.tokenize(text)
    overhead = client.chat_tokens(task.map_prompt(name, 99, 99, "")) + MARGIN
    budget = client.context - task.max_tokens - overhead
    if budget <= task.overlap + 16:
        raise DocumentError(
            f"the context ({client.context} tokens) leaves no room for a part after the "
            f"instruction and {task.max_tokens} answer tokens"
        )
    parts = windows(len(ids), budget, task.overlap)
    if len(parts) == 1:
        partials = [call(task.map_prompt(name, 1, 1, text))]
    else:
        pieces = [client.detokenize(ids[a:b]) for a, b in parts]
        partials = [call(task.map_prompt(name, i, len(parts), p)) for i, p in enumerate(pieces, 1)]
    levels = 0
    while len(partials) > 1:
        levels += 1
        partials = [
            call(task.reduce_prompt(name, group)) for group in _groups(client, name, task, partials)
        ]
    return {
        "result": task.parse(partials[0], ended[-1]),
        "document_tokens": len(ids),
        "chunks": len(parts),
        "reduce_levels": levels,
        **counts,
    }


def _groups(client: Client, name: str, task: Task, partials: list[str]) -> list[list[str]]:
    """Consecutive groups of partial results, each fitting one reduce request.
    Every group has at least two members, so each reduce round shrinks the list."""
    limit = client.context - task.max_tokens - MARGIN
    groups: list[list[str]] = [[]]
    for p in partials:
        trial = groups[-1] + [p]
        if len(groups[-1]) >= 2 and client.chat_tokens(task.reduce_prompt(name, trial)) > limit:
            groups.append([p])
        else:
            groups[-1] = trial
    if len(groups) > 1 and len(groups[-1]) == 1:
        # A lone last result joins the group before; if that one is full, it
        # hands its own last result over instead.
        last, previous = groups.pop()[0], groups[-1]
        if len(previous) >= 3:
            groups.append([previous.pop(), last])
        else:
            previous.append(last)
    for group in groups:
        if client.chat_tokens(task.reduce_prompt(name, group)) > limit:
            raise DocumentError("two partial results do not fit one request; lower --max-tokens")
    return groups


def collect(paths: Iterable[Path]) -> list[Path]:
    """Text and Markdown files among ``paths`` and inside the folders among them."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(
                p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix.lower() in SUFFIXES
            )
        elif path.is_file():
            out.append(path)
        else:
            raise DocumentError(f"{path}: no such file or folder")
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]  # type: ignore[func-returns-value]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def done_before(out: Path, task: Task) -> dict[str, str]:
    """Documents (source path -> content digest) already in ``out`` for this task."""
    done: dict[str, str] = {}
    if not out.exists():
        return done
    # Lines end at "\n" only: the rows are written with ensure_ascii=False, so an
    # answer may hold U+0085, U+2028 or U+2029 raw (str.splitlines splits there).
    for line in out.read_text(encoding="utf-8").split("\n"):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by an interrupted run: that document runs again
        if isinstance(row, dict) and row.get("task") == task.fingerprint():
            done[str(row.get("source"))] = str(row.get("sha256"))
    return done


@dataclass
class BatchSummary:
    documents: int = 0
    skipped: int = 0
    completed: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    completion_tokens: int = 0
    seconds: float = 0.0
    preemptions: int | None = None


def run_batch(
    client: Client,
    paths: list[Path],
    task: Task,
    out: Path,
    parallel: int = 4,
    bar: Callable[[int, int], Callable[[int, int], None]] | None = None,
) -> BatchSummary:
    """Process every document not already in ``out``; append one line per result.

    ``bar(to_do, skipped)`` makes a progress display; what it returns is called
    every second and at each document's end with (documents ended, tokens generated).
    """
    summary = BatchSummary(documents=len(paths))
    done = done_before(out, task)
    todo: list[tuple[Path, bytes]] = []
    for path in paths:
        data = path.read_bytes()
        if done.get(str(path)) == _digest(data):
            summary.skipped += 1
        else:
            todo.append((path, data))
    progress = Progress()
    preempt0 = client.counter("parkq_preemptions_total")
    start = time.monotonic()
    write_lock = threading.Lock()
    update = bar(len(todo), summary.skipped) if bar else None

    def one(path: Path, data: bytes) -> None:
        t0 = time.time()
        text = data.decode("utf-8", errors="replace")
        result = process(client, path.name, text, task, progress)
        row = {
            "source": str(path),
            "sha256": _digest(data),
            "task": task.fingerprint(),
            **result,
            "started_at": round(t0, 3),
            "seconds": round(time.time() - t0, 3),
        }
        with write_lock, out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    out.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {pool.submit(one, p, d): p for p, d in todo}
        waiting = set(futures)
        while waiting:
            finished, waiting = wait(waiting, timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in finished:
                try:
                    fut.result()
                    summary.completed += 1
                except (DocumentError, OSError) as exc:
                    summary.failures.append((str(futures[fut]), str(exc)))
            if update is not None:
                update(summary.completed + len(summary.failures), progress.tokens)
    summary.seconds = time.monotonic() - start
    summary.completion_tokens = progress.tokens
    preempt1 = client.counter("parkq_preemptions_total")
    if preempt0 is not None and preempt1 is not None:
        summary.preemptions = int(preempt1 - preempt0)
    return summary
