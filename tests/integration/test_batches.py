"""The Batch API through the official openai client, and `parkq batch` over a
folder of documents, against real `parkq up` processes with the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.conftest import TEST_ENV, Server, start_parkq, stop_parkq
from tests.integration.helpers import job, wait_until
from tools.client import read_counter

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me about the park."}
]


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _line(custom_id: str, content: str, **extra: Any) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def _run_batch(client: openai.OpenAI, path: Path) -> Any:
    with path.open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.2)


def test_openai_client_runs_a_batch_with_one_malformed_line(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    lines = [_line(f"q-{i}", f"Question number {i}", temperature=0, seed=i) for i in range(4)]
    lines.insert(1, '{"custom_id": "broken", "method": "POST", "url": ')
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    batch = _run_batch(client, path)
    assert batch.status in ("validating", "in_progress")  # answered before validation ends

    done = _wait_batch(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts.total == 5
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q-0", "q-1", "q-2", "q-3"]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "invalid_json_line"
    assert "Line 2" in errors[0]["error"]["message"]
    # A batch line gives what the same request gives when sent directly.
    direct = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Question number 2"}],
        max_tokens=12,
        temperature=0,
        seed=2,
    )
    body = out[2]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert direct.usage is not None
    assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    assert client.batches.list(limit=100).data[0].id == batch.id


def test_cancelling_a_batch_stops_its_running_and_waiting_jobs(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    lines = [_line(f"long-{i}", "x", max_tokens=3000, ignore_eos=True) for i in range(8)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines))
    batch = _run_batch(client, path)
    r = server.redis
    live = f"{{parkq}}:batch:{batch.id}:live"

    def running() -> list[str]:
        return [j for j in r.smembers(live) if r.hget(f"{{parkq}}:job:{j}", "state") == "running"]

    wait_until(lambda: bool(running()), timeout=60)
    jobs = set(r.smembers(live))
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    done = _wait_batch(client, batch.id, timeout=60)
    assert done.status == "cancelled" and done.output_file_id is None
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(e["custom_id"] for e in errors) == sorted(f"long-{i}" for i in range(8))
    for job_id in jobs:
        assert r.hget(f"{{parkq}}:job:{job_id}", "state") == "cancelled"
    assert not [j for j in r.zrange("{parkq}:queue", 0, -1) if j in jobs]
    # The engine is free again.
    quick = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert quick.choices[0].finish_reason in ("stop", "length")


def test_an_interactive_request_parks_a_running_batch_line_and_changes_nothing(
    client: openai.OpenAI, server: Server, tmp_path: Path
) -> None:
    # The preemption is forced: the question is sent once the batch line is seen
    # running, and the line is long enough to be running still (any machine's speed).
    request = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0.8, "seed": 7}
    path = tmp_path / "in.jsonl"
    path.write_text(_line("long", "Tell me everything.", **request) + "\n")
    batch = _run_batch(client, path)
    r = server.redis
    live = f"{{parkq}}:batch:{batch.id}:live"

    def running() -> list[str]:
        return [
            j
            for j in r.smembers(live)
            if r.hget(f"{{parkq}}:job:{j}", "state") == "running"
            and int(r.hget(f"{{parkq}}:job:{j}", "tokens") or 0) > 5
        ]

    wait_until(lambda: bool(running()), timeout=60)
    (job_id,) = running()
    quick = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"priority": "interactive"}
    )
    assert quick.choices[0].finish_reason in ("stop", "length")
    done = _wait_batch(client, batch.id)
    assert done.status == "completed"
    assert job(server.base_url, job_id)["preemptions"] >= 1
    (line,) = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    direct = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me everything."}],
        max_tokens=3000,
        temperature=0.8,
        seed=7,
        extra_body={"ignore_eos": True, "priority": "batch"},
    )
    assert line["response"]["body"]["choices"][0]["message"]["content"] == (
        direct.choices[0].message.content
    )


# -- parkq batch ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tiny_model: Path) -> Iterator[str]:
    """A parkq with a 512-token context, so that documents are easily "long"."""
    proc, base = start_parkq(tiny_model, None, env={**TEST_ENV, "PARKQ_N_CTX": "512"})
    yield base
    stop_parkq(proc)


WORDS = "the park queue holds long documents while short questions go first".split()  # noqa: SIM905


def _document(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    (docs / "nested").mkdir(parents=True)
    for i in range(4):
        (docs / f"note-{i}.txt").write_text(_document(40 + 10 * i, i))
    (docs / "nested" / "readme.md").write_text("# Title\n\n" + _document(60, 9))
    (docs / "long.md").write_text(_document(2200, 5))  # over ten times the 512-token context
    (docs / "image.png").write_bytes(b"\x89PNG not a document")
    return docs


def _parkq_batch(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", "batch", *map(str, args), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PARKQ_LOG_LEVEL": "WARNING"},
    )


@pytest.mark.timeout(600)
def test_parkq_batch_processes_a_folder_and_a_rerun_does_nothing(
    small: str, folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    stop = threading.Event()
    answers: list[str] = []

    def interactive() -> None:
        # Short questions during the batch are answered (whether one preempts a
        # batch job depends on the machine's speed: the test above forces that).
        while not stop.is_set():
            resp = requests.post(
                f"{small}/v1/completions",
                json={"prompt": "Q: quick?", "max_tokens": 4, "priority": "interactive"},
                timeout=60,
            )
            answers.append(resp.json()["choices"][0]["finish_reason"])
            time.sleep(0.1)

    thread = threading.Thread(target=interactive)
    thread.start()
    try:
        run = _parkq_batch(folder, "--url", small, "--out", out, "--max-tokens", "24")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert run.returncode == 0, run.stderr
    rows = {Path(r["source"]).name: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["long.md", "note-0.txt", "note-1.txt", "note-2.txt", "note-3.txt",
                            "readme.md"]  # fmt: skip
    for name, row in rows.items():
        assert isinstance(row["result"], str), name
        assert row["completion_tokens"] > 0 and row["seconds"] > 0
    long = rows["long.md"]
    assert long["document_tokens"] > 10 * 512
    assert long["chunks"] >= 10 and long["reduce_levels"] >= 1
    assert long["calls"] > long["chunks"]
    assert rows["note-0.txt"]["chunks"] == 1 and rows["note-0.txt"]["calls"] == 1
    assert answers and set(answers) <= {"stop", "length"}

    tokens0 = read_counter(small, {}, "parkq_tokens_generated_total")
    again = _parkq_batch(folder, "--url", small, "--out", out, "--max-tokens", "24")
    assert again.returncode == 0, again.stderr
    assert "0 done, 6 already done" in again.stderr
    assert len(out.read_text().splitlines()) == 6
    assert read_counter(small, {}, "parkq_tokens_generated_total") == tokens0

    # A changed document runs again; the others are still skipped.
    (folder / "note-1.txt").write_text(_document(30, 3))
    third = _parkq_batch(folder, "--url", small, "--out", out, "--max-tokens", "24")
    assert third.returncode == 0 and "1 done, 5 already done" in third.stderr


def test_parkq_batch_lists_failures_and_exits_non_zero(
    small: str, folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    run = _parkq_batch(folder / "note-0.txt", "--url", small, "--out", out, "--max-tokens", "600")
    assert run.returncode == 1
    assert "failed: " in run.stderr and "note-0.txt" in run.stderr
    assert not out.exists() or out.read_text() == ""


@pytest.mark.timeout(300)
def test_parkq_batch_starts_its_own_parkq_without_url(
    tiny_model: Path, folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "results.jsonl"
    run = _parkq_batch(
        folder / "note-0.txt", folder / "nested", "--model", tiny_model, "--out", out,
        "--max-tokens", "8",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert len(out.read_text().splitlines()) == 2


NOTE_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 12},
        "important": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["topic", "important", "score"],
    "additionalProperties": False,
}


@pytest.mark.timeout(600)
def test_parkq_batch_with_a_schema_gives_each_document_a_valid_object(
    small: str, folder: Path, tmp_path: Path
) -> None:
    import jsonschema

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(NOTE_SCHEMA))
    out = tmp_path / "results.jsonl"
    run = _parkq_batch(folder, "--url", small, "--out", out, "--schema", schema,
                       "--max-tokens", "80", "--temperature", "0.7")  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        jsonschema.validate(row["result"], NOTE_SCHEMA)
    assert any(row["reduce_levels"] >= 1 for row in rows)  # the long one, reduced as JSON too

    broken = tmp_path / "broken.json"
    broken.write_text('{"type": "object", "properties": {"a": {"type": "nonsense"}}}')
    bad = _parkq_batch(folder, "--url", small, "--out", out, "--schema", broken)
    assert bad.returncode != 0
    assert "Invalid type" in bad.stderr and "Traceback" not in bad.stderr


def test_a_file_as_producers_write_it_with_one_refused_line(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    """A BOM, CRLF, a raw U+2028 inside a string (JSON.stringify's), no last
    newline, and one line the endpoint refuses (a logit_bias key '²', once a
    failed batch): 3 lines run, the refused one is one error line."""
    good = [_line(f"q-{i}", f"Question\u2028{i}\u2029", temperature=0) for i in range(3)]
    good = [json.dumps(json.loads(x), ensure_ascii=False) for x in good]
    bad = _line("bias", "Hi", logit_bias={"²": 1})
    path = tmp_path / "producer.jsonl"
    path.write_bytes(("\ufeff" + "\r\n".join([good[0], bad, good[1], "", good[2]])).encode())
    done = _wait_batch(client, _run_batch(client, path).id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (4, 3)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.split("\n") if x]
    assert [x["custom_id"] for x in out] == ["q-0", "q-1", "q-2"]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.split("\n") if x]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("bias", "invalid_request")]
