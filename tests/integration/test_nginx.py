"""docs/examples/nginx.conf, as it is, in front of a real `parkq up` (Debian's
nginx; scripts/test installs it): a stream arrives event by event, a client
reconnects through the proxy with Last-Event-ID and gets each event once, and
a 100 MiB batch file uploads."""

from __future__ import annotations

import getpass
import io
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests

from tests.conftest import fresh_port
from tests.integration.conftest import start_parkq, stop_parkq
from tests.integration.helpers import completion_text, job, read_events, read_with_reconnects

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "nginx.conf"


@pytest.fixture(scope="module")
def behind_nginx(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert os.path.exists(nginx), "nginx is needed (scripts/test installs Debian's nginx-light)"
    tmp = tmp_path_factory.mktemp("nginx")
    errors = tmp / "parkq-stderr"
    env = {"PARKQ_TRUSTED_PROXIES": "1", "PARKQ_LOG_LEVEL": "INFO"}
    proc, base = start_parkq(tiny_model, None, env=env, errors=errors)
    port = fresh_port()
    site = EXAMPLE.read_text()
    assert "server 127.0.0.1:8000;" in site and "listen 8080;" in site
    site = site.replace("127.0.0.1:8000", base.removeprefix("http://"))
    (tmp / "parkq.conf").write_text(site.replace("listen 8080;", f"listen 127.0.0.1:{port};"))
    user = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""
    temps = " ".join(f"{what}_temp_path {tmp}/{what};" for what in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))  # fmt: skip
    (tmp / "nginx.conf").write_text(
        f"{user}\nworker_processes 1;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\n"
        f"daemon off;\nevents {{ worker_connections 256; }}\n"
        f"http {{ access_log {tmp}/access.log; {temps} include {tmp}/parkq.conf; }}\n"
    )
    server = subprocess.Popen([nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert server.poll() is None, (tmp / "error.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        assert stop_parkq(proc) == 0


LONG = {"prompt": "Through the proxy", "max_tokens": 1500, "ignore_eos": True,
        "temperature": 0, "stream": True}  # fmt: skip


def test_a_stream_comes_through_event_by_event(behind_nginx: str) -> None:
    resp = requests.post(behind_nginx + "/v1/completions", json=LONG, stream=True, timeout=60)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    job_id = resp.headers["X-Job-Id"]
    first = read_events(resp, limit=3)
    # The first events came while the job still runs: nothing held them back.
    assert job(behind_nginx, job_id)["state"] == "running"
    rest = read_events(resp)
    assert rest[-1][1] == "[DONE]"
    ids = [i for i, _ in first + rest]
    assert ids == list(range(1, len(ids) + 1))


def test_a_reconnect_through_the_proxy_gets_each_event_once(behind_nginx: str) -> None:
    first = requests.post(behind_nginx + "/v1/completions", json=LONG, stream=True, timeout=60)
    whole = completion_text(read_events(first))
    resp = requests.post(behind_nginx + "/v1/completions", json=LONG, stream=True, timeout=60)
    seen = read_with_reconnects(behind_nginx, resp.headers["X-Job-Id"], resp, per_connection=97)
    assert [i for i, _ in seen] == list(range(1, len(seen) + 1))
    assert completion_text(seen) == whole


def test_a_100_mib_batch_file_uploads_through_the_proxy(behind_nginx: str) -> None:
    line = {"custom_id": "", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "x" * 1960, "max_tokens": 1}}  # fmt: skip
    lines = []
    for i in range(50_000):
        line["custom_id"] = f"doc-{i}"
        lines.append(json.dumps(line))
    content = ("\n".join(lines) + "\n").encode()
    assert 99 * 2**20 < len(content) <= 100 * 2**20
    client = openai.OpenAI(base_url=behind_nginx + "/v1", api_key="unused", max_retries=0,
                           timeout=300)  # fmt: skip
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)
    assert client.files.content(uploaded.id).content == content
    client.files.delete(uploaded.id)
