"""The docker compose stack and the Dockerfile, checked without Docker."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = BIN / name
    return str(found) if found.exists() else shutil.which(name) or name


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_files_follow_the_compose_spec(name: str) -> None:
    run = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", name],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_dockerfile_passes_hadolint() -> None:
    dockerfiles = sorted(ROOT.glob("**/Dockerfile*"))
    dockerfiles = [d for d in dockerfiles if ".venv" not in d.parts]
    assert dockerfiles
    for dockerfile in dockerfiles:
        run = subprocess.run(
            [_tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr


def test_redis_is_private_protected_durable_and_checked(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    command = " ".join(redis["command"])
    assert "--requirepass ${REDIS_PASSWORD" in command
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "healthcheck" in redis


def test_web_and_worker(compose: dict[str, Any]) -> None:
    services = compose["services"]
    web, worker = services["web"], services["worker"]
    cpu = yaml.safe_load((ROOT / "compose.cpu.yaml").read_text())["services"]
    assert web["depends_on"]["redis"]["condition"] == "service_healthy"
    # Published on loopback unless the operator opens it.
    assert web["ports"] == ["${PARKQ_PUBLISH:-127.0.0.1:8000}:8000"]
    # Its health is its liveness: no worker up yet is no reason to restart it.
    assert "/livez" in " ".join(web["healthcheck"]["test"])
    # The GPU worker starts by default (as before); compose.cpu.yaml puts it
    # behind a profile never given and runs the CPU image's worker instead.
    assert "profiles" not in worker and cpu["worker"]["profiles"] == ["gpu"]
    cpu = cpu["worker-cpu"]  # (a service of its own: every field its own)
    assert worker["build"]["args"]["BACKEND"] == "cuda" and worker["image"] == "parkq:cuda"
    assert cpu["build"]["args"]["BACKEND"] == "cpu" and cpu["image"] == "parkq:cpu"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "deploy" not in cpu
    for w in (worker, cpu):
        assert w["command"] == ["worker"]
        assert w["depends_on"]["redis"]["condition"] == "service_healthy"
        grace = re.fullmatch(r"(\d+)s", w["stop_grace_period"])
        assert grace and int(grace.group(1)) >= 30 and w["stop_signal"] == "SIGTERM"
        # The kernel probe's verdicts outlive a re-created container.
        assert w["environment"]["PARKQ_CACHE_DIR"] == "/cache" and "cache:/cache" in w["volumes"]
    for service in (web, worker, cpu):
        assert "${REDIS_PASSWORD" in service["environment"]["PARKQ_REDIS_URL"]
        assert "models:/models:ro" in service["volumes"]
    assert {"models", "cache", "redis-data"} <= set(compose["volumes"])
    assert services["rq-dashboard"]["profiles"] == ["dashboard"]


def test_dockerfile_builds_cpu_or_cuda_and_runs_unprivileged() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BACKEND=cpu" in text
    assert "AS build-cpu" in text and "AS build-cuda" in text and "-DGGML_CUDA=on" in text
    users = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert users and users[-1] not in ("root", "0")
    assert not re.search(r"(PASSWORD|API_KEYS|SECRET)\s*=", text)
    # No model baked in (the demo extra is the 253 MB demo model).
    assert "[demo]" not in text


def test_env_example_lists_every_setting() -> None:
    text = (ROOT / ".env.example").read_text()
    for name in Settings.model_fields:
        assert f"PARKQ_{name.upper()}=" in text, name
    # No default password: compose's `:?` guard refuses to start without one.
    assert re.search(r"^REDIS_PASSWORD=$", text, flags=re.M)
    assert "COMPOSE_FILE=compose.yaml:compose.cpu.yaml" in text
