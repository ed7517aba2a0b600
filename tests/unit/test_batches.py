"""The Files and Batch API with Flask's test client, fakeredis, the fake engine
and a real worker loop."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import fakeredis
import pytest
from flask.testing import FlaskClient

from jobs.store.batches import BatchStore
from jobs.worker.loop import Worker
from scheduler.settings import Settings
from tests.fakes import FakeEngine, FakeVocab
from web.app import create_app


@pytest.fixture
def bsettings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"batch_window": 2, "batch_max_lines": 20, "batch_max_file_bytes": 4000}
    )


@pytest.fixture
def client(bsettings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    return create_app(bsettings, vocab=FakeVocab(), client=fake_redis).test_client()


def _line(custom_id: str, text: str, url: str = "/v1/chat/completions") -> str:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _upload(client: FlaskClient, lines: list[str], purpose: str = "batch") -> Any:
    data = {"purpose": purpose, "file": (io.BytesIO("\n".join(lines).encode()), "in.jsonl")}
    return client.post("/v1/files", data=data, content_type="multipart/form-data")


def _create(client: FlaskClient, file_id: str, endpoint: str = "/v1/chat/completions") -> Any:
    return client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"},
    )


def _wait_status(client: FlaskClient, batch_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = client.get(f"/v1/batches/{batch_id}").get_json()
        if body["status"] in statuses:
            return dict(body)
        time.sleep(0.02)
    raise AssertionError(f"batch never reached {statuses}: {body}")


def _jsonl(client: FlaskClient, file_id: str) -> list[dict[str, Any]]:
    resp = client.get(f"/v1/files/{file_id}/content")
    assert resp.status_code == 200
    return [json.loads(x) for x in resp.get_data(as_text=True).splitlines()]


def test_a_batch_runs_every_valid_line_and_reports_the_invalid_ones(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, bsettings: Settings
) -> None:
    lines = [_line(f"req-{i}", f"hello {i}") for i in range(6)]
    lines.insert(2, "{not json")
    lines.append(_line("req-1", "a second req-1"))
    lines.append(_line("req-x", "wrong url", url="/v1/completions"))
    up = _upload(client, lines)
    assert up.status_code == 200, up.get_json()
    file_obj = up.get_json()
    assert file_obj["object"] == "file" and file_obj["purpose"] == "batch"
    assert file_obj["bytes"] == len("\n".join(lines).encode())

    created = _create(client, file_obj["id"])
    assert created.status_code == 200, created.get_json()
    assert created.get_json()["status"] in ("validating", "in_progress")  # answered at once
    batch = _wait_status(client, created.get_json()["id"], {"in_progress"})
    assert batch["request_counts"]["total"] == 9
    # Only the window is in the queue: a big batch neither fills it nor ages ahead.
    assert fake_redis.zcard(bsettings.keys.queue) == 2

    w = Worker(bsettings, FakeEngine(), fake_redis, name="w1")
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        done = _wait_status(client, batch["id"], {"completed", "failed"})
    finally:
        w.stop()
        thread.join(timeout=10)
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 9, "completed": 6, "failed": 3}
    out = _jsonl(client, done["output_file_id"])
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(6)]
    for row in out:
        assert row["error"] is None
        assert row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 4
        assert isinstance(body["choices"][0]["message"]["content"], str)
    errors = {(x["custom_id"], x["error"]["code"]) for x in _jsonl(client, done["error_file_id"])}
    assert errors == {
        (None, "invalid_json_line"),
        ("req-1", "duplicate_custom_id"),
        ("req-x", "mismatched_url"),
    }
    # Listed, and still there for a new web process reading the same Redis.
    again = create_app(bsettings, vocab=FakeVocab(), client=fake_redis).test_client()
    assert again.get(f"/v1/batches/{batch['id']}").get_json()["status"] == "completed"
    listed = again.get("/v1/batches?limit=5").get_json()
    assert [b["id"] for b in listed["data"]] == [batch["id"]]


def test_batch_lines_run_at_batch_priority_behind_interactive_requests(
    client: FlaskClient, fake_redis: fakeredis.FakeRedis, bsettings: Settings
) -> None:
    file_id = _upload(client, [_line(f"r{i}", "x") for i in range(3)]).get_json()["id"]
    _wait_status(client, _create(client, file_id).get_json()["id"], {"in_progress"})
    resp = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    resp.close()
    head = fake_redis.zrange(bsettings.keys.queue, 0, 0)[0].decode()
    assert head.startswith("chatcmpl-")
    for job_id in fake_redis.zrange(bsettings.keys.queue, 1, -1):
        assert fake_redis.hget(bsettings.keys.job(job_id.decode()), "priority") == b"0"


def test_cancelling_a_batch_cancels_its_queued_and_pending_lines(client: FlaskClient) -> None:
    file_id = _upload(client, [_line(f"r{i}", "x") for i in range(5)]).get_json()["id"]
    batch = _wait_status(client, _create(client, file_id).get_json()["id"], {"in_progress"})
    resp = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert resp.status_code == 200
    done = _wait_status(client, batch["id"], {"cancelled"})
    assert done["cancelled_at"] and done["output_file_id"] is None
    rows = _jsonl(client, done["error_file_id"])
    assert sorted(x["custom_id"] for x in rows) == [f"r{i}" for i in range(5)]
    assert {x["error"]["code"] for x in rows} == {"batch_cancelled"}
    again = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 409


def test_a_file_of_only_invalid_lines_fails_the_batch(client: FlaskClient) -> None:
    file_id = _upload(client, ['{"custom_id": "a"}', "[1, 2]"]).get_json()["id"]
    batch = _wait_status(client, _create(client, file_id).get_json()["id"], {"failed"})
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert [e["line"] for e in batch["errors"]["data"]] == [1, 2]
    assert len(_jsonl(client, batch["error_file_id"])) == 2


def test_a_failed_batch_is_read_while_its_error_file_is_written(
    client: FlaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between "failed" and its counts and files (written under a lock, maybe
    by a process that died) a read answers "finalizing" with the counts it can
    derive: a client that sees the batch ended finds its files there."""
    monkeypatch.setattr(BatchStore, "lock", lambda self, batch_id: False)  # held elsewhere
    file_id = _upload(client, ['{"custom_id": "a"}']).get_json()["id"]
    batch_id = _create(client, file_id).get_json()["id"]
    batch = _wait_status(client, batch_id, {"finalizing", "failed"})
    assert batch["status"] == "finalizing"
    assert batch["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    assert batch["error_file_id"] is None
    monkeypatch.undo()  # the lock is free again: the next read writes the file
    batch = client.get(f"/v1/batches/{batch_id}").get_json()
    assert batch["status"] == "failed"
    assert len(_jsonl(client, batch["error_file_id"])) == 1


@pytest.mark.parametrize(
    ("lines", "purpose", "status", "param"),
    [
        ([_line("a", "x" * 5000)], "batch", 413, None),
        ([_line(f"r{i}", "x") for i in range(21)], "batch", 400, "file"),
        ([_line("a", "x")], "fine-tune", 400, "purpose"),
        ([""], "batch", 400, "file"),
    ],
)
def test_file_limits_give_clear_errors(
    client: FlaskClient, lines: list[str], purpose: str, status: int, param: str | None
) -> None:
    resp = _upload(client, lines, purpose)
    assert resp.status_code == status
    err = resp.get_json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert client.get("/v1/files").get_json()["data"] == []


def test_bad_batch_requests_are_refused_and_leave_nothing(client: FlaskClient) -> None:
    file_id = _upload(client, [_line("a", "x")]).get_json()["id"]
    for body, param in [
        ({"input_file_id": file_id, "endpoint": "/v1/embeddings"}, "endpoint"),
        (
            {
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "soon",
            },
            "completion_window",
        ),
        ({"input_file_id": "file_nope", "endpoint": "/v1/chat/completions"}, "file_id"),
        ({"endpoint": "/v1/chat/completions"}, "input_file_id"),
    ]:
        resp = client.post("/v1/batches", json=body)
        assert resp.status_code in (400, 404), body
        assert resp.get_json()["error"]["param"] == param
    assert client.get("/v1/batches").get_json()["data"] == []
    assert client.get("/v1/batches/batch_nope").status_code == 404


def test_files_can_be_read_listed_and_deleted(client: FlaskClient) -> None:
    file_obj = _upload(client, [_line("a", "x")]).get_json()
    assert client.get(f"/v1/files/{file_obj['id']}").get_json() == file_obj
    assert [f["id"] for f in client.get("/v1/files").get_json()["data"]] == [file_obj["id"]]
    assert client.get(f"/v1/files/{file_obj['id']}/content").get_data(as_text=True) == _line(
        "a", "x"
    )
    assert client.delete(f"/v1/files/{file_obj['id']}").get_json()["deleted"] is True
    assert client.get(f"/v1/files/{file_obj['id']}").status_code == 404
    assert client.delete(f"/v1/files/{file_obj['id']}").status_code == 404


def test_tokenize_and_detokenize_round_trip(client: FlaskClient) -> None:
    got = client.post("/v1/tokenize", json={"text": "héllo"}).get_json()
    assert got["count"] == len("héllo".encode()) and got["context_length"] == 256
    back = client.post("/v1/detokenize", json={"tokens": got["tokens"][:2]}).get_json()
    assert back["text"] == "h\ufffd"  # a token boundary inside a character
    chat = client.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.get_json()["count"] == len("<user>hi\n<assistant>")
    assert client.post("/v1/tokenize", json={}).status_code == 400
    assert client.post("/v1/detokenize", json={"tokens": [10**6]}).status_code == 400


def _run_unread(
    settings: Settings, fake_redis: fakeredis.FakeRedis, batch_id: str, lines: int
) -> list[Any]:
    """Wait for the batch's ``lines`` lines to be validated, then run them all on
    a worker, with no one reading the batch; its items."""
    from jobs.store.batches import BatchStore
    from jobs.store.scheduling import Store

    batches = BatchStore(Store(fake_redis, settings))
    deadline = time.monotonic() + 30
    while len(items := list(batches.items(batch_id))) < lines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    w = Worker(settings, FakeEngine(), fake_redis, name="w1")
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while batches.states(items) != ["finished"] * lines:
            assert time.monotonic() < deadline, batches.states(items)
            time.sleep(0.02)
    finally:
        w.stop()
        thread.join(timeout=10)
    return items


def test_a_batchs_results_outlive_the_result_ttl_until_its_output_is_written(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:

    settings = bsettings.model_copy(update={"result_ttl": 1})
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    up = _upload(client, [_line(f"r{i}", f"hello {i}") for i in range(3)])
    batch = _create(client, up.get_json()["id"]).get_json()
    items = _run_unread(settings, fake_redis, batch["id"], 3)
    time.sleep(1.5)  # past the result TTL of every line
    done = _wait_status(client, batch["id"], {"completed", "failed"})
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert [x["custom_id"] for x in _jsonl(client, done["output_file_id"])] == ["r0", "r1", "r2"]
    # Written out: now the lines' results expire like any job's.
    assert 0 < fake_redis.ttl(settings.keys.job(items[0].job)) <= 1


def test_a_batch_is_answered_at_once_and_validated_beside_other_requests(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation runs in a thread of its own: the create request does not wait for
    it, and a batch cancelled while it is validated never runs a line."""
    import web.batches

    gate = threading.Event()
    line_job = web.batches._line_job

    def slow_line_job(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(timeout=30)  # held until the test lets validation go on
        return line_job(*args, **kwargs)

    monkeypatch.setattr(web.batches, "_line_job", slow_line_job)
    client = create_app(bsettings, vocab=FakeVocab(), client=fake_redis).test_client()
    file_id = _upload(client, [_line(f"r{i}", "x") for i in range(4)]).get_json()["id"]
    created = _create(client, file_id).get_json()
    assert created["status"] == "validating"
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    # Other requests are served meanwhile.
    assert client.get("/v1/models").status_code == 200
    assert client.get(f"/v1/batches/{created['id']}").get_json()["status"] == "validating"
    assert client.post(f"/v1/batches/{created['id']}/cancel").status_code == 200
    gate.set()
    done = _wait_status(client, created["id"], {"cancelled"})
    assert done["status"] == "cancelled"
    time.sleep(0.3)  # let the validator finish its last writes
    assert fake_redis.zcard(bsettings.keys.queue) == 0  # no line was ever queued
    assert client.get(f"/v1/batches/{created['id']}").get_json()["status"] == "cancelled"


def test_an_ended_batch_is_kept_for_its_retention_then_forgotten(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    settings = bsettings.model_copy(update={"batch_retention_seconds": 60})
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    file_id = _upload(client, ['{"custom_id": "a"}']).get_json()["id"]  # fails at once
    batch = _wait_status(client, _create(client, file_id).get_json()["id"], {"failed"})
    assert 0 < fake_redis.ttl(settings.keys.batch(batch["id"])) <= 60
    assert 0 < fake_redis.ttl(settings.keys.batch_invalid(batch["id"])) <= 60
    fake_redis.delete(settings.keys.batch(batch["id"]))  # as its expiry will
    listed = client.get("/v1/batches").get_json()
    assert listed["data"] == [] and fake_redis.zcard(settings.keys.batches) == 0
    # Its error file expires with it; the uploaded input with its own TTL (30 days).
    error_file = client.get(f"/v1/files/{batch['error_file_id']}").get_json()
    assert 0 < error_file["expires_at"] - time.time() <= 61
    assert 0 < fake_redis.ttl(settings.keys.file_content(batch["error_file_id"])) <= 61
    assert fake_redis.ttl(settings.keys.file(file_id)) > 60
    fake_redis.delete(settings.keys.file(batch["error_file_id"]))  # as its expiry will
    listed_files = client.get("/v1/files").get_json()["data"]
    assert [f["id"] for f in listed_files] == [file_id]


def test_an_uploaded_file_expires_and_the_uploads_have_a_quota(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    settings = bsettings.model_copy(update={"file_ttl_seconds": 3600, "files_max_bytes": 600})
    client = create_app(settings, vocab=FakeVocab(), client=fake_redis).test_client()
    first = _upload(client, [_line("a", "x" * 100), _line("b", "y" * 100)])
    assert first.status_code == 200
    meta = first.get_json()
    assert meta["expires_at"] - time.time() == pytest.approx(3600, abs=5)
    keys = settings.keys
    for key in (keys.file(meta["id"]), keys.file_content(meta["id"])):
        assert 0 < fake_redis.ttl(key) <= 3600
    # The next upload would pass the quota: refused, nothing stored.
    over = _upload(client, [_line("c", "z" * 100), _line("d", "w" * 100)])
    assert over.status_code == 413
    assert over.get_json()["error"]["code"] == "files_quota_exceeded"
    listed = client.get("/v1/files").get_json()["data"]
    assert [f["id"] for f in listed] == [meta["id"]]
    # Deleting the first frees its bytes.
    assert client.delete(f"/v1/files/{meta['id']}").status_code == 200
    assert _upload(client, [_line("c", "z" * 100), _line("d", "w" * 100)]).status_code == 200


def test_a_line_whose_result_cannot_be_read_is_an_error_line_not_a_failed_batch(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from web import batches as web_batches

    monkeypatch.setattr(web_batches, "FINALIZE_CHUNK", 2)  # the output written in pieces
    client = create_app(bsettings, vocab=FakeVocab(), client=fake_redis).test_client()
    up = _upload(client, [_line(f"r{i}", f"hello {i}") for i in range(5)])
    batch = _create(client, up.get_json()["id"]).get_json()
    items = _run_unread(bsettings, fake_redis, batch["id"], 5)
    fake_redis.hset(bsettings.keys.job(items[3].job), "request", "{not json")
    done = _wait_status(client, batch["id"], {"completed", "failed"})
    assert done["status"] == "completed"
    assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
    out = _jsonl(client, done["output_file_id"])
    assert [x["custom_id"] for x in out] == ["r0", "r1", "r2", "r4"]
    errors = [(x["custom_id"], x["error"]["code"]) for x in _jsonl(client, done["error_file_id"])]
    assert errors == [("r3", "result_unreadable")]
    content = bsettings.keys.file_content(done["output_file_id"])
    assert fake_redis.ttl(content) > 0 and fake_redis.exists(
        bsettings.keys.file(done["output_file_id"])
    )


def test_the_janitor_drops_gone_ids_from_every_tenants_index(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    """A tenant that never lists its files still gets its index pruned: the ids
    of files deleted or expired behind its back go."""
    from jobs.store.scheduling import Store

    store = BatchStore(Store(fake_redis, settings))
    kept = store.create_file("a.jsonl", "batch", b"{}\n", time.time(), owner="t1")
    gone = store.create_file("b.jsonl", "batch", b"{}\n", time.time(), owner="t1")
    other = store.create_file("c.jsonl", "batch", b"{}\n", time.time(), owner="t2")
    fake_redis.delete(settings.keys.file(gone["id"]))  # expired
    assert store.prune_indexes() == 1
    assert [f["id"] for f in store.list_files(owner="t1")] == [kept["id"]]
    assert [f["id"] for f in store.list_files(owner="t2")] == [other["id"]]


def _run_to_end(
    settings: Settings, r: fakeredis.FakeRedis, client: FlaskClient, batch_id: str
) -> dict[str, Any]:
    """A worker runs until the batch has ended; the batch then."""
    w = Worker(settings, FakeEngine(), r, name="w1")
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        return _wait_status(client, batch_id, {"completed", "failed"})
    finally:
        w.stop()
        thread.join(timeout=10)


def test_a_validation_started_late_by_a_reader_changes_nothing(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    """A read saw the batch validating and started a validation once the first
    had ended (under load, the two can be that far apart): the batch keeps its
    lines, once each."""
    import web.batches
    import web.files

    app = create_app(bsettings, vocab=FakeVocab(), client=fake_redis)
    client = app.test_client()
    file_id = _upload(client, [_line(f"r{i}", "x") for i in range(4)]).get_json()["id"]
    batch_id = _create(client, file_id).get_json()["id"]
    _wait_status(client, batch_id, {"in_progress"})
    k = bsettings.keys
    lines = fake_redis.lrange(k.batch_items(batch_id), 0, -1)
    with app.app_context():
        web.batches._start_validation(web.files.batch_store(), batch_id)
    deadline = time.monotonic() + 10
    while fake_redis.exists(k.batch_validation_lock(batch_id)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake_redis.lrange(k.batch_items(batch_id), 0, -1) == lines
    done = _run_to_end(bsettings, fake_redis, client, batch_id)
    assert done["request_counts"] == {"total": 4, "completed": 4, "failed": 0}


def test_a_validation_after_one_that_died_stores_each_line_once(
    bsettings: Settings, fake_redis: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A validation that died with its process had stored some lines (the
    batch still validating, none fed); the next stores every line once."""
    import web.batches

    gate = threading.Event()
    line_job = web.batches._line_job

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(timeout=30)
        return line_job(*args, **kwargs)

    monkeypatch.setattr(web.batches, "_line_job", held)
    app = create_app(bsettings, vocab=FakeVocab(), client=fake_redis)
    client = app.test_client()
    file_id = _upload(client, [_line(f"r{i}", "x") for i in range(4)]).get_json()["id"]
    batch_id = _create(client, file_id).get_json()["id"]
    # What the died one left: two lines stored, one invalid line.
    request: dict[str, Any] = {"prompt_ids": [1, 2], "max_tokens": 4}
    dead: list[tuple[str, str, str, dict[str, Any], dict[str, str]]] = [
        (f"batchreq_dead{i}", f"r{i}", "chat", request, {}) for i in range(2)
    ]
    BatchStore(app.extensions["parkq"].store).create_batch(
        {"id": batch_id, "invalid": "1", "errors": "[]"}, dead, [{"bad": 1}], time.time()
    )
    gate.set()
    _wait_status(client, batch_id, {"in_progress"})
    done = _run_to_end(bsettings, fake_redis, client, batch_id)
    assert done["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    assert sorted(x["custom_id"] for x in _jsonl(client, done["output_file_id"])) == [
        f"r{i}" for i in range(4)
    ]
