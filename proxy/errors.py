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

    Not a ``ProxyError``: ``proxy.flow`` turns it into ``UpstreamFailed``, naming the engine and phase.
    """


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: ProxyError) -> Response:
    return Response(
        orjson.dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers
    )
