"""The side channel: a ZMQ REP socket on every worker, REQ calls from decode workers and the proxy.

Two kinds of message arrive:

- A handshake (starts with ``handshake.MAGIC``): the server thread answers
  every well-formed ``HandshakeRequest`` with one pre-encoded
  ``HandshakeResponse`` (agent metadata and KV regions do not change after
  registration). A request it rejects gets an ``ERR`` reply carrying the
  reason, which the caller raises as ``HandshakeRejected``.
- A release (``RELEASE_PREFIX`` + request id): nobody will read that
  request's blocks (the client went away, or the decode engine's read
  failed), so free them now instead of at lease expiry. The proxy sends the
  message it finds in the prefill's ``kv_transfer_params`` without knowing
  its format; the server hands the id to ``on_release`` and answers ``OK``.
- A report query (``report_message(prefill engine id, prefill request id)``,
  which the prefill engine hands the proxy in its ``kv_transfer_params`` as it
  does a release), from the proxy when a decode engine's stream starts: how
  this decode rank loaded that request's KV (JSON, the same report the
  scheduler side puts in a finished request's ``kv_transfer_params``), or
  ``NONE`` if it did not load it (not yet, or too long ago: ``RecentReports``
  keeps the last ``RECENT_REPORTS``). A stream has no ``kv_transfer_params``
  in vLLM 0.32; this is how its client still gets ``X-PDServe-KV``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from connectors.errors import HandshakeRejected, TransportError
from connectors.handshake import (
    HandshakeRequest,
    HandshakeResponse,
    decode_request,
    decode_response,
    encode_request,
)
from connectors.topology import KVTopology
from connectors.wire import tcp_endpoint

__all__ = [
    "RELEASE_PREFIX",
    "REPORT_PREFIX",
    "RecentReports",
    "ReleaseSender",
    "SideChannelServer",
    "release_message",
    "report_key",
    "report_message",
    "request_handshake",
    "send_release",
]

logger = logging.getLogger(__name__)

_ERROR_PREFIX = b"ERR "
RELEASE_PREFIX = b"PDRL "
REPORT_PREFIX = b"PDKV "
NO_REPORT = b"NONE"
RECENT_REPORTS = 4096
_POLL_MS = 100


def release_message(request_id: str) -> bytes:
    return RELEASE_PREFIX + request_id.encode()


def report_key(remote_engine_id: str, remote_request_id: str) -> str:
    """What the proxy asks a decode rank for: the prefill engine's id and its request id, from the
    prefill's ``kv_transfer_params`` (the decode engine's own request id is not the proxy's to know)."""
    return f"{remote_engine_id} {remote_request_id}"


def report_message(remote_engine_id: str, remote_request_id: str) -> bytes:
    return REPORT_PREFIX + report_key(remote_engine_id, remote_request_id).encode()


class RecentReports:
    """The last ``limit`` load reports of a decode rank, by ``report_key``; written by the engine's
    thread, read by the side-channel thread."""

    def __init__(self, limit: int = RECENT_REPORTS) -> None:
        self._limit = limit
        self._reports: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, report: dict[str, Any]) -> None:
        encoded = json.dumps(report, separators=(",", ":")).encode()
        with self._lock:
            self._reports[key] = encoded
            if len(self._reports) > self._limit:
                self._reports.popitem(last=False)

    def encoded(self, key: str) -> bytes | None:
        with self._lock:
            return self._reports.get(key)


class SideChannelServer:
    """Answers handshakes, releases and report queries on ``tcp://host:port`` from a daemon thread until ``close()``."""

    def __init__(
        self,
        engine_id: str,
        host: str,
        port: int,
        topology: KVTopology,
        response: bytes,
        on_release: Callable[[str], None] | None = None,
        answer_delay_s: float = 0.0,
        on_report: Callable[[str], bytes | None] | None = None,
    ):
        self.engine_id = engine_id
        self.endpoint = tcp_endpoint(host, port)
        self._topology = topology
        self._response = response
        self._on_release = on_release
        self._on_report = on_report
        self._answer_delay_s = answer_delay_s  # fault injection: a slow peer
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            self._context.term()
            raise TransportError(f"engine {engine_id}: cannot bind the side channel on {self.endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._serve, name=f"pdserve-side-channel-{port}", daemon=True)
        self._thread.start()
        logger.info("engine %s: handshake side channel listening on %s", engine_id, self.endpoint)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            message = self._socket.recv()
            if message.startswith(RELEASE_PREFIX):
                self._release(message[len(RELEASE_PREFIX) :].decode(errors="replace"))
                continue
            if message.startswith(REPORT_PREFIX):
                key = message[len(REPORT_PREFIX) :].decode(errors="replace")
                report = self._on_report(key) if self._on_report is not None else None
                self._socket.send(report or NO_REPORT)
                continue
            try:
                request = decode_request(message, self._topology)
            except HandshakeRejected as e:
                logger.warning("engine %s: refused a handshake: %s", self.engine_id, e)
                self._socket.send(_ERROR_PREFIX + e.kind.encode() + b" " + str(e).encode())
                continue
            logger.info("engine %s: handshake from engine %s", self.engine_id, request.engine_id)
            if self._answer_delay_s:
                time.sleep(self._answer_delay_s)
            self._socket.send(self._response)
        self._socket.close()

    def _release(self, request_id: str) -> None:
        if self._on_release is not None and request_id:
            self._on_release(request_id)
            self._socket.send(b"OK")
        else:
            self._socket.send(_ERROR_PREFIX + b"malformed release")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._context.term()


def request_handshake(engine_id: str, topology: KVTopology, endpoint: str, timeout_s: float = 5.0) -> HandshakeResponse:
    """Ask the prefill worker rank at ``endpoint`` (``tcp://host:port``) for its handshake response;
    raise on timeout or refusal."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(endpoint)
        socket.send(encode_request(HandshakeRequest(engine_id=engine_id, topology=topology)))
        reply = socket.recv()
    except zmq.ZMQError as e:
        raise TransportError(f"engine {engine_id}: no handshake answer from {endpoint}: {e}") from e
    finally:
        socket.close()
    if reply.startswith(_ERROR_PREFIX):
        kind, _, reason = reply[len(_ERROR_PREFIX) :].decode(errors="replace").partition(" ")
        raise HandshakeRejected(kind if kind in ("version", "incompatible", "malformed") else "malformed", [reason])
    return decode_response(reply, topology)


def send_release(endpoint: str, request_id: str, timeout_s: float = 2.0) -> bool:
    """Tell the worker at ``endpoint`` to free ``request_id``'s blocks; False if it did not answer."""
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        socket.connect(endpoint)
        socket.send(release_message(request_id))
        return socket.recv() == b"OK"
    except zmq.ZMQError as e:
        logger.warning("release of request %s at %s not delivered: %s", request_id, endpoint, e)
        return False
    finally:
        socket.close()


class ReleaseSender:
    """Sends releases from a daemon thread, so the engine's step never waits on a peer that may be gone."""

    def __init__(self, engine_id: str, timeout_s: float = 2.0):
        self.engine_id = engine_id
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, endpoint: str, request_id: str) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdserve-release", daemon=True)
                self._thread.start()
        self._queue.put((endpoint, request_id))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            endpoint, request_id = item
            if send_release(endpoint, request_id, self._timeout_s):
                logger.debug("engine %s: released request %s at %s", self.engine_id, request_id, endpoint)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self._timeout_s + 1)
