"""What one proxy process takes on: a bounded request body and a bounded number of requests.

``read_body`` refuses a body over ``max_bytes`` (413) before reading it when
``Content-Length`` announces it, and otherwise (chunked bodies) as soon as the
bytes received pass the limit.

``AdmissionGate`` lets ``max_running`` requests run at once; up to
``max_queued`` more wait, first come first served, for one to finish; any
beyond that are refused at once (429 with ``Retry-After``). A request that
waits and whose client goes away leaves the queue (its task is cancelled).
A slot is handed straight from the request that finishes to the next one
waiting, so a newcomer cannot overtake the queue.
"""

from __future__ import annotations

import asyncio
import collections

from starlette.requests import Request

from proxy.errors import RequestTooLarge, TooManyRequests

__all__ = ["RETRY_AFTER_S", "AdmissionGate", "read_body"]

RETRY_AFTER_S = 1
"""What a 429's ``Retry-After`` says: slots free as requests finish, usually within seconds."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; ``RequestTooLarge`` once it is known to exceed ``max_bytes``."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise RequestTooLarge(f"the request body is {length} bytes; this server takes at most {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLarge(f"the request body exceeds {max_bytes} bytes, the most this server takes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class AdmissionGate:
    """At most ``max_running`` requests at once, ``max_queued`` more waiting (see the module's docstring)."""

    __slots__ = ("max_running", "max_queued", "running", "_waiting")

    def __init__(self, max_running: int, max_queued: int = 0) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"max_running must be >= 1 and max_queued >= 0, got {max_running}, {max_queued}")
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def enter(self) -> None:
        """Take a slot, waiting in the queue if need be; ``TooManyRequests`` when the queue is full too."""
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return
        if len(self._waiting) >= self.max_queued:
            raise TooManyRequests(
                f"the server is busy ({self.running} requests running, {len(self._waiting)} waiting); "
                "retry after a while",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # the slot was handed over as the wait was cancelled: pass it on
            elif waiter in self._waiting:  # (``leave`` drops a cancelled waiter it meets)
                self._waiting.remove(waiter)
            raise

    def leave(self) -> None:
        """Give a slot back: to the first request waiting, if any."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)  # ``running`` stays: the slot changes hands
                return
        self.running -= 1
