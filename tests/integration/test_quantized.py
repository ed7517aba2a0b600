"""The pipeline on quantized weights (Q8_0, Q4_0): the kernels real models take.

The f32 tiny model never reaches llama.cpp's quantized or repacked kernels (AMX,
AVX-512 repacks), and those are the ones that crash on some CPUs. Each worker
here decides its kernel path with a fresh probe (its own cache directory), so on
a machine where the repacked kernels crash, these tests prove the fallback.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.engine.testmodel import write_test_model
from tests.integration.conftest import TEST_ENV, Server, start_parkq, stop_parkq
from tests.integration.helpers import (
    completion_text,
    job,
    logprob_tokens,
    read_events,
    submit_stream,
    wait_until,
)
from tests.integration.test_parking import _interrupt, _long, _reference
from tests.integration.test_workers import running_cluster


@pytest.fixture(scope="module", params=["q8_0", "q4_0"])
def quant_model(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"model-{request.param}")
    return write_test_model(root / f"tiny-{request.param}.gguf", seed=0, quant=request.param)


@pytest.fixture(scope="module")
def quant_server(redis_server, quant_model: Path, tmp_path_factory) -> Iterator[Server]:
    env = {
        **TEST_ENV,
        "PARKQ_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "PARKQ_KEY_PREFIX": quant_model.stem,
        "PARKQ_QUEUE_NAME": quant_model.stem,
    }
    proc, base = start_parkq(quant_model, redis_server.url, env=env)
    yield Server(base, redis_server.url, proc)
    stop_parkq(proc)


def test_a_quantized_model_streams_a_completion(quant_server: Server) -> None:
    body = {"prompt": "The park queue", "max_tokens": 200, "ignore_eos": True}
    resp = submit_stream(quant_server.base_url, body)
    events = read_events(resp)
    resp.close()
    assert events[-1][1] == "[DONE]"
    assert completion_text(events)
    assert job(quant_server.base_url, resp.headers["X-Job-Id"])["tokens"] == 200


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_parked_quantized_job_is_token_identical(
    quant_server: Server, temperature: float
) -> None:
    body = _long(temperature, max_tokens=1500)
    reference = _reference(quant_server, body)
    resp = submit_stream(quant_server.base_url, body)
    job_id = resp.headers["X-Job-Id"]
    _interrupt(quant_server, job_id, 3)
    events = read_events(resp)
    resp.close()
    assert job(quant_server.base_url, job_id)["preemptions"] == 3
    assert completion_text(events) == completion_text(reference)
    assert logprob_tokens(events) == logprob_tokens(reference)


def test_a_sigkilled_worker_on_a_quantized_model_loses_nothing(
    redis_server, quant_model: Path, tmp_path: Path
) -> None:
    body = _long(0.8, max_tokens=1500)
    with running_cluster(
        redis_server.url, quant_model, tmp_path, f"kill-{quant_model.stem}", ("w0",)
    ) as c:
        c.env["PARKQ_CACHE_DIR"] = str(tmp_path / "cache")
        reference = read_events(submit_stream(c.base_url, body))
        resp = submit_stream(c.base_url, body)
        job_id = resp.headers["X-Job-Id"]
        wait_until(lambda: job(c.base_url, job_id)["tokens"] > 100)
        c.procs["w0"].send_signal(signal.SIGKILL)
        c.procs["w0"].wait()
        c.start_worker("w1")
        events = read_events(resp)
        resp.close()
        assert [i for i, _ in events] == list(range(1, len(events) + 1))
        assert completion_text(events) == completion_text(reference)
        assert logprob_tokens(events) == logprob_tokens(reference)
        assert job(c.base_url, job_id)["worker"] == "w1"
