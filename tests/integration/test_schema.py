"""Schemathesis over /openapi.json against a real `parkq up` (tiny model, API keys on).

Every operation gets generated requests, valid and invalid, also in stateful
sequences (a file uploaded, then read and deleted): no answer may be a 5xx,
and every answer must match the description (status, headers, content type,
body, SSE events); authentication must be enforced. CI runs a few dozen examples
per operation; the full run sets PARKQ_FUZZ_EXAMPLES=1000.

Generated bodies also carry text Hypothesis never makes by default: a lone
surrogate, a NUL, control characters in one string (tests/schemathesis_hooks.py).

Left out: `positive_data_acceptance`, which expects every schema-valid request
to succeed; a valid request can still exceed the model's context (400 with the
token counts), which no schema can express.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import TEST_ENV, start_parkq, stop_parkq

EXAMPLES = int(os.environ.get("PARKQ_FUZZ_EXAMPLES", "25"))
KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_url(tiny_model: Path) -> Iterator[str]:
    env = {**TEST_ENV, "PARKQ_N_CTX": "512", "PARKQ_API_KEYS": KEY}
    proc, base = start_parkq(tiny_model, None, env=env)
    yield base
    stop_parkq(proc)


def test_the_description_is_served_with_a_key(fuzz_url: str) -> None:
    assert requests.get(f"{fuzz_url}/openapi.json", timeout=10).status_code == 401
    doc = requests.get(
        f"{fuzz_url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    ).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/batches", "/v1/files"} <= set(doc["paths"])
    assert doc["security"] == [{"bearer": []}]


@pytest.mark.timeout(3600)
def test_schemathesis_finds_no_5xx_and_no_answer_off_the_description(
    fuzz_url: str, tmp_path: Path
) -> None:
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert st is not None
    # An over-long URL of invalid parameters is refused by the HTTP server (414)
    # before the app can answer 400: a rejection all the same.
    (tmp_path / "schemathesis.toml").write_text(
        "[checks.negative_data_rejection]\n"
        'expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "414", '
        '"415", "422", "428", "429"]\n'
    )
    run = subprocess.run(
        [
            st,
            "run",
            f"{fuzz_url}/openapi.json",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--max-examples",
            str(EXAMPLES),
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--exclude-checks",
            "positive_data_acceptance",
            "--request-timeout",
            "60",
            "--no-shrink",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            "SCHEMATHESIS_HOOKS": str(Path(__file__).parents[1] / "schemathesis_hooks.py"),
        },
        timeout=3500,
    )
    out = run.stdout
    failures = out[out.find("FAILURES") : out.find("SUMMARY")][:6000]
    assert run.returncode == 0, failures + out[-1500:]
    tail = out.split("Test cases:")[-1]
    assert " passed" in tail and "failure" not in tail
    print("\nschemathesis:", " ".join(tail.split()[:4]))
