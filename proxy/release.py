"""Telling a prefill engine that nobody will read a request's KV blocks, so it frees them at once.

A prefill engine running the ``pdserve`` connector returns, in its
``kv_transfer_params``, a ``pdserve_release`` entry: ZMQ endpoints (one per
TP rank) and an opaque message. When the client goes away or the decode leg
fails before the decode engine read the blocks, the proxy sends the message
to each endpoint; the engine frees the blocks instead of holding them until
their lease expires. The proxy does not know the message's format, only
where to send it. Engines of other connectors return no such entry, and
nothing is sent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import zmq
import zmq.asyncio

from connectors import wire

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


async def ask(context: zmq.asyncio.Context, endpoint: str, message: bytes, timeout_ms: int) -> bytes | None:
    """One request-reply exchange with an engine's side channel; None if no answer came in ``timeout_ms``."""
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        await socket.send(message)
        return await socket.recv() if await socket.poll(timeout_ms) else None
    finally:
        socket.close()


class KVReleaser:
    """Sends releases in the background; ``close()`` waits for the ones under way."""

    def __init__(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self._context = zmq.asyncio.Context()
        self._timeout_ms = int(timeout_s * 1000)
        self._tasks: set[asyncio.Task] = set()
        self.sent = 0

    def release(self, kv_params: dict[str, Any] | None, request_id: str) -> bool:
        """Start releasing the blocks ``kv_params`` name; False if they name no release endpoint."""
        spec = (kv_params or {}).get(wire.PDSERVE_RELEASE)
        if not isinstance(spec, dict) or not spec.get("endpoints") or not isinstance(spec.get("message"), str):
            return False
        task = asyncio.get_running_loop().create_task(self._send_all(spec["endpoints"], spec["message"], request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send_all(self, endpoints: list[str], message: str, request_id: str) -> None:
        await asyncio.gather(*(self._send(str(endpoint), message.encode(), request_id) for endpoint in endpoints))

    async def _send(self, endpoint: str, message: bytes, request_id: str) -> None:
        try:
            reply = await ask(self._context, endpoint, message, self._timeout_ms)
        except zmq.ZMQError as e:
            logger.warning("request %s: KV release to %s failed: %s", request_id, endpoint, e)
            return
        if reply is None:
            logger.warning("request %s: no answer from %s to a KV release", request_id, endpoint)
            return
        self.sent += 1
        logger.info("request %s: released its KV blocks at %s (%s)", request_id, endpoint, reply[:40])

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self._timeout_ms / 1000 + 1)
        self._context.term()
