"""A decode engine's SSE stream on its way to the client.

``DecodeStream`` wraps ``Upstream.stream`` for one exchange: it keeps the first
chunk when the flow waits for it (``first``: the KV report of ``proxy.kv_report``
needs the KV loaded), marks the exchange's KV read once a chunk came, times the
chunks, and ends the decode leg exactly once (``aclose``). ``RelayResponse``
sends it and, however the response ends, closes it and then the exchange
(``Exchange.close``: its KV released if no chunk ever came, its slot given
back, the request counted); a stream the engine ended closes its exchange
before the response's last frame, so a client that read the whole answer
never finds its own slot still taken. A client that stops reading is cut
after ``stream_write_timeout_s`` (``BoundedSend``), which ends the stream as
its leaving would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from proxy.engine_client import EngineResponse
from proxy.errors import UpstreamFailed
from proxy.exchange import Exchange
from proxy.pool import EngineState

__all__ = ["BoundedSend", "DecodeStream", "Moved", "Mover", "RelayResponse", "StreamCut"]

logger = logging.getLogger(__name__)


class Moved(NamedTuple):
    """Where a stream goes on after its decode engine failed (``Mover``): the new engine's leg, the rewrite of
    its bytes, and what the client is told first (an SSE comment)."""

    chunks: AsyncIterator[bytes]
    response: EngineResponse
    engine: EngineState
    rewrite: Callable[[bytes], bytes] | None
    note: bytes


Mover = Callable[[UpstreamFailed, bool], Awaitable["Moved | bytes"]]
"""Called when the decode engine fails mid-stream, with whether anything reached the client: the leg that goes on
(``Moved``), or the stream's last bytes (its end, or the error event)."""


class DecodeStream:
    """A decode engine's SSE stream on its way to the client; ``aclose`` ends the decode leg exactly once.

    An async generator could not promise that: one never started (the client left
    before the response's headers went out) runs no ``finally``. ``rewrite`` turns
    the engine's bytes into the client's (``proxy.continuation.StreamLedger``);
    when the engine fails, ``mover`` says how the stream goes on (its default: it
    ends with the error event), and the failed engine's leg ends at once.
    """

    __slots__ = (
        "engine", "_chunks", "_response", "_exchange", "_started", "_closed", "_leg_over", "_relayed", "_pending",
        "_generated", "_rewrite", "_mover",
    )  # fmt: skip

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        response: EngineResponse,
        engine: EngineState,
        exchange: Exchange,
        rewrite: Callable[[bytes], bytes] | None = None,
        mover: Mover | None = None,
    ) -> None:
        self._chunks, self._response, self.engine, self._exchange = chunks, response, engine, exchange
        self._started = self._closed = self._leg_over = self._relayed = False
        self._pending: list[bytes] = []
        # Whether a chunk shows the engine generating (so it has loaded the KV): its API says.
        self._generated = exchange.api.generated
        self._rewrite = rewrite
        self._mover = mover

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
        while True:
            try:
                chunk = await anext(self._chunks)
                if self._rewrite is not None:
                    chunk = self._rewrite(chunk)
            except StopAsyncIteration:
                await self.aclose()
                self._exchange.close(200)  # before the response's end goes out: a client that read it finds it free
                raise
            except UpstreamFailed as failure:
                try:
                    chunk = await self._moved(failure)
                except BaseException:
                    await self.aclose()
                    raise
            except BaseException:  # a cancellation
                await self.aclose()
                raise
            if chunk:
                break
        if not self._started and self._generated(chunk):
            self._started = True
            self._exchange.kv.read()
        if self._started:
            self._exchange.chunk_relayed()
        self._relayed = True
        return chunk

    async def _moved(self, failure: UpstreamFailed) -> bytes:
        """The engine failed: its leg ends; the stream goes on where ``mover`` says, or ends with its last bytes."""
        await self._end_leg()
        if self._mover is not None:
            moved = await self._mover(failure, self._relayed)
        else:
            moved = self._exchange.api.error_event(failure)
        if isinstance(moved, bytes):
            self._chunks = _ended()
            return moved
        self._chunks, self._response, self.engine, self._rewrite = moved[:4]
        self._leg_over = False
        return moved.note

    async def _end_leg(self) -> None:
        if self._leg_over:
            return
        self._leg_over = True
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._response.release()
            self.engine.end_leg()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._end_leg()
        if not self._started:
            logger.info(
                "request %s: decode engine %s's stream ended before its first chunk",
                self._exchange.request_id, self.engine.engine_id,
            )  # fmt: skip


async def _ended() -> AsyncIterator[bytes]:
    return
    yield  # an async generator that yields nothing


class RelayResponse(StreamingResponse):
    """A ``StreamingResponse`` of a ``DecodeStream`` that, however it ends, closes the stream, then the exchange;
    a client that takes nothing for ``write_timeout_s`` while it has more to send is cut (``BoundedSend``)."""

    def __init__(self, stream: DecodeStream, exchange: Exchange, write_timeout_s: float) -> None:
        headers = exchange.reply_headers | {"Cache-Control": "no-cache"}
        super().__init__(stream, media_type="text/event-stream", headers=headers)
        self.exchange = exchange
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bounded = BoundedSend(send, receive, self.write_timeout_s, self.exchange.request_id)
        try:
            await super().__call__(scope, receive, bounded)
        except StreamCut:
            pass  # the client's connection could not be reached: the server closes it
        finally:
            bounded.close()
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                self.exchange.close(200)


class StreamCut(Exception):
    """A stream's client took nothing for the write timeout (``BoundedSend``)."""


class BoundedSend:
    """A response's ASGI ``send`` that cuts the client off when one send has waited ``timeout_s`` for it.

    A send waits only when the client stops reading and the connection's buffers fill (uvicorn's flow control);
    without a bound the stream would hold its admission slot and its decode engine's sequence for as long as the
    client stays connected. Once a send has waited ``timeout_s``, the client's connection is aborted (uvicorn's
    transport, reached through ``receive``'s cycle, as ``proxy.disconnect`` reaches it): to uvicorn and
    Starlette the client is gone, the stream ends and its ``RelayResponse`` closes the engine's request and the
    exchange. Under a server whose connection it cannot reach, the waiting send is cancelled and raises
    ``StreamCut`` instead. One timer per stream, armed at most once per ``timeout_s``: a send costs a clock read.
    """

    __slots__ = ("_send", "_receive", "_timeout_s", "_request_id", "_loop", "_since", "_sender", "_timer", "cut")

    def __init__(self, send: Send, receive: Receive, timeout_s: float, request_id: str) -> None:
        self._send, self._receive, self._timeout_s, self._request_id = send, receive, timeout_s, request_id
        self._loop = asyncio.get_running_loop()
        self._since = 0.0
        self._sender: asyncio.Task | None = None
        """The task whose send is under way (None between sends)."""
        self._timer: asyncio.TimerHandle | None = None
        self.cut = False

    async def __call__(self, message: Message) -> None:
        self._since = self._loop.time()
        self._sender = asyncio.current_task()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._timeout_s, self._check)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if self.cut and self._sender is not None and self._sender.uncancel() == 0:
                waited = f"request {self._request_id}: the client read nothing for {self._timeout_s:g} s"
                raise StreamCut(waited) from None
            raise
        finally:
            self._sender = None

    def _check(self) -> None:
        self._timer = None
        if self._sender is None:
            return  # no send waits: the next one arms the timer again
        overdue = self._since + self._timeout_s
        if self._loop.time() < overdue:
            self._timer = self._loop.call_at(overdue, self._check)
            return
        self.cut = True
        logger.warning(
            "request %s: its client read nothing of the stream for %.3g s; the stream is cut",
            self._request_id, self._timeout_s,
        )  # fmt: skip
        transport = getattr(getattr(self._receive, "__self__", None), "transport", None)  # uvicorn's cycle
        if transport is not None and hasattr(transport, "abort"):
            transport.abort()  # as if the client had gone: the waiting send returns, the stream ends
        else:
            self._sender.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
