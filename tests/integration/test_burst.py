"""A burst of 1,000 requests: each is answered 200 or 429 (Retry-After), never 5xx."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.conftest import start_parkq, stop_parkq


@pytest.mark.timeout(300)
def test_a_burst_of_1000_requests_gets_200_or_429_and_accepted_jobs_finish(
    tiny_model: Path,
) -> None:
    proc, base = start_parkq(tiny_model, None, env={"PARKQ_MAX_QUEUE": "5"})
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))

    def one(i: int) -> tuple[int, str | None, dict[str, Any]]:
        r = session.post(
            base + "/v1/completions",
            json={"prompt": f"burst {i}", "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        return r.status_code, r.headers.get("Retry-After"), r.json()

    try:
        with ThreadPoolExecutor(max_workers=64) as pool:
            answers = list(pool.map(one, range(1000)))
        codes = [code for code, _, _ in answers]
        assert set(codes) <= {200, 429}, sorted(set(codes))
        assert codes.count(200) > 0 and codes.count(429) > 0
        for code, retry_after, body in answers:
            if code == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert body["error"]["code"] == "queue_full"
            else:
                assert body["choices"][0]["finish_reason"] == "length"
                assert body["usage"]["completion_tokens"] == 2
        print(f"\nburst: {codes.count(200)} answered 200, {codes.count(429)} answered 429")
        health = session.get(base + "/healthz", timeout=10).json()
        assert health["status"] == "ok"
    finally:
        session.close()
        assert stop_parkq(proc) == 0
