"""The proxy's HTTP/1.1 client for its calls to engines: pooled keep-alive connections, parsed by httptools.

Every request costs the proxy two upstream calls (prefill, then decode), so the
client is on the hot path twice. aiohttp spent about 110 µs of CPU per call
here (URL, header and timer objects, a task per write); this client sends a
request as one prebuilt byte string in one ``write`` and lets httptools' C
parser call back into a small ``asyncio.Protocol`` (see scripts/bench_proxy.py
and the README for the numbers).

A call::

    response = await client.post(url, body, headers, timeout_s)  # returns once the headers are in (or client.get)
    payload = await response.read(timeout_s)                      # the whole body, or
    async for chunk in response.chunks(idle_timeout_s): ...       # the body as it comes (SSE)
    response.release()                                            # idempotent; read() releases itself

Connections are kept per engine (scheme, host, port) and reused last-in first-out.
One idle longer than ``idle_timeout_s`` is closed rather than reused: uvicorn,
which serves vLLM, drops idle connections after 5 s, and a request written on a
connection the server is closing is lost. Before a kept connection is reused,
its socket is checked for the engine's close (a FIN waiting to be read): such a
connection is dropped, and the request goes out on another. A request is sent
again only when it provably never reached the engine: a GET (``/health``,
``/metrics``: harmless to repeat) that died on a reused connection before any
byte came back. A POST that dies after it was written is never sent again: the
engine may have read it and started the work (a second prefill would run, and
one KV lease leak); the error goes up, and the caller's retry policy decides.
A response the caller stops reading before its end closes its connection.

Failures are ``EngineConnectionError`` (refused, reset, closed, malformed
answer) and ``TimeoutError``; an HTTP error status is not a failure here.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

from proxy.errors import EngineConnectionError

__all__ = ["EngineClient", "EngineResponse"]

CONNECT_TIMEOUT_S = 5.0
"""The default bound on opening a connection to an engine (``ProxyConfig.connect_timeout_s``)."""
IDLE_TIMEOUT_S = 4.0
"""Under uvicorn's default keep-alive (5 s): a connection idle longer than this is not reused."""
MAX_IDLE_PER_ENGINE = 512
READ_HIGH_WATER = 256 * 1024
"""A streamed body buffered past this many bytes pauses reading from the engine until the client catches up."""
READ_LOW_WATER = 64 * 1024


class EngineResponse:
    """One answer of an engine: ``status`` and ``headers`` when ``post`` returns, then the body."""

    __slots__ = (
        "status", "headers", "_connection", "_loop", "_chunks", "_buffered", "_done", "_error", "_waiter", "_released"
    )  # fmt: skip

    def __init__(self, connection: _Connection) -> None:
        self._loop = connection.loop
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._connection: _Connection | None = connection
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def read(self, timeout_s: float) -> bytes:
        """The whole body; the connection goes back to the pool. ``timeout_s`` bounds the wait for the rest."""
        try:
            deadline = time.monotonic() + timeout_s
            while not self._done and self._error is None:
                await self._wait(max(deadline - time.monotonic(), 0.0), timeout_s)
            if self._error is not None:
                raise self._error
            body = b"".join(self._chunks)
            self._chunks.clear()
            return body
        finally:
            self.release()

    async def chunks(self, idle_timeout_s: float) -> AsyncIterator[bytes]:
        """The body piece by piece as it arrives; no wait for the next piece may exceed ``idle_timeout_s``."""
        try:
            while True:
                if self._chunks:
                    chunk = self._chunks.popleft()
                    self._buffered -= len(chunk)
                    if self._connection is not None and self._buffered < READ_LOW_WATER:
                        self._connection.resume()
                    yield chunk
                elif self._error is not None:
                    raise self._error
                elif self._done:
                    return
                else:
                    await self._wait(idle_timeout_s, idle_timeout_s)
        finally:
            self.release()

    def release(self) -> None:
        """Give the connection back (answer read to its end) or close it (not read to its end)."""
        if self._released:
            return
        self._released = True
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(reusable=self._done and self._error is None)

    # --- fed by the connection ----------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self, wait_s: float, timeout_s: float) -> None:
        """Wait for more of the answer; after ``wait_s``, fail saying the engine was silent for ``timeout_s``."""
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(wait_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"the engine sent nothing for {timeout_s:g} s"))


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time."""

    def __init__(self, pool: collections.deque[_Connection]) -> None:
        # Kept: on Python 3.11 every get_running_loop() costs a getpid() system call.
        self.loop = asyncio.get_running_loop()
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: EngineResponse | None = None
        self._headers_waiter: asyncio.Future | None = None
        self._headers_done = False
        self._keep_alive = False
        self._length_known = False
        self._received = False
        self._paused = False
        self.closed = False
        self.idle_since = 0.0

    # --- used by the client -------------------------------------------------------------

    def send(self, request: bytes) -> EngineResponse:
        if self._transport is None or self.closed:
            raise EngineConnectionError("the connection is closed")
        self._response = response = EngineResponse(self)
        self._headers_done = self._keep_alive = self._length_known = self._received = False
        self._headers_waiter = None
        self._transport.write(request)
        return response

    async def headers(self, timeout_s: float) -> None:
        """Wait until the answer's status line and headers are in."""
        response = self._response
        if self._headers_done or response is None:
            return
        if response._error is not None:
            raise response._error
        self._headers_waiter = waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._headers_waiter = None

    @property
    def received_any(self) -> bool:
        return self._received

    def peer_closed(self) -> bool:
        """Whether the engine has closed its end (a FIN, or anything, waiting on an idle connection)."""
        sock = self._transport.get_extra_info("socket") if self._transport is not None else None
        if sock is None:
            return self._transport is None
        try:  # asyncio's socket wrapper has no recv: peek through a duplicate of the descriptor
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
                peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"": a FIN; bytes: nobody asked
            return True
        except BlockingIOError:
            return False  # nothing there: open and quiet
        except OSError:
            return True

    def finished(self, reusable: bool) -> None:
        self._response = None
        if self._paused:
            self.resume()
        if reusable and not self.closed and self._keep_alive:
            self.idle_since = time.monotonic()
            if len(self._pool) >= MAX_IDLE_PER_ENGINE:
                self._pool.popleft().close()
            self._pool.append(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def pause(self) -> None:
        if not self._paused and self._transport is not None and not self.closed:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Without it every keep-alive request waits for a delayed ACK (~40 ms on Linux).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            self._fail(EngineConnectionError(f"malformed HTTP answer: {e}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost finishes the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        with_length = self._length_known
        if self._response is not None and self._headers_done and not with_length and exc is None:
            self._response._finish()  # an answer without length ends when the engine closes
        reason = f": {type(exc).__name__}: {exc}" if exc else ""
        self._fail(EngineConnectionError(f"the engine closed the connection{reason}"))
        try:
            self._pool.remove(self)
        except ValueError:
            pass

    # --- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers.append((name, value))
            lowered = name.lower()
            if lowered == b"content-length" or lowered == b"transfer-encoding":
                self._length_known = True

    def on_headers_complete(self) -> None:
        if self._response is not None:
            self._response.status = self._parser.get_status_code()
        self._headers_done = True
        if self._headers_waiter is not None and not self._headers_waiter.done():
            self._headers_waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        # Asked now: once the message is complete, the parser resets and forgets.
        self._keep_alive = self._parser.should_keep_alive()
        if self._response is not None:
            self._response._finish()

    def _fail(self, error: BaseException) -> None:
        if self._response is not None:
            self._response._finish(error)
        if self._headers_waiter is not None and not self._headers_waiter.done():
            self._headers_waiter.set_exception(error)


class EngineClient:
    """Keep-alive HTTP/1.1 connections to engines, pooled per engine (see the module's docstring)."""

    def __init__(self, connect_timeout_s: float = CONNECT_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._pools: dict[str, collections.deque[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, ssl.SSLContext | None, bytes]] = {}
        self._closed = False

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float) -> EngineResponse:
        """Send ``POST url`` with ``body``; return once the answer's headers are in (within ``timeout_s``).

        ``url`` is an engine's base URL followed by the path (``http://host:port/v1/completions``).
        """
        return await self._send(b"POST", url, body, headers, timeout_s)

    async def get(self, url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> EngineResponse:
        """Send ``GET url`` (an engine's ``/health``, ``/metrics``); return once the answer's headers are in."""
        return await self._send(b"GET", url, b"", headers or {}, timeout_s)

    async def _send(
        self, method: bytes, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> EngineResponse:
        origin, path = _split(url)
        host, port, ssl_context, host_header = self._target(origin)
        request = _request_bytes(method, path, host_header, headers, body)
        for attempt in (0, 1):
            connection, reused = await self._acquire(origin, host, port, ssl_context)
            try:
                response = connection.send(request)
                await connection.headers(timeout_s)
                return response
            except EngineConnectionError:
                connection.close()
                if attempt == 0 and reused and not connection.received_any and method == b"GET":
                    continue  # the engine had closed this idle connection: send it again on a new one
                raise
            except BaseException:
                connection.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            while pool:
                pool.pop().close()

    def _target(self, origin: str) -> tuple[str, int, ssl.SSLContext | None, bytes]:
        target = self._targets.get(origin)
        if target is None:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise EngineConnectionError(f"not an http(s) URL: {origin!r}")
            secure = parts.scheme == "https"
            port = parts.port or (443 if secure else 80)
            context = ssl.create_default_context() if secure else None
            target = (parts.hostname, port, context, parts.netloc.encode("idna"))
            self._targets[origin] = target
        return target

    async def _acquire(
        self, origin: str, host: str, port: int, ssl_context: ssl.SSLContext | None
    ) -> tuple[_Connection, bool]:
        if self._closed:
            raise EngineConnectionError("the client is closed")
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = collections.deque()
        now = time.monotonic()
        while pool and now - pool[0].idle_since > self.idle_timeout_s:
            pool.popleft().close()
        while pool:
            connection = pool.pop()
            if not connection.closed and not connection.peer_closed():
                return connection, True
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(pool), host, port, ssl=ssl_context)
        except OSError as e:
            raise EngineConnectionError(f"cannot connect to {origin}: {e}") from e
        except TimeoutError as e:
            raise EngineConnectionError(f"cannot connect to {origin} within {self.connect_timeout_s:g} s") from e
        return connection, False


def _split(url: str) -> tuple[str, str]:
    """``http://h:p/v1/x`` → (``http://h:p``, ``/v1/x``)."""
    start = url.find("/", url.find("//") + 2)
    if start < 0:
        return url, "/"
    return url[:start], url[start:]


def _request_bytes(method: bytes, path: str, host: bytes, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [method, b" ", path.encode(), b" HTTP/1.1\r\nHost: ", host, b"\r\nContent-Length: ", b"%d" % len(body)]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break in it")
        lines += (b"\r\n", name.encode("latin-1"), b": ", value.encode("latin-1"))
    lines += (b"\r\n\r\n", body)
    return b"".join(lines)
