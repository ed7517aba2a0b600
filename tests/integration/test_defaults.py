"""`parkq up` with nothing set, used with the openai client's defaults, as a
newcomer would: several people at once are batched, not queued."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from jobs.engine.capacity import sequence_plan
from scheduler.settings import Settings
from tests.integration.conftest import start_parkq, stop_parkq

PEOPLE = 8


@pytest.mark.timeout(300)
def test_eight_people_at_once_all_start_before_anyone_finishes(
    tiny_model: Path, tmp_path: Path
) -> None:
    # No PARKQ_ setting at all (the test run's own are removed).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKQ_")}
    env["PARKQ_LOG_LEVEL"] = "WARNING"
    said: list[str] = []
    errors = tmp_path / "stderr"
    proc, base = start_parkq(tiny_model, None, "--ephemeral", env=env, said=said, errors=errors)
    try:
        # It says how many sequences it chose and why, before it is up: the
        # plan for this machine (8 on a CPU, 16 on a GPU; fewer only when
        # memory is short, the tiny model's KV being 2 MiB a sequence).
        plan = sequence_plan(Settings(model=str(tiny_model), max_seqs=None, parked_seqs=None))
        why = errors.read_text()
        chosen = re.search(r"parkq: (\d+) sequences? per worker generate at once", why)
        assert chosen is not None, why
        assert int(chosen.group(1)) == plan.max_seqs >= 2, why
        assert "the default on a" in why
        assert f"1 worker of {plan.max_seqs} sequences" in said[-1]
        people = min(PEOPLE, plan.max_seqs)

        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        ids: list[str] = [""] * people
        texts: list[str] = [""] * people
        go = threading.Barrier(people)

        def person(i: int) -> None:
            go.wait()
            # The client's defaults: no temperature, no top_p (1 and 1).
            stream = client.completions.create(
                model="tiny", prompt=f"Person {i} asks about parking", max_tokens=3000,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                ids[i] = chunk.id
                texts[i] += chunk.choices[0].text if chunk.choices else ""

        threads = [threading.Thread(target=person, args=(i,)) for i in range(people)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert all(ids) and all(texts)
        jobs: list[dict[str, Any]] = [
            requests.get(f"{base}/v1/jobs/{job_id}", timeout=10).json() for job_id in ids
        ]
        assert all(j["state"] == "finished" and j["tokens"] == 3000 for j in jobs)
        # Batched: every one started before the first finished, on eight
        # sequences of the one worker, and nobody was parked to make room.
        assert max(j["started_at"] for j in jobs) < min(j["finished_at"] for j in jobs)
        assert len({j["worker"] for j in jobs}) == people
        assert sum(j["preemptions"] for j in jobs) == 0
        # Sampled, not greedy: the same prompt text differs by person anyway,
        # but eight streams at temperature 1 are eight different texts.
        assert len(set(texts)) == people
    finally:
        assert stop_parkq(proc) == 0
