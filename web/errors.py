"""Typed API errors, each with its HTTP status and OpenAI error type/code."""

from __future__ import annotations

from typing import Any

import redis
from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

__all__ = [
    "APIError",
    "BadRequest",
    "Conflict",
    "ContextLengthExceeded",
    "NotFound",
    "PayloadTooLarge",
    "ServerBusy",
    "TooManyRequests",
    "Unauthorized",
    "error_body",
    "init_app",
]


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class Gone(APIError):
    status = 410
    type = "invalid_request_error"
    code = "expired"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class TooManyRequests(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, message: str, retry_after: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ServerBusy(APIError):
    """Every slot for an open stream or waiting request is taken (PARKQ_MAX_STREAMS)."""

    status = 503
    type = "server_error"
    code = "server_busy"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelMismatch(APIError):
    """The live workers serve another model than the one this server tokenizes for."""

    status = 503
    type = "server_error"
    code = "model_mismatch"


_HTTP_CODES = {
    400: ("invalid_request_error", "bad_request"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def init_app(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError) -> Any:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if isinstance(exc, (TooManyRequests, ServerBusy)):
            headers["Retry-After"] = str(exc.retry_after)
        return jsonify(exc.body()), exc.status, headers

    @app.errorhandler(redis.RedisError)
    def _redis_error(exc: redis.RedisError) -> Any:
        # Redis down, failing over, refusing writes or out of connections: the
        # request did not happen (or its job waits in Redis); the client retries.
        app.logger.warning("Redis: %s: %s", type(exc).__name__, exc)
        body = error_body("The job store (Redis) is unavailable; retry shortly.",
                          "server_error", None, "store_unavailable")  # fmt: skip
        return jsonify(body), 503, {"Retry-After": "1"}

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        status = exc.code or 500
        type_, code = _HTTP_CODES.get(status, ("server_error", "http_error"))
        message = exc.description or exc.name
        if status == 413:
            limit = request.max_content_length
            message = f"Request body is larger than the limit of {limit} bytes."
        headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
        return jsonify(error_body(message, type_, None, code)), status, headers

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Any:
        app.logger.exception("unexpected error")
        return jsonify(error_body("Internal server error.", "server_error", None, None)), 500
