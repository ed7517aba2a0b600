"""`parkq web` whose stream-reader registration fails on a call the test picks.

Run as ``python -m tests.faultreaders --port PORT`` (the arguments of ``parkq
web``) with ``PARKQ_TEST_READER_FAIL=N``: the Nth call of the reader script
(Store._run("reader", ...), counted from 1 across the process) raises
``redis.ConnectionError`` instead of reaching Redis.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any


def _install() -> None:
    fail = int(os.environ.get("PARKQ_TEST_READER_FAIL", "0"))
    if not fail:
        return
    import redis

    from jobs.store.scheduling import Store

    original = Store._run
    lock = threading.Lock()
    calls = [0]

    def run(self: Store, name: str, keys: list[str], args: list[Any]) -> Any:
        if name == "reader":
            with lock:
                calls[0] += 1
                failing = calls[0] == fail
            if failing:
                raise redis.ConnectionError("injected: the reader registration failed")
        return original(self, name, keys, args)

    Store._run = run  # type: ignore[method-assign]


if __name__ == "__main__":
    _install()
    from tools.cli import main

    sys.argv = ["parkq", "web", *sys.argv[1:]]
    main()
