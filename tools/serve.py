"""Serve the Flask app with gunicorn: one process, a thread per open stream
(PARKQ_MAX_STREAMS of them, web/slots.py) and spare threads for the rest."""

from __future__ import annotations

from typing import Any

from gunicorn import glogging
from gunicorn.app.base import BaseApplication

from scheduler.settings import Settings
from tools.logs import formatter
from web.slots import SPARE_THREADS

__all__ = ["serve"]


class _Logger(glogging.Logger):  # type: ignore[misc]
    """gunicorn's own lines in parkq's format (PARKQ_LOG_FORMAT), like every other line."""

    log_format = "text"

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        for log in (self.error_log, self.access_log):
            for handler in log.handlers:
                handler.setFormatter(formatter(self.log_format))


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
            "threads": s.web_threads or s.max_streams + SPARE_THREADS,
            # Connections gunicorn accepts and queues for a thread: every stream
            # slot and spare thread, and some waiting beyond.
            "worker_connections": max(1000, (s.web_threads or s.max_streams + SPARE_THREADS) + 256),
            "timeout": 60,
            "graceful_timeout": 5,
            "keepalive": 5,
            "loglevel": s.log_level.lower(),
            "accesslog": None,
            "control_socket_disable": True,
            "logger_class": type("_ParkqLogger", (_Logger,), {"log_format": s.log_format}),
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from web.app import create_app
        from web.janitor import start_janitor
        from web.webhooks import start_sender

        app = create_app(self.settings)
        start_janitor(app)  # in the serving process (gunicorn loads the app after its fork)
        start_sender(app.extensions["parkq"].store, self.settings)  # batch webhooks, if set
        return app


def serve(settings: Settings) -> None:
    _Gunicorn(settings).run()
