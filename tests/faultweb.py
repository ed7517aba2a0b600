"""`parkq web` with faults injected by the tests, never by production settings.

Run as ``python -m tests.faultweb --port PORT`` (the arguments of ``parkq web``).
Each fault is off unless its environment variable is set:

- ``PARKQ_TEST_VALIDATION_GATE``: a path; a Batch API validation waits until a
  file exists there before it reads the batch's lines (a validation held for as
  long as the test needs, whatever this machine's speed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any


def _install() -> None:
    gate = os.environ.get("PARKQ_TEST_VALIDATION_GATE")
    if gate:
        from web import batches

        original = batches._validate_lines

        def held(store: Any, batch_id: str) -> None:
            while not Path(gate).exists():
                time.sleep(0.05)
            original(store, batch_id)

        batches._validate_lines = held  # type: ignore[assignment]


if __name__ == "__main__":
    _install()
    from tools.cli import main

    sys.argv = ["parkq", "web", *sys.argv[1:]]
    main()
