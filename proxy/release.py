"""Telling a prefill engine that nobody will read a request's KV blocks, so it frees them at once.

A prefill engine running the ``pdserve`` connector returns, in its
``kv_transfer_params``, a ``pdserve_release`` entry: side-channel endpoints
(``tcp://host:port``, one per TP rank) and an opaque message. When the client
goes away or the decode leg fails before the decode engine read the blocks,
the proxy sends the message to each endpoint; the engine frees the blocks
instead of holding them until their lease expires. The proxy does not know the message's format, only
where to send it. Engines of other connectors return no such entry, and
nothing is sent.

``ask`` is the proxy's side-channel client (here and in ``proxy.kv_report``):
one TCP connection per request, the message and the answer each one frame
(``contract.framing``), the whole exchange within a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from contract import wire
from contract.framing import MAX_FRAME_BYTES, frame, read_frame

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


async def ask(endpoint: str, message: bytes, timeout_s: float) -> bytes | None:
    """One request-reply exchange with an engine's side channel; None if no answer came in ``timeout_s``.
    ``OSError`` if it cannot be reached, ``FramingError`` for an answer that is not one frame of at most
    ``MAX_FRAME_BYTES`` (refused before its body is read)."""
    try:
        return await asyncio.wait_for(_exchange(endpoint, message), timeout_s)
    except TimeoutError:
        return None


async def _exchange(endpoint: str, message: bytes) -> bytes:
    host, port = wire.parse_tcp_endpoint(endpoint)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(frame(message))
        await writer.drain()
        return await read_frame(reader, MAX_FRAME_BYTES)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class KVReleaser:
    """Sends releases in the background; ``close()`` waits for the ones under way."""

    def __init__(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
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
            reply = await ask(endpoint, message, self._timeout_s)
        except (OSError, ValueError) as e:  # unreachable, not tcp://host:port, or not one of our frames
            logger.warning("request %s: KV release to %s failed: %s", request_id, endpoint, e)
            return
        if reply is None:
            logger.warning("request %s: no answer from %s to a KV release", request_id, endpoint)
            return
        self.sent += 1
        logger.info("request %s: released its KV blocks at %s (%s)", request_id, endpoint, reply[:40])

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self._timeout_s + 1)
