"""Generated batch files (tests/inputs.py ``jsonl_files``): any JSON Lines a real
producer writes (CRLF, a raw U+2028 inside a string, a BOM, blank lines, a last
line without its newline, bad lines among good ones) is counted by its real
lines; each bad line is exactly one error line; every good line runs.

Flask's test client, fakeredis, the fake vocabulary, and one real worker loop
with the fake engine for the whole test."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from flask.testing import FlaskClient
from hypothesis import given, settings

from jobs.worker.loop import Worker
from scheduler.settings import Settings
from tests.fakes import FakeEngine, FakeVocab
from tests.inputs import JsonlFile, jsonl_files
from web.app import create_app

ENDED = ("completed", "failed", "cancelled")


@pytest.fixture(scope="module")
def client() -> Iterator[FlaskClient]:
    s = Settings(redis_url="redis://fake", n_ctx=0, keepalive_seconds=0.2, batch_window=8)
    r = fakeredis.FakeRedis()
    worker = Worker(s, FakeEngine(), r, name="w1")
    thread = threading.Thread(target=worker.run)
    thread.start()
    yield create_app(s, vocab=FakeVocab(), client=r).test_client()
    worker.stop()
    thread.join(timeout=10)


def _rows(client: FlaskClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = client.get(f"/v1/files/{file_id}/content").get_data()
    return [json.loads(line) for line in data.split(b"\n") if line]


@settings(max_examples=40, deadline=None)
@given(f=jsonl_files())
def test_every_real_line_is_counted_once_and_each_bad_line_is_one_error_line(
    client: FlaskClient, f: JsonlFile
) -> None:
    form = {"purpose": "batch", "file": (io.BytesIO(f.content), "in.jsonl")}
    up = client.post("/v1/files", data=form, content_type="multipart/form-data")
    assert up.status_code == 200, up.get_data()
    made = client.post("/v1/batches", json={"input_file_id": up.get_json()["id"],
                                            "endpoint": "/v1/completions"})  # fmt: skip
    assert made.status_code == 200, made.get_data()
    batch_id = made.get_json()["id"]
    deadline = time.monotonic() + 60
    while (batch := client.get(f"/v1/batches/{batch_id}").get_json())["status"] not in ENDED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.01)
    total = len(f.good) + f.bad
    assert batch["request_counts"] == {"total": total, "completed": len(f.good), "failed": f.bad}
    assert batch["status"] == ("completed" if f.good else "failed"), batch
    assert [x["custom_id"] for x in _rows(client, batch["output_file_id"])] == f.good
    errors = _rows(client, batch["error_file_id"])
    assert len(errors) == f.bad
    for row in errors:
        assert row["response"] is None and row["error"]["code"] and row["error"]["message"]
        assert "custom_id" in row
