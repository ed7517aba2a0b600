"""The Flask application factory."""

from __future__ import annotations

from pathlib import Path

import redis
from flask import Flask
from werkzeug.middleware.proxy_fix import ProxyFix

from jobs.engine.prompts import spellings
from jobs.store.connect import connect
from jobs.store.rqjobs import RQBridge
from jobs.store.scheduling import Store
from scheduler.settings import Settings
from web import access, auth, errors, requestid
from web.runtime import Runtime, VocabLike
from web.slots import SPARE_THREADS, Slots

__all__ = ["create_app", "model_name", "stream_slots"]


def model_name(settings: Settings) -> str:
    if settings.model_alias:
        return settings.model_alias
    return Path(settings.model or "model").name.removesuffix(".gguf")


def stream_slots(settings: Settings, app: Flask | None = None) -> int:
    """PARKQ_MAX_STREAMS, or fewer when PARKQ_WEB_THREADS leaves no room for it:
    SPARE_THREADS threads always stay free for /healthz and short requests."""
    if settings.web_threads is None:
        return settings.max_streams
    room = max(1, settings.web_threads - SPARE_THREADS)
    if room < settings.max_streams and app is not None:
        app.logger.warning(
            "PARKQ_WEB_THREADS=%d leaves room for %d open streams (PARKQ_MAX_STREAMS=%d): "
            "%d threads stay free for /healthz and short requests",
            settings.web_threads, room, settings.max_streams, SPARE_THREADS,
        )  # fmt: skip
    return min(settings.max_streams, room)


def create_app(
    settings: Settings,
    *,
    vocab: VocabLike | None = None,
    client: redis.Redis | None = None,
) -> Flask:
    """Build the app. ``vocab`` and ``client`` default to the model's vocabulary
    and a Redis client for ``settings.redis_url`` (tests pass their own)."""
    if client is None:
        if not settings.redis_url:
            raise ValueError("PARKQ_REDIS_URL is required")
        # Each web thread holds at most one connection at a time, and an open stream
        # a pub/sub connection beside it (redis-py's pool stops at 100 by default).
        threads = settings.web_threads or settings.max_streams + SPARE_THREADS
        client = connect(
            settings.redis_url,
            store_key=settings.keys.store_id,
            health_check_interval=30,
            max_connections=2 * threads + 64,
        )
    identity = None
    if vocab is None:
        if not settings.model:
            raise ValueError("PARKQ_MODEL is required")
        from jobs.engine.llama import Vocab
        from jobs.store.identity import identify

        loaded = Vocab(settings.model, settings.chat_format)
        n_ctx = settings.n_ctx or loaded.n_ctx_train
        identity = identify(model_name(settings), settings.model, loaded, n_ctx, settings.cache_dir)
        vocab = loaded

    app = Flask(__name__)
    if settings.trusted_proxies:
        n = settings.trusted_proxies
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=n, x_proto=n)  # type: ignore[method-assign]
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["parkq"] = Runtime(
        settings=settings,
        store=Store(client, settings, identity),
        rq=RQBridge(client, settings.queue_name, settings.result_ttl),
        vocab=vocab,
        model_name=model_name(settings),
        identity=identity,
        slots=Slots(stream_slots(settings, app)),
    )
    # The control-token spellings chat prompts are checked against, built once
    # here (about a second for a 262k-token vocabulary), not on a first request.
    spellings(vocab.control_texts())
    requestid.init_app(app)
    app.extensions["parkq.http"] = access.init_app(
        app, app.extensions["parkq"].store.telemetry, settings.access_log
    )
    errors.init_app(app)
    auth.init_app(app, settings.api_key_entries)
    from web.api import bp
    from web.batches import bp as batches_bp
    from web.dashboard import bp as dashboard_bp
    from web.files import bp as files_bp
    from web.metrics import bp as metrics_bp
    from web.openapi import bp as openapi_bp
    from web.responses_api import bp as responses_bp
    from web.usage import bp as usage_bp

    app.register_blueprint(bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(files_bp)
    app.register_blueprint(batches_bp)
    app.register_blueprint(metrics_bp)
    app.register_blueprint(usage_bp)
    app.register_blueprint(openapi_bp)
    app.register_blueprint(dashboard_bp)
    return app
