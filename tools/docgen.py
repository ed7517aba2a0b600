"""What the documentation says that the code can say for it, so it cannot drift.

``python scripts/gen_docs.py`` rewrites each block of docs/ between
``<!-- generated: NAME -->`` and ``<!-- end generated -->`` (the settings table
of docs/operations.md) and writes .env.example; a unit test checks that the
committed files equal what this module renders.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic.fields import FieldInfo

from scheduler import settings as settings_module
from scheduler.settings import Settings

__all__ = ["BLOCK", "env_example", "render", "settings_table"]

BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)
_SECTION = re.compile(r"^    # (\w[\w ]*)$")
_FIELD = re.compile(r"^    (\w+): ")


def _sections() -> dict[str, str]:
    """Each settings field's section, from the comments that head them in the source."""
    out, section = {}, "Other"
    for line in Path(settings_module.__file__).read_text().splitlines():
        if m := _SECTION.match(line):
            section = m.group(1)
        elif (m := _FIELD.match(line)) and m.group(1) in Settings.model_fields:
            out[m.group(1)] = section
    return out


def _size(n: int) -> str:
    """``n`` bytes as whole GiB or MiB, else nothing."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return ""


def _default(field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    text = f"`{value}`"
    if isinstance(value, int) and (size := _size(value)):
        text += f" ({size})"
    return text


def settings_table() -> str:
    """Every setting, by section: its variable, default and description."""
    sections = _sections()
    out: list[str] = []
    current = None
    for name, field in Settings.model_fields.items():
        section = sections.get(name, "Other")
        if section != current:
            current = section
            out += ["", f"**{section}**", "", "| variable | default | meaning |"]
            out.append("|---|---|---|")
        description = (field.description or "").replace("|", "\\|")
        out.append(f"| `PARKQ_{name.upper()}` | {_default(field)} | {description} |")
    return "\n".join(out).lstrip("\n") + "\n"


GENERATORS = {"settings": settings_table}


def render(text: str) -> str:
    """``text`` with every generated block rewritten from the code."""

    def block(m: re.Match[str]) -> str:
        make = GENERATORS.get(m.group(2))
        if make is None:
            raise ValueError(f"no generator for block {m.group(2)!r}")
        return m.group(1) + make() + m.group(4)

    return BLOCK.sub(block, text)


ENV_HEAD = """\
# parkq settings for docker compose (`cp .env.example .env`). Every PARKQ_ setting is
# listed with its default; uncomment to change. Never commit the real .env.
# (Regenerate with: .venv/bin/python scripts/gen_docs.py)

# Required: the password of the compose Redis (the app connects with it). Left
# empty, compose refuses to start; make a long random one: openssl rand -hex 24
REDIS_PASSWORD=
# On a host without an NVIDIA GPU, the CPU worker in place of the GPU one:
# COMPOSE_FILE=compose.yaml:compose.cpu.yaml
# The GGUF file inside the `models` volume, and where the web port is published:
# loopback only by default; 0.0.0.0:8000 opens it to the network (set PARKQ_API_KEYS).
PARKQ_MODEL_FILE=model.gguf
PARKQ_PUBLISH=127.0.0.1:8000
"""
#: Settings compose.yaml sets itself.
SET_BY_COMPOSE = {"redis_url", "model", "host", "port", "cache_dir"}


def env_example() -> str:
    """.env.example: every setting, commented out at its default."""
    lines = [ENV_HEAD]
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
    return "\n".join(lines) + "\n"
