"""One key, one tenant, against a real `parkq up` (Redis, web, worker, tiny model).

Three keys: ``alice:<key>`` (a named key), Bob's (unnamed), and the admin key
``ops:<key>``. Alice creates a job, an ``n`` = 2 job, a file and a batch; for
every route that takes an id, key B gets the same 404 as for an id that does
not exist, and nothing of Alice's changes; the lists B reads hold none of
Alice's; the admin sees and manages everything; the dashboard shows B how busy
the server is without Alice's ids; the metrics count requests by key name for
the admin only."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.conftest import TEST_ENV, start_parkq, stop_parkq
from tests.integration.helpers import read_events, wait_until, web_answers
from tests.integration.test_workers import running_cluster

ALICE, BOB, ADMIN = "secret-of-alice", "secret-of-bob", "secret-of-ops"
SHORT = {"prompt": "Tenants", "max_tokens": 5, "temperature": 0}


class Api:
    """HTTP with one key."""

    def __init__(self, base: str, key: str) -> None:
        self.base, self.headers = base, {"Authorization": f"Bearer {key}"}

    def __call__(self, method: str, path: str, **kw: Any) -> requests.Response:
        return requests.request(method, self.base + path, headers=self.headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Iterator[str]:
    env = {**TEST_ENV, "PARKQ_API_KEYS": f"alice:{ALICE},{BOB}",
           "PARKQ_ADMIN_KEYS": f"ops:{ADMIN}"}  # fmt: skip
    proc, url = start_parkq(tiny_model, None, env=env)
    yield url
    stop_parkq(proc)


@pytest.fixture(scope="module")
def alices(base: str) -> dict[str, str]:
    """Alice's job, n = 2 job, file and (ended) batch, by kind."""
    alice = Api(base, ALICE)
    done = alice("POST", "/v1/completions", json=SHORT)
    assert done.status_code == 200, done.text
    two = alice("POST", "/v1/completions", json={**SHORT, "n": 2, "temperature": 0.8})
    assert two.status_code == 200, two.text
    line = ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            '"body": {"prompt": "x", "max_tokens": 2}}\n')  # fmt: skip
    up = alice("POST", "/v1/files", data={"purpose": "batch"},
               files={"file": ("a.jsonl", io.BytesIO(line.encode()))})  # fmt: skip
    assert up.status_code == 200, up.text
    made = alice("POST", "/v1/batches", json={"input_file_id": up.json()["id"],
                                             "endpoint": "/v1/completions",
                                             "completion_window": "24h"})  # fmt: skip
    assert made.status_code == 200, made.text
    batch = made.json()["id"]
    wait_until(lambda: alice("GET", f"/v1/batches/{batch}").json()["status"] == "completed")
    output = alice("GET", f"/v1/batches/{batch}").json()["output_file_id"]
    return {"job": done.json()["id"], "n2": two.json()["id"], "file": up.json()["id"],
            "batch": batch, "output": output}  # fmt: skip


def _routes(ids: dict[str, str]) -> list[tuple[str, str, dict[str, Any]]]:
    """Every route that takes an id, with Alice's ids."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for job in (ids["job"], ids["n2"]):
        out += [("GET", f"/v1/jobs/{job}", {}), ("GET", f"/v1/jobs/{job}/events", {}),
                ("GET", f"/v1/jobs/{job}/result", {}),
                ("DELETE", f"/v1/jobs/{job}", {})]  # fmt: skip
    for file in (ids["file"], ids["output"]):
        out += [("GET", f"/v1/files/{file}", {}), ("GET", f"/v1/files/{file}/content", {}),
                ("DELETE", f"/v1/files/{file}", {})]  # fmt: skip
    out += [
        ("GET", f"/v1/batches/{ids['batch']}", {}),
        ("POST", f"/v1/batches/{ids['batch']}/cancel", {}),
        ("POST", "/v1/batches", {"json": {"input_file_id": ids["file"],
                                          "endpoint": "/v1/completions",
                                          "completion_window": "24h"}}),
    ]  # fmt: skip
    return out


def _unknown(path: str, ids: dict[str, str]) -> str:
    """``path`` with Alice's id replaced by an id of the same kind that does not exist."""
    for kind, value in ids.items():
        if value in path:
            fake = value[: value.index("-") + 1 if kind in ("job", "n2") else value.index("_") + 1]
            return path.replace(value, fake + "0" * (len(value) - len(fake)))
    return path


def test_another_key_gets_a_404_for_every_route_that_takes_an_id(
    base: str, alices: dict[str, str]
) -> None:
    bob, alice = Api(base, BOB), Api(base, ALICE)
    before = {p: alice("GET", p).json() for p in (f"/v1/files/{alices['file']}",
                                                  f"/v1/batches/{alices['batch']}")}  # fmt: skip
    for method, path, kw in _routes(alices):
        resp = bob(method, path, **kw)
        assert resp.status_code == 404, (method, path, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
        # Word for word what an id that does not exist gets (the id aside).
        if method != "POST" or path != "/v1/batches":
            ghost = bob(method, _unknown(path, alices), **kw)
            assert ghost.status_code == 404
            assert ghost.json()["error"]["message"] == error["message"].replace(
                path.split("/")[3], _unknown(path, alices).split("/")[3]
            )
    # Nothing of Alice's changed: her file is there, her batch as it was, her
    # jobs' results whole.
    for path, body in before.items():
        assert alice("GET", path).json() == body
    assert alice("GET", f"/v1/files/{alices['output']}/content").status_code == 200
    result = alice("GET", f"/v1/jobs/{alices['job']}/result")
    assert result.status_code == 200 and result.json()["choices"][0]["text"]
    events = alice("GET", f"/v1/jobs/{alices['n2']}/events", stream=True)
    assert events.status_code in (200, 204)


def test_lists_hold_only_the_keys_own_and_the_admin_sees_all(
    base: str, alices: dict[str, str]
) -> None:
    bob, alice, admin = Api(base, BOB), Api(base, ALICE), Api(base, ADMIN)
    up = bob("POST", "/v1/files", data={"purpose": "batch"},
             files={"file": ("b.jsonl", io.BytesIO(b'{"custom_id": "b"}\n'))})  # fmt: skip
    assert up.status_code == 200
    bobs_file = up.json()["id"]

    def files(api: Api) -> set[str]:
        return {f["id"] for f in api("GET", "/v1/files").json()["data"]}

    def batches(api: Api) -> set[str]:
        return {b["id"] for b in api("GET", "/v1/batches", params={"limit": 100}).json()["data"]}

    assert {alices["file"], alices["output"]} <= files(alice) and bobs_file not in files(alice)
    assert files(bob) == {bobs_file}
    assert {alices["file"], alices["output"], bobs_file} <= files(admin)
    assert alices["batch"] in batches(alice)
    assert batches(bob) == set()
    assert alices["batch"] in batches(admin)
    # The admin reads and manages any tenant's.
    assert admin("GET", f"/v1/jobs/{alices['job']}").json()["state"] == "finished"
    assert admin("GET", f"/v1/jobs/{alices['n2']}/result").status_code == 200
    assert admin("GET", f"/v1/files/{alices['output']}/content").status_code == 200
    assert admin("GET", f"/v1/batches/{alices['batch']}").json()["status"] == "completed"
    assert admin("DELETE", f"/v1/files/{bobs_file}").json()["deleted"] is True
    assert bob("GET", f"/v1/files/{bobs_file}").status_code == 404


def test_a_key_with_a_name_and_a_key_without_one_are_separate_tenants_in_a_stream(
    base: str,
) -> None:
    """A job streamed by Alice is hers from its first event: Bob cannot read or
    cancel it while it runs."""
    alice, bob = Api(base, ALICE), Api(base, BOB)
    resp = alice("POST", "/v1/completions", json={**SHORT, "max_tokens": 300, "stream": True,
                                                   "ignore_eos": True}, stream=True)  # fmt: skip
    job_id = resp.headers["X-Job-Id"]
    assert bob("DELETE", f"/v1/jobs/{job_id}").status_code == 404
    assert bob("GET", f"/v1/jobs/{job_id}/events", stream=True).status_code == 404
    events = read_events(resp)
    assert events[-1][1] == "[DONE]"
    assert alice("GET", f"/v1/jobs/{job_id}").json()["state"] == "finished"


def test_the_dashboard_shows_another_keys_jobs_without_their_ids(base: str) -> None:
    alice, bob, admin = Api(base, ALICE), Api(base, BOB), Api(base, ADMIN)
    resp = alice("POST", "/v1/completions", json={**SHORT, "max_tokens": 3000, "stream": True,
                                                   "ignore_eos": True}, stream=True)  # fmt: skip
    job_id = resp.headers["X-Job-Id"]
    try:

        def running(api: Api) -> list[dict[str, Any]]:
            state = api("GET", "/dashboard/state").json()
            return [w["job"] for w in state["workers"] if w["job"]]

        wait_until(lambda: any(j["id"] == job_id for j in running(alice)), timeout=60)
        seen_by_bob = running(bob)
        assert seen_by_bob and all(j["id"] is None for j in seen_by_bob)
        assert all(j["tokens"] >= 0 for j in seen_by_bob)  # how busy, not what
        assert any(j["id"] == job_id for j in running(admin))
    finally:
        alice("DELETE", f"/v1/jobs/{job_id}")
        resp.close()


def test_requests_are_counted_by_key_name_for_the_admin(base: str) -> None:
    alice, bob, admin = Api(base, ALICE), Api(base, BOB), Api(base, ADMIN)
    assert alice("POST", "/v1/completions", json=SHORT).status_code == 200
    assert bob("POST", "/v1/completions", json=SHORT).status_code == 200
    text = admin("GET", "/metrics").text
    counts = {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("parkq_requests_total{")
    }
    assert counts["alice"] >= 1
    assert any(name.startswith("key-") and n >= 1 for name, n in counts.items())
    assert ALICE not in text and BOB not in text  # names, never keys
    assert "parkq_requests_total" not in bob("GET", "/metrics").text


def test_the_upload_quota_is_each_keys_own(redis_server: Any, tiny_model: Path,
                                           tmp_path: Path) -> None:  # fmt: skip
    """`parkq web` on a real Redis with a 1,000-byte upload quota: Alice at hers gets
    413 naming her usage alone; Bob still uploads; a deleted and an expired file
    give their bytes back."""
    import redis

    from scheduler.keys import Keys

    env = {"PARKQ_API_KEYS": f"alice:{ALICE},{BOB}", "PARKQ_FILES_MAX_BYTES": "1000"}
    with running_cluster(redis_server.url, tiny_model, tmp_path, "tquota", (), env) as c:
        wait_until(lambda: web_answers(c.base_url), timeout=60)
        alice, bob = Api(c.base_url, ALICE), Api(c.base_url, BOB)

        def upload(api: Api, size: int) -> requests.Response:
            head = b'{"custom_id": "x", "pad": "'
            content = head + b"p" * (size - len(head) - 2) + b'"}'
            return api("POST", "/v1/files", data={"purpose": "batch"},
                       files={"file": ("f.jsonl", io.BytesIO(content))})  # fmt: skip

        first = upload(alice, 700)
        assert first.status_code == 200 and upload(bob, 250).status_code == 200
        over = upload(alice, 400)
        assert over.status_code == 413
        error = over.json()["error"]
        assert error["code"] == "files_quota_exceeded"
        assert "hold 700 of the 1000 bytes" in error["message"] and "950" not in error["message"]
        assert upload(bob, 600).status_code == 200  # 850 of Bob's own 1,000
        assert alice("DELETE", f"/v1/files/{first.json()['id']}").status_code == 200
        second = upload(alice, 700)
        assert second.status_code == 200 and upload(alice, 400).status_code == 413
        r = redis.Redis.from_url(c.env["PARKQ_REDIS_URL"])
        r.pexpire(Keys("tquota").file(second.json()["id"]), 1)  # it expires
        wait_until(lambda: not r.exists(Keys("tquota").file(second.json()["id"])))
        r.close()
        assert upload(alice, 1000).status_code == 200
