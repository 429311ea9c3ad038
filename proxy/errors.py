"""The proxy's errors, each with its HTTP status and OpenAI's error body.

OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.
HTTP status codes are chosen here and nowhere else in the project.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


class ProxyError(Exception):
    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(ProxyError):
    status, error_type, code = 400, "invalid_request_error", None


class ModelNotFound(ProxyError):
    status, error_type, code = 404, "invalid_request_error", "model_not_found"


class NoHealthyEngine(ProxyError):
    status, error_type, code = 503, "service_unavailable", "no_healthy_engine"


class InvalidApiKey(ProxyError):
    """No API key, or not one of the configured keys (OpenAI's answer to a wrong key)."""

    status, error_type, code = 401, "invalid_request_error", "invalid_api_key"


class RequestTooLarge(ProxyError):
    status, error_type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(ProxyError):
    """The client did not send its whole body in time (``proxy.limits.read_body``); the connection is closed
    after the answer, as the rest of the body may still be on its way."""

    status, error_type, code = 408, "invalid_request_error", "request_timeout"


class ContextLengthExceeded(ProxyError):
    """The request cannot fit the model's context (OpenAI's ``context_length_exceeded``)."""

    status, error_type, code = 400, "invalid_request_error", "context_length_exceeded"


class TooManyRequests(ProxyError):
    """Every request slot is taken and the queue is full; OpenAI's rate-limit answer, with ``Retry-After``."""

    status, error_type, code = 429, "requests", "rate_limit_exceeded"


class UnknownEngine(ProxyError):
    """An engine id that is not in the pool (``EnginePool.drain``, ``remove``, ``engine``)."""

    status, error_type, code = 404, "invalid_request_error", "engine_not_found"


class UpstreamFailed(ProxyError):
    """An engine failed (connection refused, reset, timeout, 5xx) mid-request.

    ``unreachable``: the failure was below HTTP (refused, reset, closed), which counts
    against the engine's health (``proxy.health``); a timeout or a 5xx does not.
    """

    status, error_type, code = 502, "upstream_error", "engine_failed"
    unreachable = False


class EngineConnectionError(Exception):
    """A call to an engine failed below HTTP: refused, reset, closed early, or an unreadable answer.

    Not a ``ProxyError``: ``proxy.upstream`` turns it into ``UpstreamFailed``, naming the engine and phase.
    """


class ClientGone(Exception):
    """The client closed its connection before its answer was ready; nobody is left to answer.

    Counted as HTTP 499 (nginx's "client closed request"); no answer is sent.
    """

    status = 499


class ProxyConfigError(Exception):
    """The proxy's settings cannot be used (e.g. an API key variable that is not set); raised at start-up."""


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: ProxyError) -> Response:
    return Response(
        orjson.dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers
    )
