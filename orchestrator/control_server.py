"""The controller's side of its HTTP API (``orchestrator.control`` defines the routes and the client).

An aiohttp server on the controller actor's own event loop, so a handler
calls the controller's coroutines directly. Every route but ``/health``
needs the cluster's token; errors are JSON ``{"error": {"message", "type"}}``
like the proxy's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from orchestrator.control import HEALTH_PATH, MOVE_PATH, SCALE_PATH, SHUTDOWN_PATH, STATUS_PATH, token_matches

logger = logging.getLogger(__name__)


class Controlled(Protocol):
    """What the API serves: the controller (a fake in unit tests)."""

    async def status(self) -> dict[str, Any]: ...

    async def scale(
        self, targets: dict[str, int], reason: str = "by hand", model: str | None = None
    ) -> dict[str, Any]: ...

    async def move(
        self, source: str, destination: str, count: int = 1, reason: str = "by hand", model: str | None = None
    ) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


class ControlServer:
    """Serves ``controller`` on ``host:port`` (0: a free port, kept across restarts by the caller)."""

    def __init__(
        self,
        controller: Controlled,
        token_sha256: str,
        host: str,
        port: int = 0,
        after_shutdown: Callable[[], Awaitable[None]] | None = None,
    ):
        if not token_sha256:
            raise ValueError("the controller API needs a token digest")
        self._controller, self._digest = controller, token_sha256
        self.host, self.port = host, port
        self._after_shutdown = after_shutdown
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Listen (idempotent); return the API's URL."""
        if self._runner is not None:
            return self.url
        app = web.Application(middlewares=[self._auth])
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_post(SCALE_PATH, self._scale)
        app.router.add_post(MOVE_PATH, self._move)
        app.router.add_post(SHUTDOWN_PATH, self._shutdown)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted controller takes its port back
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner
        logger.info("controller API on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path != HEALTH_PATH and not token_matches(request.headers.get("Authorization"), self._digest):
            return _error(401, "missing or wrong token (Authorization: Bearer <the cluster's token>)", "unauthorized")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self._controller.status())

    async def _scale(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            targets = body["targets"]
            if not isinstance(targets, dict) or not all(
                isinstance(role, str) and isinstance(n, int) and not isinstance(n, bool) for role, n in targets.items()
            ):
                raise TypeError("targets must map pool names to whole numbers")
            model = _model(body)
        except (ValueError, KeyError, TypeError) as e:
            return _error(400, f'expected {{"targets": {{"prefill": N, "decode": M}}}}: {e}', "invalid_request")
        answer = await self._controller.scale(targets, str(body.get("reason") or "by hand"), model)
        if "error" in answer:
            return _error(409, answer["error"], "conflict")
        return web.json_response(answer)

    async def _move(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            source, destination, count = body["from"], body["to"], body.get("count", 1)
            if not (isinstance(source, str) and isinstance(destination, str)):
                raise TypeError("from and to must be pool names")
            if not isinstance(count, int) or isinstance(count, bool):
                raise TypeError("count must be a whole number")
            model = _model(body)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return _error(400, f'expected {{"from": "prefill", "to": "decode", "count": N}}: {e}', "invalid_request")
        answer = await self._controller.move(source, destination, count, str(body.get("reason") or "by hand"), model)
        if "error" in answer:
            return _error(409, answer["error"], "conflict")
        return web.json_response(answer)

    async def _shutdown(self, request: web.Request) -> web.Response:
        await self._controller.shutdown()
        if self._after_shutdown is not None:
            # After the answer is on its way: the controller may exit its process then.
            asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(self._after_shutdown()))
        return web.json_response({"stopped": True})


def _model(body: dict[str, Any]) -> str | None:
    """The model a change names (its served name or key), or None."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise TypeError("model must be a model's name")
    return model
