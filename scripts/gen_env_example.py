"""Write .env.example from the settings (run after adding a setting)."""

from __future__ import annotations

from pathlib import Path

from scheduler.settings import Settings

HEAD = """\
# parkq settings for docker compose (`cp .env.example .env`). Every PARKQ_ setting is
# listed with its default; uncomment to change. Never commit the real .env.
# (Regenerate with: .venv/bin/python scripts/gen_env_example.py)

# Required: the password of the compose Redis (the app connects with it).
REDIS_PASSWORD=change-me
# The GGUF file inside the `models` volume, and where the web port is published:
# loopback only by default; 0.0.0.0:8000 opens it to the network (set PARKQ_API_KEYS).
PARKQ_MODEL_FILE=model.gguf
PARKQ_PUBLISH=127.0.0.1:8000
"""
SET_BY_COMPOSE = {"redis_url", "model", "host", "port"}


def main() -> None:
    lines = [HEAD]
    for name, field in Settings.model_fields.items():
        env = f"PARKQ_{name.upper()}"
        default = field.default
        if default is None:
            value = ""
        elif isinstance(default, bool):
            value = str(default).lower()
        else:
            value = str(default)
        lines.append(f"# {field.description}")
        if name in SET_BY_COMPOSE:
            lines.append(f"# ({env} is set by compose.yaml)")
        lines.append(f"# {env}={value}")
    Path(__file__).resolve().parents[1].joinpath(".env.example").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
