"""Batched prefill on real llama.cpp: several people's prompts in one engine
call, each prompt and every token after it as alone, bit for bit.

llama.cpp computes a prompt row on another kernel by the number of rows in the
call (the tiled K-quant product from 8 columns, the tiled flash attention from
64 query rows) and splits a call of several sequences into passes of equal rows
per sequence, so a prompt batched with others lands in passes of other sizes
than alone. parkq's engine runs every prompt call with both of llama.cpp's
run-time floors at 1 (tools/llamapatch/0003-cpu-run-time-tiled-floors.patch),
so every prompt row takes the tiled paths, whose rows do not depend on the
call, and decode calls keep the one-row paths. The K-quant model is the
``small`` shape quantized to Q4_K_M, so its products take the tiled product.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs.engine.ggmlapi import Floors
from jobs.engine.kernels import (
    EXACT_TILED_FLOOR,
    FA_SPLIT_SWITCH,
    TILED_FLOOR,
    TILED_SWITCH,
    exact_prompts,
)
from jobs.engine.llama import LlamaEngine, device_key, library_dir
from jobs.engine.testmodel import write_kquant_model
from scheduler.settings import Settings
from tests.integration.helpers import (
    completion_text,
    logprob_tokens,
    read_events,
    submit_stream,
    wait_until,
)
from tests.integration.test_parking import SAMPLING
from tests.integration.test_workers import Cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    device_key(None) != "CPU", reason="the run-time floors are the CPU backend's"
)
#: What an exact worker sets for its decode calls.
DECODE = {TILED_FLOOR: str(EXACT_TILED_FLOOR), FA_SPLIT_SWITCH: "0"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (TILED_SWITCH, TILED_FLOOR, FA_SPLIT_SWITCH)}  # fmt: skip
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kquant_model(tmp_path_factory.mktemp("kquant") / "small-q4_k_m.gguf")


def _prompts_run(model: Path, width: int, positions: int, *flags: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.widthrun", str(model), "prompts", str(width),
         str(positions), *flags],
        capture_output=True, text=True, timeout=600, env=_env(**DECODE), check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _prompt_check(model: Path, seqs: int, *flags: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "jobs.engine.opcheck", str(model), "--prompts", "--widths",
         str(seqs), "--ctx", "1024", "--batch", "256", "--threads", "2", "--json", *flags],
        capture_output=True, text=True, timeout=600, env=_env(**DECODE), check=False,
    )  # fmt: skip
    assert done.stdout, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return verdict


def test_the_engine_sets_the_prompt_floors_for_prompt_calls_and_gives_them_back(
    kquant_model: Path,
) -> None:
    """The floors the engine sets are the ones its llama.cpp computes with (one
    library in the process): 1 and 1 for a call of two tokens or more of a
    sequence, llama.cpp's own (0) for a call of one token per sequence."""
    engine = LlamaEngine(str(kquant_model), n_ctx=512, n_batch=64, n_seq_max=2,
                         extra_buffers=False, n_gpu_layers=0, prompt_floors=True)  # fmt: skip
    floors = Floors.load(library_dir())
    assert floors is not None
    tokens = engine.tokenize("Two prompts at once")
    engine.eval(tokens, 0, 0)
    assert floors.get() == (1, 1)
    engine.eval([tokens[0]], len(tokens), 0)
    assert floors.get() == (0, 0)
    engine.plan_prefill(2)
    engine.prefill([(0, tokens, len(tokens) + 1), (1, tokens, 0)])
    assert floors.get() == (1, 1)
    engine.decode([(0, tokens[0], 2 * len(tokens) + 1), (1, tokens[0], len(tokens))])
    assert floors.get() == (0, 0)
    with pytest.raises(ValueError, match="decode call"):
        engine.prefill([(0, tokens[:1], 0), (1, tokens, 0)])
    engine.close()


@pytest.mark.parametrize("flash", [False, True], ids=["plain attention", "flash attention"])
def test_eight_prompts_past_1000_positions_in_shared_calls_get_their_logits_alone(
    kquant_model: Path, flash: bool
) -> None:
    """Eight prompts of 1,030 to 1,289 tokens, their chunks of one index in one
    call: the logits after each prompt and after each of the next steps (all
    eight in one decode call) equal the prompt's own run alone, bit for bit."""
    flags = ["floors", *(["flash"] if flash else [])]
    run = _prompts_run(kquant_model, 8, 1030, *flags)
    assert run["equal"], run
    assert run["positions"] == 1030 + 37 * 7 + 6 and run["batched"] >= 5


def test_without_the_floors_prompts_in_shared_calls_get_other_logits(kquant_model: Path) -> None:
    """llama.cpp's own floors: a prompt's last chunk of a few tokens takes the
    one-row kernels alone and the tiled ones beside others (and llama.cpp cuts
    a longer chunk into passes of other sizes): the logits differ. What the
    floors are for."""
    run = _prompts_run(kquant_model, 8, 1030, "flash")
    assert not run["equal"] and run["after"] == "prompt", run


def test_the_op_check_certifies_prompt_calls_only_at_the_prompt_floors(
    kquant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of prompt calls (each product at widths 1 to 256, the
    attention of prompt passes of 2 to 130 rows per sequence, beside others and
    across the context) passes with flash attention at the floors the engine
    sets, and refuses at llama.cpp's own, naming what differed. The plain
    attention's products (F16 K and V caches) are not the tiled ones: where the
    check refuses them, it names the attention alone, and the worker then
    prefills each prompt in a call of its own."""
    verdict = _prompt_check(kquant_model, 8, "--flash-attn")
    assert verdict["size"] == 8 and verdict["cells"] == 1024, verdict["describe"]
    for flags in ([], ["--flash-attn"]):
        stock = _prompt_check(kquant_model, 8, "--prompt-floors", "0,0", *flags)
        assert stock["size"] == 1, stock["describe"]
        named = {op["name"].split()[0] for op in stock["ops"] if op["first_differs"] == 2}
        assert "mul_mat" in named, stock["describe"]  # the tiled product from 17 columns
    plain = _prompt_check(kquant_model, 8)
    refused = {op["name"].split()[0] for op in plain["ops"] if op["first_differs"] == 2}
    assert refused <= {"attention"}, plain["describe"]
    assert (plain["size"] == 8) == (not refused)
    # What the worker runs: cached per build, model and settings.
    settings = Settings(model=str(kquant_model), max_seqs=8, n_ctx=1024,
                        cache_dir=str(tmp_path))  # fmt: skip
    for k, v in DECODE.items():
        monkeypatch.setenv(k, v)
    choice = exact_prompts(settings, 1024, flash=True)
    assert choice.size == 8 and choice.complete, choice.how
    assert exact_prompts(settings, 1024, flash=False).size == plain["size"]


@pytest.mark.parametrize("flash", [False, True], ids=["plain attention", "flash attention"])
def test_the_whole_model_check_of_prompts_together_agrees_only_with_the_floors(
    kquant_model: Path, flash: bool
) -> None:
    """What the worker runs after the op check (LlamaEngine.probe_prefill):
    prompts whose lengths make llama.cpp cut their shared calls into every kind
    of pass agree with alone at the prompt floors, and not at llama.cpp's own."""
    for floors in (True, False):
        engine = LlamaEngine(str(kquant_model), n_ctx=1024, n_batch=64, n_seq_max=8,
                             extra_buffers=False, n_gpu_layers=0, flash_attn=flash,
                             prompt_floors=floors)  # fmt: skip
        ok, how = engine.probe_prefill(8)
        engine.close()
        assert ok == floors, how
        if not floors:
            assert "got other logits than alone" in how


def _bodies() -> list[dict[str, Any]]:
    """Six people's requests, each sampling its own way (the openai client's
    defaults among them), prompts of several lengths."""
    modes = list(SAMPLING.values())
    return [
        {**{k: v for k, v in modes[i % len(modes)].items() if v is not None},
         "prompt": f"Person {i} asks: " + "tell me more about it, " * (i * 3),
         "max_tokens": 40, "seed": i, "logprobs": 2}
        for i in range(6)
    ]  # fmt: skip


@pytest.mark.timeout(600)
def test_people_arriving_together_share_prefill_calls_and_stream_what_they_stream_alone(
    redis_server: Any, kquant_model: Path, tmp_path: Path
) -> None:
    """Six requests queued before the worker starts (they arrive together): the
    worker prefills them in shared calls (``parkq_prefill_chunks_total`` above
    ``parkq_prefill_calls_total``), and each streams what a one-sequence worker
    streams for it alone, text and logprobs."""
    bodies = _bodies()
    # A context the checks cover in their time on a loaded machine, the same for
    # both workers; their verdicts cached in the test's own folder.
    env = {"PARKQ_N_CTX": "1024", "PARKQ_CACHE_DIR": str(tmp_path / "cache")}
    one = Cluster(redis_server.url, kquant_model, _dir(tmp_path / "ref"),
                  prefix=f"pra{time.monotonic_ns()}")  # fmt: skip
    try:
        one.start_web()
        one.start_worker("one", env=env)
        wait_until(lambda: one.workers_alive() == 1, timeout=120)
        references = [read_events(submit_stream(one.base_url, body)) for body in bodies]
    finally:
        one.stop()
    prefix = f"prb{time.monotonic_ns()}"
    c = Cluster(redis_server.url, kquant_model, _dir(tmp_path / "together"), prefix=prefix)
    try:
        c.start_web()
        wait_until(lambda: _up(c), timeout=60)
        resps = [submit_stream(c.base_url, body) for body in bodies]
        results: list[list[tuple[int, str]]] = [[] for _ in bodies]

        def read(i: int) -> None:
            results[i] = read_events(resps[i])

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(bodies))]
        for t in readers:
            t.start()
        c.start_worker("six", env={**env, "PARKQ_MAX_SEQS": "6", "PARKQ_N_THREADS": "2"})
        for t in readers:
            t.join(timeout=500)
        assert not any(t.is_alive() for t in readers)
        for got, ref in zip(results, references, strict=True):
            assert [i for i, _ in got] == list(range(1, len(got) + 1))
            assert completion_text(got) == completion_text(ref)
            assert logprob_tokens(got) == logprob_tokens(ref)
        wait_until(lambda: _metrics(c)["parkq_prefill_chunks_total"] >= len(bodies), timeout=30)
        m = _metrics(c)
        assert m["parkq_prefill_chunks_total"] > m["parkq_prefill_calls_total"], m
        (model,) = requests.get(f"{c.base_url}/v1/models", timeout=30).json()["data"]
        assert "up to 6 prompts per call" in model["exactness"][0], model
    finally:
        c.stop()


def _metrics(c: Cluster) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(c.base_url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _dir(path: Path) -> Path:
    path.mkdir()
    return path


def _up(c: Cluster) -> bool:
    try:
        return requests.get(c.base_url + "/healthz", timeout=5).status_code in (200, 503)
    except requests.RequestException:
        return False
