"""A RESP proxy between parkq's processes and a real redis-server that answers
chosen commands with a chosen error reply for a while, or drops connections.

Which commands a fault hits is asked of the server itself at start (``COMMAND``
and each command's flags), not listed here: ``writes`` are the commands flagged
``write`` or ``may_replicate``, and the scripts (EVAL, EVALSHA and FCALL: a
script's writes are refused as it makes them); ``blocking`` those flagged
``blocking`` (BLPOP, XREAD, BZPOPMIN, ...) and WAIT (a server before 7.0 flags
no command ``blocking``: there the commands its documentation calls blocking,
``_BLOCKING_BEFORE_7``); ``all`` every command but
the connection's handshake (AUTH, HELLO, SELECT, CLIENT). A refused command
is never forwarded; inside MULTI it is refused when queued and the EXEC then
answers EXECABORT (the transaction discarded upstream), as Redis 7 does.
``drop`` closes every connection and accepts new ones only to close them, for
a while.

Replies are relayed one per command, in order (the proxy reads one command,
forwards it, reads exactly one reply back); a connection that subscribes
(pub/sub) or monitors becomes a plain two-way pipe from then on.

Used as a context manager::

    with FaultProxy(upstream_port) as proxy:
        url = proxy.url
        proxy.fail("writes", "NOREPLICAS Not enough good replicas to write.", 3.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import redis

__all__ = ["ERROR_REPLIES", "FaultProxy", "StaleSentinel", "Target"]

Target = Literal["writes", "blocking", "all"]

#: Every class of error reply Redis and Valkey send while they cannot serve a
#: command for a while, as they word it (the code is what clients parse), and
#: an unknown one.
ERROR_REPLIES = {
    "NOREPLICAS": "NOREPLICAS Not enough good replicas to write.",
    "MISCONF": "MISCONF Redis is configured to save RDB snapshots, but it's currently "
    "unable to persist to disk. Commands that may modify the data set are disabled.",
    "UNBLOCKED": "UNBLOCKED force unblock from blocking operation, instance state "
    "changed (master -> replica?)",
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or "
    "SHUTDOWN NOSAVE.",
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data "
    "is set to 'no'.",
    "READONLY": "READONLY You can't write against a read only replica.",
    "OOM": "OOM command not allowed when used memory > 'maxmemory'.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "NOSCRIPT": "NOSCRIPT No matching script. Please use EVAL.",
    "ERR": "ERR an error reply no client knows",
}

#: A connection's own handshake: never refused under ``all`` (a real server
#: that refuses everything still lets a client in; a client that cannot even
#: connect is the ``drop`` fault).
_HANDSHAKE = {b"AUTH", b"HELLO", b"SELECT", b"CLIENT", b"PING", b"QUIT", b"RESET"}
#: Scripts may write whatever their flags say (Redis refuses a script's write
#: when the script makes it; the _RO forms cannot write).
_SCRIPTS = {b"EVAL", b"EVALSHA", b"FCALL"}
#: The blocking commands of Redis 6.2, whose COMMAND reply has no ``blocking``
#: flag yet (the flag came with 7.0).
_BLOCKING_BEFORE_7 = {
    b"BLPOP",
    b"BRPOP",
    b"BRPOPLPUSH",
    b"BLMOVE",
    b"BZPOPMIN",
    b"BZPOPMAX",
    b"XREAD",
    b"XREADGROUP",
    b"WAIT",
}
_PIPE_AFTER = {b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE", b"MONITOR"}


@dataclass
class _Fault:
    target: Target | Literal["drop"] | None = None
    reply: bytes = b""
    until: float = 0.0
    hits: dict[str, int] = field(default_factory=dict)
    #: Refusals by the connection's CLIENT SETNAME ("?" when it set none).
    clients: dict[str, int] = field(default_factory=dict)


async def _read_value(reader: asyncio.StreamReader) -> bytes:
    """Exactly one RESP2/RESP3 value, raw."""
    line = await reader.readuntil(b"\r\n")
    kind, body = line[:1], line[1:-2]
    if kind in b"$=!":  # bulk string, verbatim string, bulk error
        n = int(body)
        return line if n < 0 else line + await reader.readexactly(n + 2)
    if kind in b"*~>":  # array, set, push
        n = int(body)
        parts = [line]
        for _ in range(max(n, 0)):
            parts.append(await _read_value(reader))
        return b"".join(parts)
    if kind in b"%|":  # map, attribute
        parts = [line]
        for _ in range(2 * int(body)):
            parts.append(await _read_value(reader))
        value = b"".join(parts)
        return value + await _read_value(reader) if kind == b"|" else value
    return line  # simple string, error, integer, null, double, boolean, big number


def _command(raw: bytes) -> list[bytes]:
    """The words of a command array read by :func:`_read_value` (bulk strings,
    which may hold any bytes, CR LF included)."""
    if not raw.startswith(b"*"):
        return raw.split()  # an inline command
    words: list[bytes] = []
    at = raw.index(b"\r\n") + 2
    for _ in range(int(raw[1 : at - 2])):
        end = raw.index(b"\r\n", at)
        n = int(raw[at + 1 : end])
        words.append(raw[end + 2 : end + 2 + n])
        at = end + 2 + n + 2
    return words


class FaultProxy:
    """A fault-injecting RESP proxy to ``127.0.0.1:upstream``, on a port of its own."""

    def __init__(self, upstream: int, port: int) -> None:
        self.upstream = upstream
        self.port = port
        self.fault = _Fault()
        self.forwarded = 0
        self._flags: dict[bytes, set[bytes]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- control (from the test's thread) --------------------------------------

    def fail(self, target: Target, reply: str, seconds: float) -> None:
        """Answer ``target`` commands with the error ``reply`` for ``seconds``."""
        with self._lock:
            self.fault = _Fault(target, f"-{reply}\r\n".encode(), time.monotonic() + seconds)

    def drop(self, seconds: float) -> None:
        """Close every connection now, and each new one at once, for ``seconds``."""
        with self._lock:
            self.fault = _Fault("drop", b"", time.monotonic() + seconds)
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(10)

    def hits(self) -> dict[str, int]:
        """The commands refused by the last fault, by name."""
        with self._lock:
            return dict(self.fault.hits)

    def refused_clients(self) -> dict[str, int]:
        """The refusals of the last fault, by the client's CLIENT SETNAME."""
        with self._lock:
            return dict(self.fault.clients)

    def __enter__(self) -> FaultProxy:
        client = redis.Redis(port=self.upstream)
        try:
            for name, info in client.command().items():
                self._flags[name.upper().encode()] = {
                    f if isinstance(f, bytes) else str(f).encode() for f in info["flags"]
                }
        finally:
            client.close()
        if not any(b"blocking" in flags for flags in self._flags.values()):
            for name in _BLOCKING_BEFORE_7:
                self._flags.setdefault(name, set()).add(b"blocking")
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            await self._close_all()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    # -- the proxy (on its own event loop) --------------------------------------

    def _active(self) -> _Fault | None:
        with self._lock:
            fault = self.fault
        return fault if fault.target is not None and time.monotonic() < fault.until else None

    def _refused(self, words: list[bytes], client: str = "?") -> bytes | None:
        """The error reply for this command under the fault now in force, if any."""
        fault = self._active()
        if fault is None or fault.target == "drop" or not words:
            return None
        name = words[0].upper()
        flags = self._flags.get(name, set())
        if fault.target == "writes":
            hit = bool(flags & {b"write", b"may_replicate"}) or name in _SCRIPTS
        elif fault.target == "blocking":
            hit = b"blocking" in flags or name == b"WAIT"
        else:
            hit = name not in _HANDSHAKE
        if not hit:
            return None
        with self._lock:
            key = name.decode()
            fault.hits[key] = fault.hits.get(key, 0) + 1
            fault.clients[client] = fault.clients.get(client, 0) + 1
        return fault.reply

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        fault = self._active()
        if fault is not None and fault.target == "drop":
            client_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            client_w.transport.abort()
            return
        self._writers.update((client_w, up_w))
        try:
            await self._relay(client_r, client_w, up_r, up_w)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            for w in (client_w, up_w):
                self._writers.discard(w)
                w.transport.abort()

    async def _relay(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        in_multi = aborted = False
        client = "?"  # its CLIENT SETNAME, for hits()
        while True:
            raw = await _read_value(client_r)
            words = _command(raw)
            name = words[0].upper() if words else b""
            if words[:2] and [w.upper() for w in words[:2]] == [b"CLIENT", b"SETNAME"]:
                client = words[2].decode(errors="replace") if len(words) > 2 else "?"
            refusal = self._refused(words, client)
            if in_multi and name in (b"EXEC", b"DISCARD"):
                in_multi = False
                if aborted or refusal is not None:
                    # The transaction is discarded upstream, never left open.
                    up_w.write(b"*1\r\n$7\r\nDISCARD\r\n")
                    await up_w.drain()
                    await _read_value(up_r)
                    if name == b"DISCARD":
                        client_w.write(b"+OK\r\n")
                    elif refusal is not None:
                        client_w.write(refusal)
                    else:
                        client_w.write(
                            b"-EXECABORT Transaction discarded because of previous errors.\r\n"
                        )
                    aborted = False
                    await client_w.drain()
                    continue
            if refusal is not None:
                aborted = aborted or in_multi
                client_w.write(refusal)
                await client_w.drain()
                continue
            if name == b"MULTI":
                in_multi = True
            up_w.write(raw)
            await up_w.drain()
            self.forwarded += 1
            if name in _PIPE_AFTER:
                await self._pipe(client_r, client_w, up_r, up_w)
                return
            reply = await _read_value(up_r)
            client_w.write(reply)
            await client_w.drain()

    @staticmethod
    async def _pipe(
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

        tasks = [
            asyncio.ensure_future(copy(client_r, up_w)),
            asyncio.ensure_future(copy(up_r, client_w)),
        ]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task


def _bulk(text: str) -> bytes:
    data = text.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class StaleSentinel:
    """A sentinel that has not heard of a failover: to ``SENTINEL MASTERS`` (and
    ``GET-MASTER-ADDR-BY-NAME``) it names the primary it was told, healthy, at
    configuration epoch 0, whatever the other sentinels did since; every other
    command gets +OK. Put first in a Sentinel URL, it is the first answer a
    client gets, as a lagging sentinel's is in the window after a failover."""

    def __init__(self, service: str, primary: int, port: int) -> None:
        self.service, self.primary, self.port = service, primary, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> StaleSentinel:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

        self._thread.start()
        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _state(self) -> bytes:
        fields = {"name": self.service, "ip": "127.0.0.1", "port": str(self.primary),
                  "runid": "0" * 40, "flags": "master", "num-other-sentinels": "2",
                  "config-epoch": "0", "quorum": "2", "num-slaves": "1"}  # fmt: skip
        body = b"".join(_bulk(k) + _bulk(v) for k, v in fields.items())
        return b"*%d\r\n%s" % (2 * len(fields), body)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                words = [w.upper() for w in _command(await _read_value(reader))]
                if words[:2] == [b"SENTINEL", b"MASTERS"]:
                    writer.write(b"*1\r\n" + self._state())
                elif words[:1] == [b"HELLO"]:  # (a RESP2 server: the client falls back)
                    writer.write(b"-ERR unknown command 'HELLO'\r\n")
                elif words[:2] == [b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME"]:
                    writer.write(b"*2\r\n" + _bulk("127.0.0.1") + _bulk(str(self.primary)))
                else:
                    writer.write(b"+OK\r\n")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()
