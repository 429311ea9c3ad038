"""What one proxy process takes on: a bounded request body, read in bounded time, and a bounded number of requests.

``read_body`` refuses a body over ``max_bytes`` (413) before reading it when
``Content-Length`` announces it, and otherwise (chunked bodies) as soon as the
bytes received pass the limit. A body that has not all come ``timeout_s`` after
the request's headers, or whose next part has not come ``idle_timeout_s`` after
the last, is refused (408) and the connection closed: a client that sends its
headers and then trickles or stops holds nothing for longer. A body that is
already all there when the app starts (the usual small request, under the
proxy's own uvicorn protocol) is read without arming a timer.

``AdmissionGate`` lets ``max_running`` requests run at once; up to
``max_queued`` more wait, first come first served, for one to finish; any
beyond that are refused at once (429 with ``Retry-After``). A request that
waits and whose client goes away leaves the queue (its task is cancelled).
A slot is handed straight from the request that finishes to the next one
waiting, so a newcomer cannot overtake the queue. ``resize`` changes
``max_running`` while requests run: more room admits those waiting at once;
less lets the requests running finish, and admits none until they are below it.

Unless the proxy's settings fix ``max_concurrent_requests``, ``max_running``
follows the pools (``pool_limit``): ``requests_per_engine`` (the engines'
``--max-num-seqs``) for every ready engine of both pools, and never less than
one engine's worth, recomputed whenever an engine joins, leaves, drains, moves,
is ejected or comes back (``EnginePool.watch``). Both pools, not the smaller:
a request holds a decode slot for all of its output and a prefill slot only for
its prompt, so the smaller pool's capacity would hold a decode-heavy fleet
below what it runs; and the autoscaler reads the engines' own queues
(``vllm:num_requests_waiting``), which a limit at or under their capacity would
keep empty while requests waited here unseen.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request

from contract.wire import ROLES
from proxy.errors import RequestTimeout, RequestTooLarge, TooManyRequests
from proxy.pool import EnginePool
from proxy.server import DISCONNECT_HOOK

__all__ = ["DEFAULT_REQUESTS_PER_ENGINE", "RETRY_AFTER_S", "AdmissionGate", "pool_limit", "read_body"]

RETRY_AFTER_S = 1
"""What a 429's ``Retry-After`` says: slots free as requests finish, usually within seconds."""

DEFAULT_REQUESTS_PER_ENGINE = 1024
"""What an engine is taken to run at once when nobody says (``requests_per_engine``): the most vLLM's
``--max-num-seqs`` defaults to (GPUs of 70 GiB and more; 256 on smaller ones, 128 per TP rank on CPU), so that
the derived limit never holds back what the engines could run: more than they run waits in their own queues,
as without a limit."""


def pool_limit(pool: EnginePool, requests_per_engine: int) -> int:
    """The derived ``max_concurrent_requests``: ``requests_per_engine`` for each ready engine of both pools
    (healthy, not draining), and one engine's worth when none is ready (never 0)."""
    ready = sum(len(pool.ready(role)) for role in ROLES)
    return requests_per_engine * max(ready, 1)


async def read_body(request: Request, max_bytes: int, timeout_s: float, idle_timeout_s: float | None = None) -> bytes:
    """The request's body; ``RequestTooLarge`` once it is known to exceed ``max_bytes``, ``RequestTimeout``
    when it has not all come within ``timeout_s`` or nothing of it came for ``idle_timeout_s``,
    ``ClientDisconnect`` if the client went away."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise RequestTooLarge(f"the request body is {length} bytes; this server takes at most {max_bytes}")
    receive = request.receive
    cycle = getattr(receive, "__self__", None)  # uvicorn's RequestResponseCycle
    if hasattr(cycle, DISCONNECT_HOOK) and not cycle.more_body:
        return await _receive_body(receive, max_bytes)  # our protocol holds all of it: receive() cannot wait
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    idle_s = idle_timeout_s if idle_timeout_s is not None and idle_timeout_s < timeout_s else None
    try:
        async with asyncio.timeout_at(deadline if idle_s is None else loop.time() + idle_s) as timer:
            return await _receive_body(receive, max_bytes, timer, deadline, idle_s)
    except TimeoutError as e:
        if loop.time() >= deadline:
            message = f"the request body did not all arrive within {timeout_s:g} s of its headers"
        else:
            message = f"nothing more of the request body came for {idle_s:g} s"
        raise RequestTimeout(message, headers={"Connection": "close"}) from e


async def _receive_body(
    receive: Callable[[], Any],
    max_bytes: int,
    timer: asyncio.Timeout | None = None,
    deadline: float = 0.0,
    idle_s: float | None = None,
) -> bytes:
    """The body's messages from ``receive``, joined; ``timer`` (if any) moved on to ``idle_s`` past each part."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            raise ClientDisconnect()
        if kind != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > max_bytes:
                raise RequestTooLarge(f"the request body exceeds {max_bytes} bytes, the most this server takes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
        if timer is not None and idle_s is not None:
            timer.reschedule(min(deadline, asyncio.get_running_loop().time() + idle_s))
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

    def admit(self) -> bool:
        """Take a slot if one is free and nobody waits for one (``enter``'s path that never waits, without a
        coroutine)."""
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return True
        return False

    async def enter(self) -> None:
        """Take a slot, waiting in the queue if need be; ``TooManyRequests`` when the queue is full too."""
        if self.admit():
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
        """Give a slot back: to the first request waiting, if any (and ``max_running`` still has room for it)."""
        if self._waiting and self.running <= self.max_running and self._hand_over():
            return  # ``running`` stays: the slot changes hands
        self.running -= 1

    def resize(self, max_running: int) -> None:
        """Let ``max_running`` requests run from now on: those waiting take the room it adds at once; when it
        shrinks, the requests running finish and none is admitted until they are below it."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        while self.running < max_running and self._hand_over():
            self.running += 1

    def _hand_over(self) -> bool:
        """Wake the first request still waiting; False if none is."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return True
        return False
