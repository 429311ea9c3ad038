"""A decode engine's SSE stream on its way to the client.

``DecodeStream`` wraps ``Upstream.stream`` for one exchange: it keeps the first
chunk when the flow waits for it (``first``: the KV report of ``proxy.kv_report``
needs the KV loaded), marks the exchange's KV read once a chunk came, times the
chunks, and ends the decode leg exactly once (``aclose``). ``RelayResponse``
sends it and, however the response ends, closes it and then the exchange
(``Exchange.close``: its KV released if no chunk ever came, its slot given
back, the request counted); a stream the engine ended closes its exchange
before the response's last frame, so a client that read the whole answer
never finds its own slot still taken.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.engine_client import EngineResponse
from proxy.exchange import Exchange
from proxy.pool import EngineState

__all__ = ["DecodeStream", "RelayResponse", "responses_generated"]

logger = logging.getLogger(__name__)


class DecodeStream:
    """A decode engine's SSE stream on its way to the client; ``aclose`` ends the decode leg exactly once.

    An async generator could not promise that: one never started (the client left
    before the response's headers went out) runs no ``finally``.
    """

    __slots__ = ("engine", "_chunks", "_response", "_exchange", "_started", "_closed", "_pending", "_generated")

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        response: EngineResponse,
        engine: EngineState,
        exchange: Exchange,
        generated: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._chunks, self._response, self.engine, self._exchange = chunks, response, engine, exchange
        self._started = self._closed = False
        self._pending: list[bytes] = []
        # Whether a chunk shows the engine generating (so it has loaded the KV): any chunk of a chat or a
        # completion; for the Responses API, an event past response.created and response.in_progress.
        self._generated = generated or _any_chunk

    def __aiter__(self) -> DecodeStream:
        return self

    async def first(self) -> bytes | None:
        """Wait for the first generated chunk, keeping what came for the response; None if the stream ended
        without one."""
        while not self._started:
            try:
                self._pending.append(await self._next())
            except StopAsyncIteration:
                return None
        return self._pending[-1]

    async def __anext__(self) -> bytes:
        if self._pending:
            return self._pending.pop(0)
        return await self._next()

    async def _next(self) -> bytes:
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            await self.aclose()
            self._exchange.close(200)  # before the response's end goes out: a client that read it finds its slot free
            raise
        except BaseException:  # a failure or a cancellation
            await self.aclose()
            raise
        if not self._started and self._generated(chunk):
            self._started = True
            self._exchange.kv.read()
        if self._started:
            self._exchange.chunk_relayed()
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._response.release()
            self.engine.end_leg()
            if not self._started:
                logger.info(
                    "request %s: decode engine %s's stream ended before its first chunk",
                    self._exchange.request_id, self.engine.engine_id,
                )  # fmt: skip


def _any_chunk(chunk: bytes) -> bool:
    return True


_RESPONSES_PREAMBLE = (b"response.created", b"response.in_progress")


def responses_generated(chunk: bytes) -> bool:
    """A Responses API stream's chunk holds an event past the preamble vLLM sends before the engine has run
    (``response.created``, ``response.in_progress``)."""
    return any(
        line.startswith(b"event: ") and line[7:].strip() not in _RESPONSES_PREAMBLE for line in chunk.split(b"\n")
    )


class RelayResponse(StreamingResponse):
    """A ``StreamingResponse`` of a ``DecodeStream`` that, however it ends, closes the stream, then the exchange."""

    def __init__(self, stream: DecodeStream, exchange: Exchange) -> None:
        headers = exchange.reply_headers | {"Cache-Control": "no-cache"}
        super().__init__(stream, media_type="text/event-stream", headers=headers)
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.exchange.close(200)
