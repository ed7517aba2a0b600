"""The upload quota (PARKQ_FILES_MAX_BYTES) is per tenant: one key at its quota
gets 413 naming its own usage alone, another key still uploads; deleting or
expiring a file gives its bytes back to its tenant only."""

from __future__ import annotations

import io

import fakeredis
import pytest
from flask.testing import FlaskClient

from scheduler.settings import Settings
from tests.fakes import FakeVocab
from web.app import create_app

A, B = {"Authorization": "Bearer key-of-a"}, {"Authorization": "Bearer key-of-b"}


def blob(size: int) -> bytes:
    """One JSON line of exactly ``size`` bytes."""
    head = b'{"custom_id": "x", "pad": "'
    return head + b"p" * (size - len(head) - 2) + b'"}'


def upload(client: FlaskClient, headers: dict[str, str], size: int) -> tuple[int, dict[str, str]]:
    data = {"purpose": "batch", "file": (io.BytesIO(blob(size)), "in.jsonl")}
    resp = client.post("/v1/files", data=data, headers=headers, content_type="multipart/form-data")
    body = resp.get_json()
    return resp.status_code, body.get("error") or body


@pytest.fixture
def qsettings(settings: Settings) -> Settings:
    return settings.model_copy(update={"api_keys": "alice:key-of-a, key-of-b",
                                       "files_max_bytes": 1000})  # fmt: skip


@pytest.fixture
def client(qsettings: Settings, fake_redis: fakeredis.FakeRedis) -> FlaskClient:
    return create_app(qsettings, vocab=FakeVocab(), client=fake_redis).test_client()


def test_one_key_at_its_quota_leaves_another_keys_room_and_names_its_own_use(
    client: FlaskClient,
) -> None:
    assert upload(client, A, 700)[0] == 200
    assert upload(client, B, 250)[0] == 200
    status, error = upload(client, A, 400)
    assert status == 413 and error["code"] == "files_quota_exceeded"
    assert "hold 700 of the 1000 bytes" in error["message"]
    assert "950" not in error["message"] and "250" not in error["message"]
    # B's own 250 + 600 fit its own 1,000 (the pool of both would not).
    assert upload(client, B, 600)[0] == 200
    status, error = upload(client, B, 200)
    assert status == 413 and "hold 850 of the 1000 bytes" in error["message"]


def test_delete_and_expiry_give_the_bytes_back_to_their_tenant(
    client: FlaskClient, qsettings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    status, first = upload(client, A, 600)
    assert status == 200 and upload(client, A, 600)[0] == 413
    assert client.delete(f"/v1/files/{first['id']}", headers=A).status_code == 200
    status, second = upload(client, A, 600)
    assert status == 200
    fake_redis.delete(qsettings.keys.file(second["id"]))  # as its expiry will
    assert upload(client, A, 900)[0] == 200
    # B's uploads never counted A's.
    assert upload(client, B, 1000)[0] == 200


def test_without_keys_everyone_is_one_tenant(
    settings: Settings, fake_redis: fakeredis.FakeRedis
) -> None:
    one = create_app(settings.model_copy(update={"files_max_bytes": 1000}), vocab=FakeVocab(),
                     client=fake_redis).test_client()  # fmt: skip
    assert upload(one, {}, 700)[0] == 200
    status, error = upload(one, {"Authorization": "Bearer anything"}, 400)
    assert status == 413 and "hold 700 of the 1000 bytes" in error["message"]
