"""The dashboard in headless Chromium (Debian's, driven by Playwright)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.helpers import read_events, wait_until
from tests.integration.test_workers import running_cluster

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "dashboard-test-key"


@pytest.mark.timeout(240)
def test_dashboard_chat_and_a_long_job_parked_and_resumed(
    redis_server: Any, tiny_model: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    # One sequence per engine (the chat parks the long job rather than joining
    # it) whose decode steps take at least 10 ms: the long job outlasts the
    # chat and the chat outlasts the dashboard's refresh on any machine.
    worker_env = {"PARKQ_MAX_SEQS": "1", "PARKQ_TEST_DECODE_DELAY_SECONDS": "0.01"}
    auth = {"Authorization": f"Bearer {KEY}"}
    long_events: list[Any] = []
    web_env = {"PARKQ_API_KEYS": KEY}
    with running_cluster(redis_server.url, tiny_model, tmp_path, "dashboard", (), web_env) as c:
        c.start_worker("w", env=worker_env)
        wait_until(lambda: c.workers_alive() == 1, timeout=60)
        base = c.base_url
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"],
            )  # fmt: skip
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(base + "/")
            page.wait_for_selector("#login:not([hidden])")
            page.fill("input[name=key]", KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#app:not([hidden])")
            assert KEY not in page.url

            # A long batch job starts streaming (read in the background).
            body = {"prompt": "the long job", "max_tokens": 1000, "ignore_eos": True,
                    "priority": "batch", "temperature": 0}  # fmt: skip
            resp = requests.post(base + "/v1/completions", json={**body, "stream": True},
                                 headers=auth, stream=True, timeout=120)  # fmt: skip
            long_id = resp.headers["X-Job-Id"]
            reader = threading.Thread(target=lambda: long_events.extend(read_events(resp)))
            reader.start()
            page.wait_for_function(
                f"document.querySelector('#workers').textContent.includes('{long_id}')"
            )

            # A chat message from the box, interactive: the long job is parked meanwhile.
            page.fill("#message", "Hello from the dashboard")
            page.select_option("#priority", "interactive")
            page.fill("#max-tokens", "100")
            page.click("#send")
            page.wait_for_function(
                f"document.querySelector('#queue').textContent.includes('{long_id}')"
                " && document.querySelector('#queue').textContent.includes('parked')"
            )
            page.screenshot(path=str(tmp_path / "dashboard-parked.png"), full_page=True)
            page.wait_for_function(
                "document.querySelector('#chat-status').textContent.includes('done')",
                timeout=120_000,
            )
            reply = page.text_content("#reply") or ""
            assert reply.strip()
            assert "first token after" in (page.text_content("#chat-status") or "")
            # The chat's tokens count for this key's tenant, by its name (an
            # unnamed key's: key-<8 hex>), in the tenants' table.
            page.wait_for_function(
                "document.querySelector('#tenants').textContent.includes('key-')"
            )

            # The long job resumes: it has left the queue, and the preemption list shows it.
            page.wait_for_function(
                f"!document.querySelector('#queue').textContent.includes('{long_id}')"
                f" && document.querySelector('#preemptions').textContent.includes('{long_id}')"
            )
            page.screenshot(path=str(tmp_path / "dashboard-resumed.png"), full_page=True)
            browser.close()
        reader.join(timeout=120)
        assert long_events and long_events[-1][1] == "[DONE]"
        status = requests.get(f"{base}/v1/jobs/{long_id}", headers=auth, timeout=10).json()
        assert status["state"] == "finished" and status["preemptions"] >= 1
        assert (tmp_path / "dashboard-parked.png").stat().st_size > 10_000


#: Another site's page that posts its owner's key to the dashboard's sign-in.
ATTACKER = """<!doctype html><body>
<form id="f" method="post" action="{base}/dashboard/login">
<input name="key" value="{key}"></form>
<script>document.getElementById("f").submit();</script></body>"""


@pytest.mark.timeout(120)
def test_another_sites_page_cannot_sign_the_browser_in(
    redis_server: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """Login CSRF in a real browser: a page on another site posting a valid key gets
    403 and no cookie; the dashboard's own form then signs in."""
    from playwright.sync_api import sync_playwright

    with running_cluster(redis_server.url, tiny_model, tmp_path, "csrf", (),
                         {"PARKQ_API_KEYS": KEY}) as c:  # fmt: skip
        base = c.base_url
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
            context = browser.new_context()
            page = context.new_page()
            page.route("http://attacker.example/", lambda route: route.fulfill(
                content_type="text/html", body=ATTACKER.format(base=base, key=KEY)))  # fmt: skip
            with page.expect_response(base + "/dashboard/login") as posted:
                page.goto("http://attacker.example/")
            resp = posted.value
            assert resp.status == 403
            assert resp.json()["error"]["code"] == "cross_site_sign_in"
            assert resp.request.headers.get("origin") == "http://attacker.example"
            assert not [k for k in context.cookies() if k["name"] == "parkq_session"]
            page.goto(base + "/")
            page.wait_for_selector("#login:not([hidden])")  # still signed out
            page.fill("input[name=key]", KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#app:not([hidden])")
            assert [k for k in context.cookies() if k["name"] == "parkq_session"]
            browser.close()
