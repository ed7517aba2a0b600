"""The web's open streams and waiting requests, counted against PARKQ_MAX_STREAMS.

Each open SSE stream and each non-streamed request waiting for its job holds a
web thread for as long as it lasts (minutes for a long job). Past the cap a new
one is refused at once with 503 and Retry-After, before any job is queued, and
the threads kept beyond the cap answer everything else (/healthz, job status,
files) without waiting behind the streams.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from web.errors import ServerBusy

__all__ = ["SPARE_THREADS", "Slots"]

#: Web threads beyond PARKQ_MAX_STREAMS: /healthz and short requests never wait
#: behind open streams.
SPARE_THREADS = 32


class Slots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> Callable[[], None]:
        """A slot, or :class:`ServerBusy`; returns its release (idempotent)."""
        with self._lock:
            if self.used >= self.limit:
                raise ServerBusy(
                    f"The server holds its limit of {self.limit} open streams and waiting "
                    "requests (PARKQ_MAX_STREAMS); retry shortly.",
                    retry_after=2,
                )
            self.used += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.used -= 1

        return release
