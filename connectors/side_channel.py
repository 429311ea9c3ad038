"""The side channel: a ZMQ REP socket on every worker, REQ calls from decode workers and the proxy.

Five kinds of message arrive:

- A handshake (a nonce and a ``handshake`` message): the server thread answers
  every well-formed ``HandshakeRequest`` with one pre-encoded
  ``HandshakeResponse`` (agent metadata and KV regions do not change after
  registration). A request it rejects gets an ``ERR`` reply carrying the
  reason, which the caller raises as ``HandshakeRejected``.
- A release (``release_message``: a request id): nobody will read that
  request's blocks (the client went away, or the decode engine's read
  failed), so free them now instead of at lease expiry. The proxy sends the
  message it finds in the prefill's ``kv_transfer_params`` without knowing
  its format (sealed by the prefill engine, valid as long as the lease);
  the server hands the id to ``on_release`` and answers ``OK``.
- A report query (``report_message(prefill engine id, prefill request id)``,
  which the prefill engine hands the proxy in its ``kv_transfer_params`` as it
  does a release), from the proxy when a decode engine's stream starts: how
  this decode rank loaded that request's KV (JSON, the same report the
  scheduler side puts in a finished request's ``kv_transfer_params``), or
  ``NONE`` if it did not load it (not yet, or too long ago: ``RecentReports``
  keeps the last ``RECENT_REPORTS``). A stream has no ``kv_transfer_params``
  in vLLM 0.32; this is how its client still gets ``X-PDServe-KV``.
- A READ notification (``read_message``: the reader's name, then what
  ``leases.read_notification`` says), from a decode rank whose transport does
  not tell the source itself (CUDA IPC): that rank has read the request's
  blocks; the server hands ``(reader, notification)`` to ``on_read`` -- the
  lease counts it as NIXL's notifications -- and answers ``OK``.
- A ping (``ping()``): answered ``OK``; it says the rank's channel is serving
  and shares our key.

Every message, both ways for a handshake, is sealed with the cluster's KV key
(``connectors.auth``): the server answers a message it cannot open with
``ERR unauthenticated <reason>``, does nothing else for it, and counts it
(``refused``, by kind; ``pdserve:kv_refused_total`` on ``/metrics``).
Refusals are logged at most once per kind every 10 s (``connectors.log_limit``;
the line says how many it left out), so junk cannot flood the log.

No peer can stop or starve the server:

- The socket refuses, before anything is read, a frame longer than
  ``MAX_REQUEST_BYTES`` (``zmq.MAXMSGSIZE``: zmq drops that peer's connection;
  nothing reaches the MAC, nothing is answered or counted). The largest request,
  a handshake, is a few hundred bytes. The limit is per frame: zmq buffers a
  message of many frames whole before the loop sees it.
- The loop reads whole messages; one of several frames or an empty one is
  refused (``message``) with a one-frame ``ERR`` reply.
- Any exception while answering (a bug, an ``on_release`` or ``on_report``
  callback that raises) is logged and answered ``ERR internal``.
- A socket in a bad state (a ``zmq.ZMQError`` other than the context's end) is
  closed and bound anew on the same endpoint (``REBIND_ATTEMPTS`` tries,
  ``REBIND_PAUSE_S`` apart).

The thread ends only at ``close()``; if it ever ends otherwise (the endpoint
could not be bound again), it logs an ERROR and ``alive`` turns False. The
client side (``_ask``) takes answers up to ``MAX_REPLY_BYTES``: a handshake
answer (``handshake.MAX_MESSAGE_BYTES``) and its sealing.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

from connectors.auth import LIVE_TTL_S, KVAuth, Unauthenticated
from connectors.errors import HandshakeRejected, TransportError
from connectors.handshake import (
    MAX_MESSAGE_BYTES,
    HandshakeRequest,
    HandshakeResponse,
    decode_request,
    decode_response,
    encode_request,
)
from connectors.log_limit import DEFAULT_INTERVAL_S, LogLimiter
from connectors.topology import KVTopology
from connectors.wire import tcp_endpoint

__all__ = [
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "RecentReports",
    "RefusedMessages",
    "ReleaseSender",
    "SideChannelServer",
    "ping",
    "read_message",
    "release_message",
    "report_key",
    "report_message",
    "request_handshake",
    "send_release",
]

logger = logging.getLogger(__name__)

_ERROR_PREFIX = b"ERR "
NO_REPORT = b"NONE"
RECENT_REPORTS = 4096
_NONCE_BYTES = 16
MAX_REQUEST_BYTES = 1 << 20
"""The longest frame the server reads (``zmq.MAXMSGSIZE``); a handshake request, the largest, is a few hundred
bytes (a topology and an engine id), so this leaves room for any model identity and request id."""
_SEAL_BYTES = 1024
"""More than sealing adds to a body: magic, kind, expiry, MAC, a handshake's nonce, and the spaces between."""
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES + _SEAL_BYTES
"""The longest answer a client reads: a sealed handshake answer."""
REBIND_ATTEMPTS = 50
REBIND_PAUSE_S = 0.1


def release_message(auth: KVAuth, request_id: str, ttl_s: float = LIVE_TTL_S) -> bytes:
    """A sealed release of ``request_id``'s blocks, valid for ``ttl_s``."""
    return auth.seal(b"release", request_id.encode(), ttl_s)


def read_message(auth: KVAuth, reader: str, notification: bytes, ttl_s: float = LIVE_TTL_S) -> bytes:
    """A sealed READ notification: ``reader`` (no spaces) has read what ``notification`` names."""
    return auth.seal(b"read", reader.encode() + b" " + notification, ttl_s)


def report_key(remote_engine_id: str, remote_request_id: str) -> str:
    """What the proxy asks a decode rank for: the prefill engine's id and its request id, from the
    prefill's ``kv_transfer_params`` (the decode engine's own request id is not the proxy's to know)."""
    return f"{remote_engine_id} {remote_request_id}"


def report_message(auth: KVAuth, remote_engine_id: str, remote_request_id: str, ttl_s: float = LIVE_TTL_S) -> bytes:
    """A sealed report query, valid for ``ttl_s``."""
    return auth.seal(b"report", report_key(remote_engine_id, remote_request_id).encode(), ttl_s)


class RefusedMessages:
    """Side-channel messages refused for want of authentication, by kind (handshake, release, report,
    message: not even framed as ours); the server thread counts, the engine's stats take them."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


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
    """Answers handshakes, releases, report queries and pings on ``tcp://host:port`` from a daemon thread until
    ``close()``; no message, peer or callback ends that thread (see the module's docstring)."""

    def __init__(
        self,
        engine_id: str,
        host: str,
        port: int,
        topology: KVTopology,
        response: bytes,
        auth: KVAuth,
        on_release: Callable[[str], None] | None = None,
        answer_delay_s: float = 0.0,
        on_read: Callable[[str, bytes], None] | None = None,
        on_report: Callable[[str], bytes | None] | None = None,
        refusal_log_interval_s: float = DEFAULT_INTERVAL_S,
    ):
        self.engine_id = engine_id
        self._auth = auth
        self.refused = RefusedMessages()
        self._refusal_log = LogLimiter(logger, refusal_log_interval_s)
        self.endpoint = tcp_endpoint(host, port)
        self._topology = topology
        self._response = response
        self._on_release = on_release
        self._on_read = on_read
        self._on_report = on_report
        self._answer_delay_s = answer_delay_s  # fault injection: a slow peer
        self._closing = threading.Event()
        self._context = zmq.Context()
        # close() wakes the thread through this pair: it sleeps until a message or that, never on a timer.
        self._wake = self._context.socket(zmq.PAIR)
        self._waker = self._context.socket(zmq.PAIR)
        wake_endpoint = f"inproc://pdserve-side-channel-stop-{id(self)}"
        self._wake.bind(wake_endpoint)
        self._waker.connect(wake_endpoint)
        try:
            self._socket = self._bound_socket()
        except zmq.ZMQError as e:
            self._context.destroy(linger=0)
            raise TransportError(f"engine {engine_id}: cannot bind the side channel on {self.endpoint}: {e}") from e
        self._thread = threading.Thread(target=self._serve, name=f"pdserve-side-channel-{port}", daemon=True)
        self._thread.start()
        logger.info("engine %s: handshake side channel listening on %s", engine_id, self.endpoint)

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs (it ends at ``close()``, or after logging why at ERROR)."""
        return self._thread.is_alive()

    def _bound_socket(self) -> zmq.Socket:
        socket = self._context.socket(zmq.REP)
        socket.setsockopt(zmq.LINGER, 0)
        # zmq drops a peer that sends a longer frame before reading it: junk never reaches the MAC.
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            socket.bind(self.endpoint)
        except zmq.ZMQError:
            socket.close()
            raise
        return socket

    def _serve(self) -> None:
        error: Exception | None = None
        try:
            self._serve_until_closed()
        except Exception as e:  # noqa: BLE001 - the thread ends: logged below with its cause
            error = e
        finally:
            self._socket.close()
            self._wake.close()
        if not self._closing.is_set():
            logger.error(
                "engine %s: the side channel on %s stopped serving: handshakes, releases and report queries "
                "to this rank go unanswered",
                self.engine_id,
                self.endpoint,
                exc_info=error,
            )

    def _serve_until_closed(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self._socket, zmq.POLLIN)
        while True:
            try:
                if self._wake in dict(poller.poll()):
                    return
                self._serve_one()
            except zmq.Again:
                continue  # woken without a whole message: wait again
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                self._refusal_log.warning(
                    "socket", "engine %s: side-channel socket failed (%s); binding it anew", self.engine_id, e
                )
                poller.unregister(self._socket)
                if not self._rebind():
                    return
                poller.register(self._socket, zmq.POLLIN)

    def _serve_one(self) -> None:
        """Read one whole message and answer it; never blocks (the poller said a message is there)."""
        frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        self._socket.send(self._reply(frames), flags=zmq.NOBLOCK)

    def _reply(self, frames: list[zmq.Frame]) -> bytes:
        if len(frames) != 1:
            return self._refuse("message", f"not a sealed pdserve message ({len(frames)} frames)")
        message = frames[0].bytes
        if not message:
            return self._refuse("message", "not a sealed pdserve message (empty)")
        try:
            return self._answer(message)
        except Exception:  # noqa: BLE001 - a bug or a failing callback must not end the channel: logged, ERR
            self._refusal_log.error(
                "internal", "engine %s: a side-channel message failed", self.engine_id, exc_info=True
            )
            return _ERROR_PREFIX + b"internal"

    def _rebind(self) -> bool:
        """Close the socket and bind a new one on the same endpoint; False if ``close()`` came first."""
        self._socket.close()
        error: zmq.ZMQError | None = None
        for _ in range(REBIND_ATTEMPTS):
            try:
                self._socket = self._bound_socket()
            except zmq.ZMQError as e:
                error = e
            else:
                logger.info("engine %s: the side channel listens on %s again", self.engine_id, self.endpoint)
                return True
            if self._wake.poll(int(REBIND_PAUSE_S * 1000)):
                return False
        raise TransportError(
            f"engine {self.engine_id}: cannot bind the side channel on {self.endpoint} again "
            f"({REBIND_ATTEMPTS} tries): {error}"
        )

    def _refuse(self, kind: str, reason: str) -> bytes:
        self.refused.add(kind)
        self._refusal_log.warning(
            kind, "engine %s: refused a side-channel %s message: %s", self.engine_id, kind, reason
        )
        return _ERROR_PREFIX + b"unauthenticated " + reason.encode()

    def _answer(self, message: bytes) -> bytes:
        try:
            kind, body = self._auth.open(message)
        except Unauthenticated as e:
            return self._refuse(e.kind, e.reason)
        if kind == b"ping":
            return b"OK"
        if kind == b"release":
            if self._on_release is None or not body:
                return _ERROR_PREFIX + b"malformed release"
            self._on_release(body.decode(errors="replace"))
            return b"OK"
        if kind == b"read":
            reader, _, notification = body.partition(b" ")
            if self._on_read is None or not reader or not notification:
                return _ERROR_PREFIX + b"malformed read"
            self._on_read(reader.decode(errors="replace"), notification)
            return b"OK"
        if kind == b"report":
            report = self._on_report(body.decode(errors="replace")) if self._on_report is not None else None
            return report or NO_REPORT
        if kind != b"handshake":
            return _ERROR_PREFIX + b"malformed unexpected message kind"
        nonce, _, handshake = body.partition(b" ")
        try:
            request = decode_request(handshake, self._topology)
        except HandshakeRejected as e:
            self._refusal_log.warning(f"handshake {e.kind}", "engine %s: refused a handshake: %s", self.engine_id, e)
            return _ERROR_PREFIX + e.kind.encode() + b" " + str(e).encode()
        logger.info("engine %s: handshake from engine %s", self.engine_id, request.engine_id)
        if self._answer_delay_s:
            time.sleep(self._answer_delay_s)
        return self._auth.seal(b"handshake-reply", nonce + b" " + self._response)

    def close(self) -> None:
        if self._waker.closed:
            return
        self._closing.set()
        if self._thread.is_alive():
            try:
                self._waker.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # a wake-up is already waiting
        self._thread.join(timeout=2)
        self._waker.close()
        self._context.term()


def request_handshake(
    engine_id: str, topology: KVTopology, endpoint: str, auth: KVAuth, timeout_s: float = 5.0
) -> HandshakeResponse:
    """Ask the prefill worker rank at ``endpoint`` (``tcp://host:port``) for its handshake response;
    raise on timeout, refusal, or an answer not sealed for this very request."""
    nonce = secrets.token_hex(_NONCE_BYTES).encode()
    handshake = encode_request(HandshakeRequest(engine_id=engine_id, topology=topology))
    message = auth.seal(b"handshake", nonce + b" " + handshake)
    reply = _ask(endpoint, message, timeout_s, f"engine {engine_id}: no handshake answer from {endpoint}")
    if reply.startswith(_ERROR_PREFIX):
        kind, _, reason = reply[len(_ERROR_PREFIX) :].decode(errors="replace").partition(" ")
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


def _ask(endpoint: str, message: bytes, timeout_s: float, failure: str) -> bytes:
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)  # a peer that answers more is dropped: a timeout here
    try:
        socket.connect(endpoint)
        socket.send(message)
        return socket.recv()
    except zmq.ZMQError as e:
        raise TransportError(f"{failure}: {e}") from e
    finally:
        socket.close()


def send_release(endpoint: str, message: bytes, timeout_s: float = 2.0) -> bool:
    """Send a sealed release (``release_message``) to the worker at ``endpoint``; False if it did not take it."""
    return _answered_ok(endpoint, message, timeout_s, "release", logging.WARNING)


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

    def release(self, endpoint: str, request_id: str) -> None:
        self._send(endpoint, release_message(self._auth, request_id), "release", f"released request {request_id}")

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
