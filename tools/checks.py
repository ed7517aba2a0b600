"""What the `parkq` commands check before they start anything: the model
file, Redis, an open port without keys. Each mistake is one line saying what
to fix (a ``click.ClickException``), never a traceback."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from scheduler.settings import Settings

__all__ = ["check_redis", "preflight", "redact", "resolve_model", "warn_if_open"]

log = logging.getLogger(__name__)


def resolve_model(settings: Settings) -> Settings:
    """Fill in the demo model (assembling it once) when no model is given."""
    if settings.model:
        return settings
    from jobs.engine.demo_model import DEMO_CHAT_FORMAT, assemble_demo_model, demo_model_target

    try:
        target = demo_model_target(settings.cache_dir)
        if not target.exists():
            click.echo(f"parkq: assembling the demo model into {target} (once)...")
            assemble_demo_model(target)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    update: dict[str, Any] = {"model": str(target)}
    if settings.chat_format is None:
        update["chat_format"] = DEMO_CHAT_FORMAT
    return settings.model_copy(update=update)


def redact(url: str | None) -> str:
    """``url`` with its passwords (if any) replaced by ``***``, for output and logs
    (a Sentinel URL's several hosts and ``sentinel_password`` too)."""
    import re

    if not url:
        return ""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else netloc
    tail = re.sub(r"((?:^|[?&])(?:sentinel_)?password=)[^&]*", r"\1***", tail)
    return f"{scheme}{sep}{netloc}{slash}{tail}"


def preflight(settings: Settings) -> None:
    """Check the model file and Redis before starting anything; one line if wrong."""
    model = settings.model or ""
    path = Path(model).expanduser()
    if not path.is_file():
        raise click.ClickException(
            f"no model file at {model} (--model or PARKQ_MODEL: the path of a .gguf file)"
        )
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise click.ClickException(f"cannot read the model file {model}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise click.ClickException(f"{model} is not a GGUF model file (llama.cpp needs GGUF)")
    from jobs.engine.llama import Vocab

    try:
        Vocab(str(path))  # the chat format is checked where it is used
    except ValueError as exc:
        raise click.ClickException(
            f"llama.cpp cannot load {model} ({exc}): is the file complete, and is its "
            "architecture one this llama.cpp build knows?"
        ) from None
    if settings.redis_url:
        check_redis(settings.redis_url)


def check_redis(url: str) -> None:
    """Ping Redis at ``url``; a one-line error saying what to fix if it does not answer."""
    import redis

    from jobs.store.connect import connect, too_old

    shown = redact(url)
    try:
        client = connect(url, socket_connect_timeout=5, socket_timeout=5)
    except ValueError as exc:
        raise click.ClickException(f"{shown} is not a Redis URL: {exc}") from None
    try:
        client.ping()
        old = too_old(client)
        if old is not None:
            raise click.ClickException(f"{old} (at {shown})")
    except redis.AuthenticationError:
        if "@" not in url.split("//", 1)[-1].split("/", 1)[0]:
            raise click.ClickException(
                f"Redis at {shown} needs a password: give it in the URL "
                "(redis://:PASSWORD@host:port/0)"
            ) from None
        raise click.ClickException(
            f"Redis at {shown} refused the credentials: check the password (and user) in "
            "--redis-url or PARKQ_REDIS_URL"
        ) from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise click.ClickException(
                f"Redis at {shown} needs a password: give it in the URL "
                "(redis://:PASSWORD@host:port/0)"
            ) from None
        raise click.ClickException(f"Redis at {shown} answered: {exc}") from None
    except redis.ConnectionError as exc:
        reason = str(exc).split(". ")[-1].rstrip(".") or type(exc).__name__
        raise click.ClickException(
            f"cannot reach Redis at {shown} ({reason}): start it, fix --redis-url / "
            "PARKQ_REDIS_URL, or leave it out for an embedded Redis (parkq up)"
        ) from None
    finally:
        client.close()


def warn_if_open(settings: Settings) -> None:
    """Say loudly when the API listens beyond this machine without keys."""
    if settings.api_key_list or settings.host in ("127.0.0.1", "localhost", "::1"):
        return
    message = (
        f"parkq: WARNING: listening on {settings.host}:{settings.port} without API keys: "
        "anyone who can reach this port can use the model. Set PARKQ_API_KEYS, or bind "
        "127.0.0.1."
    )
    click.echo(message, err=True)
    log.warning("%s", message.removeprefix("parkq: "))
