"""Serve the Flask app with gunicorn: one process, a thread per open stream."""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from scheduler.settings import Settings

__all__ = ["serve"]


class _Gunicorn(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options: dict[str, Any] = {
            "bind": f"{s.host}:{s.port}",
            "workers": 1,
            "worker_class": "gthread",
            "threads": s.web_threads,
            "timeout": 60,
            "graceful_timeout": 5,
            "keepalive": 5,
            "loglevel": s.log_level.lower(),
            "accesslog": None,
            "control_socket_disable": True,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from web.app import create_app

        return create_app(self.settings)


def serve(settings: Settings) -> None:
    _Gunicorn(settings).run()
