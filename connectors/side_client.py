"""The side channel's clients: a decode rank's handshake and pins, releases and READ notifications (sent from a
thread of their own, ``ReleaseSender``), and the engine actor's pings and probes.

Each request takes a TCP connection of its own and reads the answer's header first (``contract.framing``):
answers up to ``MAX_REPLY_BYTES``, a handshake answer and its sealing. A refused connection is tried again every
``CONNECT_RETRY_S`` until the request's deadline (a channel being bound anew, or not yet listening).
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
import time

from connectors.errors import HandshakeRejected, TransportError
from connectors.handshake import HandshakeRequest, HandshakeResponse, decode_response, encode_request
from connectors.leases import PinAnswer
from connectors.side_messages import (
    ERROR_PREFIX,
    MAX_REPLY_BYTES,
    NONCE_BYTES,
    pin_message,
    read_message,
    release_message,
)
from connectors.topology import KVTopology
from contract.auth import KVAuth, Unauthenticated
from contract.framing import FramingError, frame, recv_frame
from contract.wire import parse_tcp_endpoint

__all__ = [
    "ANSWERED",
    "BUSY",
    "SILENT",
    "PeerClient",
    "ReleaseSender",
    "ask_pin",
    "ping",
    "probe",
    "request_handshake",
]

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 0.05


def request_handshake(
    engine_id: str, topology: KVTopology, endpoint: str, auth: KVAuth, timeout_s: float = 5.0
) -> HandshakeResponse:
    """Ask the prefill worker rank at ``endpoint`` (``tcp://host:port``) for its handshake response;
    raise on timeout, refusal, or an answer not sealed for this very request."""
    nonce = secrets.token_hex(NONCE_BYTES).encode()
    handshake = encode_request(HandshakeRequest(engine_id=engine_id, topology=topology))
    message = auth.seal(b"handshake", nonce + b" " + handshake)
    reply = _ask(endpoint, message, timeout_s, f"engine {engine_id}: no handshake answer from {endpoint}")
    if reply.startswith(ERROR_PREFIX):
        kind, _, reason = reply[len(ERROR_PREFIX) :].decode(errors="replace").partition(" ")
        if kind == "unauthenticated":
            raise Unauthenticated("handshake", f"{endpoint} refused ours: {reason}")
        if kind == "internal":
            raise TransportError(f"engine {engine_id}: {endpoint} failed to answer the handshake (ERR internal)")
        raise HandshakeRejected(kind if kind in ("version", "incompatible", "malformed") else "malformed", [reason])
    try:
        kind, body = auth.open(reply)
    except Unauthenticated as e:
        raise Unauthenticated("handshake-reply", f"from {endpoint}: {e.reason}") from e
    echoed, _, response = body.partition(b" ")
    if kind != b"handshake-reply" or not secrets.compare_digest(echoed, nonce):
        raise Unauthenticated("handshake-reply", f"from {endpoint}: not the answer to this handshake")
    return decode_response(response, topology)


def ping(endpoint: str, auth: KVAuth, timeout_s: float = 2.0) -> bool:
    """Whether the side channel at ``endpoint`` answers a sealed ping within ``timeout_s`` (it serves, with our key)."""
    return _answered_ok(endpoint, auth.seal(b"ping", b""), timeout_s, "ping", logging.DEBUG)


ANSWERED, BUSY, SILENT = "answered", "busy", "silent"


def probe(endpoint: str, auth: KVAuth, timeout_s: float = 2.0) -> str:
    """How the side channel at ``endpoint`` takes a sealed ping: ``ANSWERED``; ``BUSY`` (it closed our connection
    unanswered: its loop turns, but it holds as many connections as it takes, a flood); ``SILENT`` (refused, or
    no answer in ``timeout_s``: a thread that is gone or stuck). A watchdog restarts only the silent."""
    deadline = time.monotonic() + timeout_s
    try:
        with _connect(endpoint, deadline) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(frame(auth.seal(b"ping", b"")))
            return ANSWERED if recv_frame(sock, MAX_REPLY_BYTES, deadline) == b"OK" else SILENT
    except (FramingError, ConnectionResetError, BrokenPipeError):
        return BUSY
    except (OSError, ValueError):
        return SILENT


def _ask(endpoint: str, message: bytes, timeout_s: float, failure: str) -> bytes:
    """One request-reply exchange on a connection of its own, all of it within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        with _connect(endpoint, deadline) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(frame(message))
            return recv_frame(sock, MAX_REPLY_BYTES, deadline)  # a longer answer is refused unread
    except (OSError, ValueError) as e:  # FramingError is a ValueError; a timeout, an OSError
        raise TransportError(f"{failure}: {e or type(e).__name__}") from e


def ask_pin(endpoint: str, auth: KVAuth, reader: str, request_id: str, epoch: str, timeout_s: float = 5.0) -> PinAnswer:
    """Pin ``request_id``'s blocks at the holder at ``endpoint`` for ``reader`` (``LeaseTable.pin``); raises
    ``TransportError`` without an answer."""
    reply = _ask(endpoint, pin_message(auth, reader, request_id, epoch), timeout_s, f"no pin answer from {endpoint}")
    try:
        return PinAnswer(reply.decode(errors="replace"))
    except ValueError:
        raise TransportError(f"pin at {endpoint} answered {reply[:80]!r}") from None


def _connect(endpoint: str, deadline: float) -> socket.socket:
    """A connection to ``endpoint``; a refused one is tried again every ``CONNECT_RETRY_S`` until ``deadline``
    (a channel being bound anew, or not yet listening)."""
    host, port = parse_tcp_endpoint(endpoint)
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        except ConnectionRefusedError:
            if time.monotonic() + CONNECT_RETRY_S >= deadline:
                raise
            time.sleep(CONNECT_RETRY_S)


def _answered_ok(endpoint: str, message: bytes, timeout_s: float, what: str, log_level: int) -> bool:
    """Whether ``endpoint`` answers ``message`` with ``OK``; a failure to get an answer is logged at ``log_level``."""
    try:
        return _ask(endpoint, message, timeout_s, f"{what} not answered") == b"OK"
    except TransportError as e:
        logger.log(log_level, "%s at %s: %s", what, endpoint, e)
        return False


class ReleaseSender:
    """Sends releases and READ notifications from a daemon thread, so the engine's step never waits on a peer
    that may be gone."""

    def __init__(self, engine_id: str, auth: KVAuth, timeout_s: float = 2.0):
        self.engine_id = engine_id
        self._auth = auth
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[str, bytes, str, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, endpoint: str, request_id: str, by: str | None = None) -> None:
        message = release_message(self._auth, request_id, by=by)
        self._send(endpoint, message, "release", f"released request {request_id}")

    def read_done(self, endpoint: str, reader: str, notification: bytes) -> None:
        """Tell the source at ``endpoint`` that ``reader`` has read what ``notification`` names."""
        self._send(endpoint, read_message(self._auth, reader, notification), "read", f"read {notification!r}")

    def _send(self, endpoint: str, message: bytes, kind: str, what: str) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdserve-release", daemon=True)
                self._thread.start()
        self._queue.put((endpoint, message, kind, what))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            endpoint, message, kind, what = item
            if _answered_ok(endpoint, message, self._timeout_s, kind, logging.WARNING):
                logger.debug("engine %s: %s at %s", self.engine_id, what, endpoint)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self._timeout_s + 1)


class PeerClient:
    """What a decode rank asks of prefill ranks over their side channels: handshakes and pins (each answered, or
    ``TransportError``), releases and READ notifications (``releases``, sent from a thread of their own)."""

    def __init__(self, engine_id: str, auth: KVAuth) -> None:
        self.engine_id = engine_id
        self._auth = auth
        self.releases = ReleaseSender(engine_id, auth)

    def handshake(self, topology: KVTopology, endpoint: str, timeout_s: float) -> HandshakeResponse:
        return request_handshake(self.engine_id, topology, endpoint, self._auth, timeout_s)

    def pin(self, endpoint: str, reader: str, request_id: str, epoch: str, timeout_s: float) -> PinAnswer:
        return ask_pin(endpoint, self._auth, reader, request_id, epoch, timeout_s)

    def close(self) -> None:
        self.releases.close()
