"""Noticing that a client went away while its request waits on the engines.

uvicorn does not cancel a request's task when its client disconnects: it only
answers the app's next ``receive()`` with ``http.disconnect``. A request that
waits on a prefill or decode engine never calls ``receive()``, so without
this it would run to its end for nobody (the engines computing an answer
nobody reads, the prefill engine holding KV blocks nobody fetches).

``cancel_on_disconnect(request, request_id)`` cancels the request's task when
its client goes away while the block runs: told by our uvicorn protocol
(``proxy.server.CoalescingHttpToolsProtocol``, the cycle's ``DISCONNECT_HOOK``)
or, under another server, by a task of its own that watches ``receive()`` for
``http.disconnect``. The cancellation closes the upstream connection under way
(``proxy.engine_client`` never pools a connection whose answer was not read
to its end, so vLLM sees its client gone and aborts the request), runs the
caller's clean-up (``Exchange.close`` releases the KV: ``proxy.exchange``), and leaves the block as
``ClientGone``. Use it only once the body has been read: the watcher consumes
``receive()``'s messages. Streams need no watcher once their response has
started: Starlette's ``StreamingResponse`` listens for the disconnect itself.

A step that must not be cut (a prefill call whose answer names KV to release:
``ModelFlow._prefill_call``) runs between ``defer()`` and ``resume()``: a
client that leaves meanwhile is only noted, and ``resume()`` says so; the
caller then ends the request (``ClientGone``).
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

from starlette.requests import Request

from proxy.errors import ClientGone
from proxy.server import DISCONNECT_HOOK

logger = logging.getLogger(__name__)

__all__ = ["cancel_on_disconnect"]


class cancel_on_disconnect:  # noqa: N801 (used as a context manager, like contextlib's)
    __slots__ = ("_request", "_request_id", "_task", "_watcher", "_cycle", "_gone", "_deferred", "_cancelled")

    def __init__(self, request: Request, request_id: str) -> None:
        self._request, self._request_id = request, request_id
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._cycle: object | None = None
        self._gone = False
        self._deferred = False
        self._cancelled = False

    def defer(self) -> None:
        """Until ``resume``, a client that leaves is only noted: the step under way is not cancelled."""
        self._deferred = True

    def resume(self) -> bool:
        """End ``defer``: whether the client left (then the caller ends the request with ``ClientGone``)."""
        self._deferred = False
        return self._gone

    async def __aenter__(self) -> cancel_on_disconnect:
        self._task = asyncio.current_task()
        cycle = getattr(self._request.receive, "__self__", None)  # uvicorn's RequestResponseCycle
        if cycle is not None and hasattr(cycle, DISCONNECT_HOOK):  # our protocol reports disconnects itself
            self._cycle = cycle
            if cycle.disconnected:
                self._gone = True
                raise ClientGone(f"request {self._request_id}: the client went away")
            setattr(cycle, DISCONNECT_HOOK, self._disconnected)
            return self
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    def _disconnected(self) -> None:
        self._gone = True
        if self._task is not None and not self._deferred:
            self._cancelled = True
            self._task.cancel()

    async def _watch(self) -> None:
        receive = self._request.receive
        while (await receive())["type"] != "http.disconnect":
            pass
        self._disconnected()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # No await before this point: the watcher cannot run between the block's end and here.
        if self._watcher is not None:
            self._watcher.cancel()
        if self._cycle is not None:
            setattr(self._cycle, DISCONNECT_HOOK, None)
        if self._gone:
            if self._cancelled and self._task is not None:
                self._task.uncancel()
            logger.info("request %s: the client went away; its engine requests were cancelled", self._request_id)
            raise ClientGone(f"request {self._request_id}: the client went away") from exc
