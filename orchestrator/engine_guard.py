"""The engine's HTTP front door: the engine key on every route but the probes, and ``/health`` answered here.

vLLM's own ``--api-key`` check guards paths under ``/v1`` (and a few other
prefixes) only; vLLM 0.32 also serves ``/invocations``, ``/tokenize``,
``/detokenize``, ``/scale_elastic_ep`` and more, which reach the same handlers.
``guard`` wraps vLLM's whole ASGI app instead of listing its paths, so a route
a later vLLM adds is closed by default. Open without the key:

- ``GET /health``: the proxy's and the controller's liveness probe (answered
  here, before vLLM's middleware stack: ~6 ms of CPU instead of ~24 ms per
  probe of an idle engine). It says 503 when vLLM's engine core is dead or the
  engine's KV side channel stopped answering (``SideChannelWatch``);
- ``/metrics``: Prometheus scrapes it (and the controller's autoscaler reads
  it). It holds counters and gauges (queue, KV cache use, our KV plane), no
  prompt and no output.

Every other request (any method, websockets too) must carry ``Authorization:
Bearer <engine key>``; otherwise it gets 401 in OpenAI's error format, and a
websocket is closed with code 1008 before vLLM sees it.

Plain ASGI: no vLLM import, so it is unit-tested on its own.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["HEALTH_PATH", "METRICS_PATH", "OPEN_PATHS", "guard"]

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
OPEN_PATHS = frozenset({HEALTH_PATH, METRICS_PATH})
"""The only paths an engine answers without its key (exact paths: ``/metrics/x`` needs the key)."""

_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "this engine answers only its cluster: missing or wrong engine key (Authorization: Bearer)",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _presented_key(scope: Scope) -> bytes | None:
    """The bearer token of the request's (first) ``Authorization`` header, or None."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def guard(app: ASGIApp, engine_key: str, healthy: Callable[[], Awaitable[bool]]) -> ASGIApp:
    """``app`` behind the engine key; ``GET /health`` answers 200 or 503 as ``healthy()`` says."""
    expected = engine_key.encode()

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            return await app(scope, receive, send)
        path = scope.get("path", "")
        if kind == "http" and path == HEALTH_PATH and scope.get("method") == "GET":
            status = 200 if await healthy() else 503
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return None
        presented = _presented_key(scope)
        if path in OPEN_PATHS or (presented is not None and hmac.compare_digest(presented, expected)):
            return await app(scope, receive, send)
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_UNAUTHORIZED)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
        return None

    return serve
