"""Serving the proxy's FastAPI app: uvicorn's settings, and one or several worker processes.

``uvicorn_config`` holds the settings both ways of running the proxy use (the
Ray actor of ``orchestrator.proxy_actor`` and ``pdserve proxy``): uvloop,
httptools, no access log, no proxy-headers middleware, no ``server`` header.

``serve(make_app, host, port, workers)`` runs the app until SIGINT/SIGTERM:

- ``workers=1``: in this process.
- ``workers=N``: N spawned processes, each with its own socket bound to the same
  port with ``SO_REUSEPORT``, so the kernel spreads connections over them
  evenly; this process binds the port first (so port 0 works), only watches
  them, restarts one that dies, and stops them all when told to stop.

Once listening, a worker tunes the garbage collector for serving (``tune_gc``).
Each worker calls ``make_app()`` (it must pickle: a module-level function, or
a ``functools.partial`` of one) and so has its own app, ``EnginePool`` and
round-robin counters: the engines are spread evenly overall, but not in strict
turn across workers. An ``EnginePool`` changed at run time (``set_endpoints``)
changes only its own process's view, which is why the Ray actor, which changes
it as engines come and go, runs one worker in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = 1.0


class _CoalescingTransport:
    """A transport whose writes made in one event-loop turn leave in one ``send``.

    uvicorn writes a response's status line and headers at ``http.response.start`` and
    its body at ``http.response.body``: two system calls for every JSON answer, though
    the app sends both in the same turn. Writes here wait for the end of the turn
    (``call_soon``) and go out together. ``close`` sends what waits first. Without it the
    proxy spent 9-17 % more CPU per request (``scripts/bench_proxy.py``, two runs, each
    against a copy of the proxy without it); ``fast_path: false`` serves without it.
    """

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


DISCONNECT_HOOK = "pdserve_on_disconnect"
"""Attribute of a request's uvicorn cycle: a callable this protocol calls when the client goes away
mid-request (``proxy.disconnect`` sets it; None when nobody listens)."""


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a ``_CoalescingTransport``: one ``send`` per JSON answer.

    It also tells a request that its client went away at once, through the
    cycle's ``DISCONNECT_HOOK``: cheaper than a task per request waiting on
    ``receive()`` for uvicorn's ``http.disconnect`` (that task cost 17-34 % more CPU
    per request, in the same runs). Both lean on uvicorn's internals (its protocol's
    ``cycle`` and transport); ``fast_path: false`` serves on uvicorn's own protocol.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(_CoalescingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None:
            setattr(self.cycle, DISCONNECT_HOOK, None)  # this cycle's disconnects are reported

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        hook = getattr(cycle, DISCONNECT_HOOK, None) if cycle is not None else None
        if hook is not None and cycle.disconnected:
            hook()


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 8000, **overrides: Any) -> uvicorn.Config:
    """How the proxy's ``app`` is served: our protocol on its fast path (``ProxyConfig.fast_path``), else uvicorn's."""
    config = getattr(getattr(app, "state", None), "config", None)
    fast = getattr(config, "fast_path", True)
    settings: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "uvloop",
        "http": CoalescingHttpToolsProtocol if fast else "httptools",
        "ws": "none",
        "lifespan": "on",
        "proxy_headers": False,  # its middleware costs every request; the proxy reads no X-Forwarded-*
        "server_header": False,
        "access_log": False,
        "log_level": "warning",
        "timeout_keep_alive": 30,
    }
    return uvicorn.Config(app, **(settings | overrides))


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


GC_THRESHOLD = 20_000
"""Allocations (less deallocations) of tracked objects between two young-generation collections."""


def tune_gc() -> None:
    """Fit CPython's cyclic garbage collector to a server process, once it has started.

    With the default threshold (700) the objects that requests in flight hold
    pass it all the time: at 32 connections the collector ran every ~15 requests,
    found nothing (the proxy makes no reference cycles as it serves) and cost
    ~45 µs of CPU per request, a sixth of the proxy's. At ``GC_THRESHOLD`` it ran
    about once per 5,000 requests. ``gc.freeze`` puts what exists after start-up
    (FastAPI, pydantic, the app) out of the collector's way for good, so its rare
    full collections do not walk it.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD)


class _Server(uvicorn.Server):
    """uvicorn that reports once it listens, after ``tune_gc``."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            tune_gc()
            self._on_started()

    def run_until_stopped(self, sockets: list[socket.socket]) -> None:
        """Serve until SIGINT/SIGTERM, then return: a stop asked for is a normal end (status 0).

        uvicorn's own handlers stop it while it serves; once stopped it raises the signal
        again under the handlers that were there before, so that the process dies of it.
        Those here only ask the server to stop (again), so the process ends normally, as
        with several workers (``_Workers``), and a signal that comes before uvicorn's
        handlers are in place stops it too.
        """

        def stop(signum: int, frame: object) -> None:
            self.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.run(sockets=sockets)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(
    make_app: Callable[[], Any],
    host: str,
    port: int,
    workers: int = 1,
    on_ready: Callable[[str], None] | None = None,
) -> int:
    """Serve ``make_app()`` on ``host:port`` until SIGINT/SIGTERM; ``on_ready(url)`` once every worker listens.

    Returns the exit status: 0 after a stop, 1 if the server could not start.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    reserved = listen_socket(host, port, reuse_port=workers > 1)
    url = f"http://{_url_host(host)}:{reserved.getsockname()[1]}"
    if workers == 1:
        server = _Server(uvicorn_config(make_app()), lambda: on_ready(url) if on_ready else None)
        server.run_until_stopped([reserved])
        return 0 if server.started else 1
    # The reserved socket never listens: connections go only to the workers' listening sockets.
    port = reserved.getsockname()[1]
    try:
        with _Workers(make_app, host, port, workers) as pool:
            if not pool.wait_ready(WORKER_START_TIMEOUT_S):
                return 1
            if on_ready:
                on_ready(url)
            pool.watch()
    finally:
        reserved.close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _run_worker(make_app: Callable[[], Any], host: str, port: int, ready: Any) -> None:
    sock = listen_socket(host, port, reuse_port=True)
    server = _Server(uvicorn_config(make_app()), ready.set)
    server.run_until_stopped([sock])
    sys.exit(0 if server.started else 1)


class _Workers:
    """N worker processes on one port; restarts those that die until told to stop."""

    def __init__(self, make_app: Callable[[], Any], host: str, port: int, count: int) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._args = (make_app, host, port)
        self._processes: list[Any] = []
        self._ready: list[Any] = []
        self._stopping = False
        self._count = count

    def __enter__(self) -> _Workers:
        for _ in range(self._count):
            self._processes.append(None)
            self._ready.append(None)
            self._start(len(self._processes) - 1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start(self, index: int) -> None:
        ready = self._context.Event()
        process = self._context.Process(
            target=_run_worker, args=(*self._args, ready), name=f"pdserve-proxy-{index}", daemon=False
        )
        process.start()
        self._processes[index], self._ready[index] = process, ready

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for index, ready in enumerate(self._ready):
            while not ready.wait(0.05):
                if not self._processes[index].is_alive():
                    logger.error("proxy worker %d exited during start-up", index)
                    return False
                if time.monotonic() > deadline:
                    logger.error("proxy worker %d did not start within %.0f s", index, timeout_s)
                    return False
        return True

    def watch(self) -> None:
        """Wait for a stop signal; restart any worker that dies meanwhile."""
        with self._stop_signals():
            while not self._stopping:
                sentinels = [p.sentinel for p in self._processes]
                multiprocessing.connection.wait(sentinels, timeout=0.5)
                for index, process in enumerate(self._processes):
                    if not self._stopping and not process.is_alive():
                        logger.warning(
                            "proxy worker %d (pid %s) exited with %s; starting another",
                            index, process.pid, process.exitcode,
                        )  # fmt: skip
                        time.sleep(RESTART_BACKOFF_S)
                        self._start(index)

    @contextlib.contextmanager
    def _stop_signals(self) -> Generator[None, None, None]:
        def stop(signum: int, frame: object) -> None:
            self._stopping = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        for process in self._processes:
            if process is not None and process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            if process is None:
                continue
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join()
