"""Logging setup for the entry points (and only for them)."""

from __future__ import annotations

import json
import logging
import sys

__all__ = ["configure_logging", "formatter"]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def formatter(fmt: str) -> logging.Formatter:
    """parkq's log line format: ``json`` (one object per line) or ``text``."""
    if fmt == "json":
        return _JsonFormatter()
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s %(process)d: %(message)s")


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # RQ logs every registry write at INFO; keep its noise down.
    logging.getLogger("rq").setLevel(logging.WARNING)
