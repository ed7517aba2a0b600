"""The `parkq` command as a user runs it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import start_parkq, stop_parkq
from tests.integration.helpers import children, job, read_events, submit_stream, wait_until

PARKQ = [sys.executable, "-m", "tools.cli"]


@pytest.mark.parametrize("sub", [[], ["up"], ["web"], ["worker"], ["make-test-model"], ["demo"]])
def test_help(sub: list[str]) -> None:
    out = subprocess.run([*PARKQ, *sub, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "Usage: " in out.stdout


def test_make_test_model_is_deterministic(tmp_path: Path) -> None:
    digests = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        path = tmp_path / f"{name}.gguf"
        subprocess.run(
            [*PARKQ, "make-test-model", str(path), "--seed", str(seed)], check=True, timeout=60
        )
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_with_embedded_redis_stops_every_child_on_sigterm(tiny_model: Path) -> None:
    proc, base = start_parkq(tiny_model, None, "--workers", "2")
    try:
        health = requests.get(base + "/healthz", timeout=10).json()
        assert health["workers"] == 2 and health["redis"] is True
        out = requests.post(
            base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60
        )
        assert out.status_code == 200
        kids = [pid for pid, _ in children(proc.pid)]
        assert len(kids) == 4  # redis, web, two workers
    finally:
        assert stop_parkq(proc) == 0
    assert not [k for k in kids if _alive(k)]


@pytest.mark.parametrize("given", ["~/models/tiny.gguf", "$PARKQ_TEST_MODELS/tiny.gguf"])
def test_a_model_path_with_tilde_or_a_variable_reaches_every_process(
    tiny_model: Path, tmp_path: Path, given: str
) -> None:
    """As an env file gives it (no shell expanded it): the preflight, the web
    and the worker all read the same file, and a request is answered."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    os.symlink(tiny_model, home / "models" / "tiny.gguf")
    cache = os.environ.get("PARKQ_CACHE_DIR") or str(Path.home() / ".cache" / "parkq")
    env = {"HOME": str(home), "PARKQ_TEST_MODELS": str(home / "models"), "PARKQ_CACHE_DIR": cache}
    proc, base = start_parkq(Path(given), None, env=env)
    try:
        assert requests.get(base + "/readyz", timeout=10).json()["model"] == "tiny"
        out = requests.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                            timeout=60)  # fmt: skip
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    finally:
        assert stop_parkq(proc) == 0


def test_each_request_gets_an_access_line_with_its_id_and_is_counted(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A plain request, a stream and a 404 through a real `parkq up`: one
    access line each on the web's log (the stream's once it ended), each with
    its request id, and /metrics counts them by route and status."""
    errors = tmp_path / "stderr"
    proc, base = start_parkq(tiny_model, None, env={"PARKQ_LOG_LEVEL": "INFO"}, errors=errors)
    try:
        body = {"prompt": "hi", "max_tokens": 3}
        plain = requests.post(base + "/v1/completions", json=body, timeout=60,
                              headers={"X-Request-Id": "trace-plain"})  # fmt: skip
        assert plain.status_code == 200
        streamed = requests.post(base + "/v1/completions", json={**body, "stream": True},
                                 timeout=60, headers={"X-Request-Id": "trace-stream"})  # fmt: skip
        assert b"data: [DONE]" in streamed.content
        missing = requests.get(base + "/v1/jobs/nope", timeout=10,
                               headers={"X-Request-Id": "trace-404"})  # fmt: skip
        assert missing.status_code == 404
        page = requests.get(base + "/metrics", timeout=10).text
        assert 'route="/v1/completions",status="200"} 2.0' in page
        assert 'route="/v1/jobs/<job_id>",status="404"} 1.0' in page
        assert "parkq_http_request_duration_seconds_count" in page
    finally:
        assert stop_parkq(proc) == 0
    lines = [x for x in errors.read_text().splitlines() if "parkq.access" in x]
    plain_line = [x for x in lines if "[trace-plain]" in x]
    stream_line = [x for x in lines if "[trace-stream]" in x]
    missing_line = [x for x in lines if "[trace-404]" in x]
    assert len(plain_line) == len(stream_line) == len(missing_line) == 1, lines
    assert "POST /v1/completions 200" in plain_line[0] and " stream " not in plain_line[0]
    assert "POST /v1/completions 200" in stream_line[0] and " stream [" in stream_line[0]
    assert "GET /v1/jobs/nope 404" in missing_line[0]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_workers_per_gpu_pins_one_worker_to_each_gpu(tiny_model: Path, tmp_path: Path) -> None:
    """`--workers per-gpu` on a host whose nvidia-smi lists two GPUs (a stand-in
    here: this machine has none, and the CPU build ignores the pin): two workers,
    each with CUDA_VISIBLE_DEVICES naming its own GPU, both serving."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\n[ "$1" = -L ] || exit 2\n'
        "echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)'\n"
        "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)'\n"
    )
    (fake / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    said: list[str] = []
    proc, base = start_parkq(tiny_model, None, "--workers", "per-gpu", env=env, said=said)
    try:
        assert requests.get(base + "/readyz", timeout=10).json()["workers"] == 2
        kids = [pid for pid, _ in children(proc.pid)]
        pins = sorted(e.get("CUDA_VISIBLE_DEVICES", "-") for e in map(_environ, kids)
                      if "PARKQ_WORKER_NAME" in e)  # fmt: skip
        assert pins == ["0", "1"]
        assert "2 workers" in said[-1]
    finally:
        assert stop_parkq(proc) == 0


def test_workers_per_gpu_without_a_gpu_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "PARKQ_LOG_LEVEL": "WARNING"}  # no nvidia-smi
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = subprocess.run(
        [sys.executable, "-m", "tools.cli", "up", "--model", str(tiny_model), "--ephemeral",
         "--workers", "per-gpu"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("Error: --workers per-gpu: no NVIDIA GPU")


def test_no_preempt_keeps_priority_order_without_interrupting(tiny_model: Path) -> None:
    # A full engine (one sequence): the short job waits for the long one.
    env = {"PARKQ_N_BATCH": "16", "PARKQ_MIN_RUN_SECONDS": "0.05", "PARKQ_MAX_SEQS": "1"}
    proc, base = start_parkq(tiny_model, None, "--no-preempt", env=env)
    try:
        long = submit_stream(base, {"prompt": "long", "max_tokens": 1500, "ignore_eos": True,
                                    "priority": "batch", "temperature": 0})  # fmt: skip
        long_id = long.headers["X-Job-Id"]
        wait_until(lambda: job(base, long_id)["tokens"] > 10)
        short = submit_stream(base, {"prompt": "short", "max_tokens": 4})
        short_id = short.headers["X-Job-Id"]
        assert read_events(short)[-1][1] == "[DONE]"
        read_events(long)
        long.close()
        short.close()
        long_job, short_job = job(base, long_id), job(base, short_id)
        assert long_job["preemptions"] == 0 and long_job["state"] == "finished"
        assert short_job["started_at"] >= long_job["finished_at"]
    finally:
        assert stop_parkq(proc) == 0


def test_api_keys_with_the_openai_client(tiny_model: Path) -> None:
    import openai

    proc, base = start_parkq(tiny_model, None, env={"PARKQ_API_KEYS": "sekret-1,sekret-2"})
    try:
        good = openai.OpenAI(base_url=base + "/v1", api_key="sekret-2", max_retries=0)
        out = good.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert out.choices[0].text
        bad = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            bad.models.list()
        assert exc.value.status_code == 401
        assert requests.get(base + "/healthz", timeout=10).status_code == 200
    finally:
        assert stop_parkq(proc) == 0


def _one_line_error(argv: list[str], tmp_path: Path) -> str:
    """Run ``parkq`` expecting a startup refusal; its one line of error output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKQ_")}
    run = subprocess.run(
        [*PARKQ, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**env, "PARKQ_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert run.returncode == 1, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    return lines[0]


def test_startup_mistakes_get_one_line_saying_what_to_fix(
    tiny_model: Path, tmp_path: Path, redis_server
) -> None:
    line = _one_line_error(["up", "--model", "/nonexistent.gguf"], tmp_path)
    assert "no model file at /nonexistent.gguf" in line
    (tmp_path / "notes.gguf").write_text("not a model")
    line = _one_line_error(["up", "--model", str(tmp_path / "notes.gguf")], tmp_path)
    assert "is not a GGUF model file" in line
    (tmp_path / "cut.gguf").write_bytes(tiny_model.read_bytes()[:5000])
    line = _one_line_error(["up", "--model", str(tmp_path / "cut.gguf")], tmp_path)
    assert "llama.cpp cannot load" in line
    for cmd in (["up"], ["web"], ["worker"]):
        argv = [*cmd, "--model", str(tiny_model), "--redis-url", "redis://127.0.0.1:1/0"]
        line = _one_line_error(argv, tmp_path)
        assert "cannot reach Redis at redis://127.0.0.1:1/0" in line


def test_a_wrong_redis_password_is_one_line_and_never_printed(
    tiny_model: Path, tmp_path: Path
) -> None:
    from tests.conftest import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start("--requirepass", "right-secret")
    try:
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        wrong = f"redis://:wrong-secret@127.0.0.1:{port}/0"
        line = _one_line_error(["up", "--model", str(tiny_model), "--redis-url", wrong], tmp_path)
        assert "refused the credentials" in line and "wrong-secret" not in line
        bare = f"redis://127.0.0.1:{port}/0"
        line = _one_line_error(["up", "--model", str(tiny_model), "--redis-url", bare], tmp_path)
        assert "needs a password" in line
        right = f"redis://:right-secret@127.0.0.1:{port}/0"
        argv = [*PARKQ, "up", "--model", str(tiny_model), "--port", "0", "--redis-url", right]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            up = proc.stdout.readline()
            proc.terminate()
            proc.wait(timeout=60)
        assert up.startswith("parkq is up at ") and "redis redis://:***@127.0.0.1" in up
        assert "right-secret" not in up
    finally:
        server.stop()


def test_an_open_bind_without_keys_is_said_loudly(tiny_model: Path, redis_server) -> None:
    argv = [*PARKQ, "web", "--model", str(tiny_model), "--redis-url", redis_server.url,
            "--host", "0.0.0.0", "--port", "0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PARKQ_API_KEYS"}
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.read()
    assert "WARNING: listening on 0.0.0.0" in first and "without API keys" in first
