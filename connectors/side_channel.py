"""The side channel's server: one on every worker; decode workers, the engine actor and the proxy ask it.

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
- A ping (``side_client.ping``): answered ``OK``; it says the rank's channel is serving
  and shares our key.

Every message, both ways for a handshake, is sealed with the cluster's KV key
(``contract.auth``): the server answers a message it cannot open with
``ERR unauthenticated <reason>``, does nothing else for it, and counts it
(``refused``, by kind; ``pdserve:kv_refused_total`` on ``/metrics``).
Refusals are logged at most once per kind every 10 s (``connectors.log_limit``;
the line says how many it left out), so junk cannot flood the log.

No peer can stop or starve the server, nor make it hold more than a bound:

- A message is one frame (``contract.framing``): an 8-byte header (magic and
  version, body length) and the body. The server reads the header first and
  drops the connection, unanswered, if the magic is wrong or the length is 0
  or over ``MAX_REQUEST_BYTES`` (1 MiB): no byte of that body is read, nothing
  reaches the MAC; it is counted (``message``). There are no multi-frame
  messages: the frame count limit is one by construction.
- One request at a time per connection: the server reads a connection's next
  message only once it has sent the answer to the last one. It holds at most
  ``MAX_CONNECTIONS`` (64) connections; one more takes the place of the
  connection that has waited longest for (the rest of) its message, or is
  closed if every connection waits for its answer to be taken. A connection
  that takes over ``IO_TIMEOUT_S`` (5 s) to send a whole message (a slow
  loris, an idle one) or to take its answer is dropped. So the request bytes
  the server holds, all connections together, never pass ``MAX_CONNECTIONS``
  x (8 + ``MAX_REQUEST_BYTES``), about 64 MiB (``buffered_high_water`` says the
  most they were).
- Fairness: one thread serves every connection, and each turn of its loop
  reads (at most 256 KiB, at most one message) or answers at most once per
  connection; a ping on a connection of its own is answered within a turn or
  two however fast another connection sends. The loop turns at least every
  ``IDLE_TURN_S`` (1 s).
- Any exception while answering (a bug, an ``on_release`` or ``on_report``
  callback that raises) is logged and answered ``ERR internal``; an error on
  one connection drops that connection only.
- A listening socket that fails (``accept`` raises) is closed and bound anew
  on the same endpoint (``REBIND_ATTEMPTS`` tries, ``REBIND_PAUSE_S`` apart).

The thread ends only at ``close()``; if it ever ends otherwise (the endpoint
could not be bound again), it logs an ERROR and ``alive`` turns False. The
messages are made in ``connectors.side_messages``; the clients
(``connectors.side_client``, ``proxy.release.ask``) use one TCP connection per
request and read the answer's header first too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connectors.errors import HandshakeRejected, TransportError
from connectors.handshake import (
    decode_request,
)
from connectors.log_limit import DEFAULT_INTERVAL_S, LogLimiter
from connectors.side_messages import ERROR_PREFIX, MAX_REQUEST_BYTES, NO_REPORT
from connectors.topology import KVTopology
from contract.auth import KVAuth, Unauthenticated
from contract.framing import FrameReader, FramingError, frame
from contract.kv_report import KVReport
from contract.wire import parse_tcp_endpoint, tcp_endpoint

__all__ = [
    "MAX_CONNECTIONS",
    "RecentReports",
    "RefusedMessages",
    "SideChannelServer",
]

logger = logging.getLogger(__name__)

RECENT_REPORTS = 4096
MAX_CONNECTIONS = 64
"""The most connections the server holds open (read when one is accepted)."""
IO_TIMEOUT_S = 5.0
"""How long a connection may take to send a whole message, or to take its answer, before it is dropped."""
IDLE_TURN_S = 1.0
"""The longest the serving loop waits for something to happen."""
LISTEN_BACKLOG = 128
_CHUNK_BYTES = 256 * 1024
"""The most bytes read from one connection in one turn of the loop."""
REBIND_ATTEMPTS = 50
REBIND_PAUSE_S = 0.1


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

    def add(self, key: str, report: KVReport) -> None:
        encoded = json.dumps(report.as_dict(), separators=(",", ":")).encode()
        with self._lock:
            self._reports[key] = encoded
            if len(self._reports) > self._limit:
                self._reports.popitem(last=False)

    def encoded(self, key: str) -> bytes | None:
        with self._lock:
            return self._reports.get(key)


class _Listener:
    """Marks the listening socket's registration in the selector."""


class _Wake:
    """Marks the wake-up socket's registration: ``close()`` writes to it."""


@dataclass(slots=True, eq=False)
class _Connection:
    """One peer's connection: reading its next message (``reader``), or sending the answer to the last one."""

    sock: socket.socket
    since: float
    """When it began to wait for its message, or for its answer to be taken (``time.monotonic()``)."""
    reader: FrameReader | None
    answer: memoryview | None = None
    counted: int = 0
    """Its bytes in the request bytes the server holds (``_buffered``)."""


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
        on_pin: Callable[[str], bytes] | None = None,
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
        self._on_pin = on_pin
        self._on_report = on_report
        self._answer_delay_s = answer_delay_s  # fault injection: a slow peer
        self._closing = threading.Event()
        self._connections: dict[socket.socket, _Connection] = {}
        self._buffered = 0
        self._buffered_high_water = 0
        self._selector = selectors.DefaultSelector()
        # close() wakes the thread through this pair, whatever it waits for
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ, _Wake)
        try:
            self._listener = self._bound_socket()
        except (OSError, ValueError) as e:
            self._selector.close()
            self._wake.close()
            self._waker.close()
            raise TransportError(f"engine {engine_id}: cannot bind the side channel on {self.endpoint}: {e}") from e
        self._selector.register(self._listener, selectors.EVENT_READ, _Listener)
        self._thread = threading.Thread(target=self._serve, name=f"pdserve-side-channel-{port}", daemon=True)
        self._thread.start()
        logger.info("engine %s: handshake side channel listening on %s", engine_id, self.endpoint)

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs (it ends at ``close()``, or after logging why at ERROR)."""
        return self._thread.is_alive()

    @property
    def buffered_high_water(self) -> int:
        """The most bytes of requests read and not yet answered the server ever held, all connections together:
        at most ``MAX_CONNECTIONS`` x (``HEADER_BYTES`` + ``MAX_REQUEST_BYTES``)."""
        return self._buffered_high_water

    def _bound_socket(self) -> socket.socket:
        host, port = parse_tcp_endpoint(self.endpoint)
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        return listener

    def _serve(self) -> None:
        error: Exception | None = None
        try:
            self._serve_until_closed()
        except Exception as e:  # noqa: BLE001 - the thread ends: logged below with its cause
            error = e
        finally:
            for connection in list(self._connections.values()):
                self._drop(connection)
            self._listener.close()
            self._wake.close()
            self._selector.close()
        if not self._closing.is_set():
            logger.error(
                "engine %s: the side channel on %s stopped serving: handshakes, releases and report queries "
                "to this rank go unanswered",
                self.engine_id,
                self.endpoint,
                exc_info=error,
            )

    def _serve_until_closed(self) -> None:
        """Each turn: at most one read (one message at most) or one answer sent per connection, then late
        connections dropped, then new ones taken."""
        while True:
            events = self._selector.select(self._wait_s())
            listener_ready = False
            for key, mask in events:
                if key.data is _Wake:
                    return
                if key.data is _Listener:
                    listener_ready = True
                elif mask & selectors.EVENT_READ:
                    self._read(key.data)
                else:
                    self._send_answer(key.data)
            self._drop_late(time.monotonic())
            if not listener_ready:
                continue
            try:
                self._accept_new()
            except OSError as e:
                self._refusal_log.warning(
                    "socket", "engine %s: side-channel socket failed (%s); binding it anew", self.engine_id, e
                )
                if not self._rebind():
                    return

    def _wait_s(self) -> float:
        """Until the first connection's time is up, and never longer than ``IDLE_TURN_S``."""
        if not self._connections:
            return IDLE_TURN_S
        first = min(connection.since for connection in self._connections.values())
        return min(IDLE_TURN_S, max(0.0, first + IO_TIMEOUT_S - time.monotonic()))

    def _accept(self) -> tuple[socket.socket, Any]:
        return self._listener.accept()

    def _accept_new(self) -> None:
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = self._accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            sock.setblocking(False)
            if len(self._connections) >= MAX_CONNECTIONS and not self._evict_oldest_waiting():
                self._refusal_log.warning(
                    "connections", "engine %s: %d side-channel connections wait for their answers to be taken; "
                    "closed a new one", self.engine_id, len(self._connections),
                )  # fmt: skip
                sock.close()
                continue
            connection = _Connection(sock, time.monotonic(), FrameReader(MAX_REQUEST_BYTES))
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _evict_oldest_waiting(self) -> bool:
        """Drop the connection that has waited longest for (the rest of) its message; False if none waits."""
        waiting = [connection for connection in self._connections.values() if connection.reader is not None]
        if not waiting:
            return False
        self._refusal_log.warning(
            "connections", "engine %s: %d side-channel connections open; dropped the one waiting longest for its "
            "message", self.engine_id, len(self._connections),
        )  # fmt: skip
        self._drop(min(waiting, key=lambda connection: connection.since))
        return True

    def _drop_late(self, now: float) -> None:
        for connection in list(self._connections.values()):
            if now - connection.since > IO_TIMEOUT_S:
                what = "send its message" if connection.reader is not None else "take its answer"
                self._refusal_log.warning(
                    "slow", "engine %s: a side-channel peer did not %s within %.0f s; dropped it",
                    self.engine_id, what, IO_TIMEOUT_S,
                )  # fmt: skip
                self._drop(connection)

    def _read(self, connection: _Connection) -> None:
        """Read what the connection has of its message; answer it once it is whole."""
        reader = connection.reader
        if reader is None:  # an answer is being sent: never registered for reading
            return
        try:
            message = reader.read_from(connection.sock, _CHUNK_BYTES)
        except (FramingError, EOFError, OSError) as e:
            self._account(connection)  # what it read counts until the connection goes
            if isinstance(e, FramingError):  # nothing of its body was read, and nothing is answered
                self._refuse("message", str(e))
            self._drop(connection)
            return
        self._account(connection)
        if message is None:
            return
        connection.reader = None
        self._account(connection)
        connection.answer = memoryview(frame(self._reply(message)))
        connection.since = time.monotonic()
        self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        self._send_answer(connection)

    def _send_answer(self, connection: _Connection) -> None:
        """Send what the socket takes of the answer; once it is all sent, read the connection's next message."""
        if connection.answer is None:
            return
        try:
            sent = connection.sock.send(connection.answer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(connection)
            return
        connection.answer = connection.answer[sent:]
        if connection.answer:
            return
        connection.answer = None
        connection.reader = FrameReader(MAX_REQUEST_BYTES)
        connection.since = time.monotonic()
        self._selector.modify(connection.sock, selectors.EVENT_READ, connection)

    def _account(self, connection: _Connection) -> None:
        held = connection.reader.buffered if connection.reader is not None else 0
        self._buffered += held - connection.counted
        connection.counted = held
        self._buffered_high_water = max(self._buffered_high_water, self._buffered)

    def _drop(self, connection: _Connection) -> None:
        if self._connections.pop(connection.sock, None) is None:
            return
        connection.reader = connection.answer = None
        self._account(connection)
        self._selector.unregister(connection.sock)
        connection.sock.close()

    def _reply(self, message: bytes) -> bytes:
        try:
            return self._answer(message)
        except Exception:  # noqa: BLE001 - a bug or a failing callback must not end the channel: logged, ERR
            self._refusal_log.error(
                "internal", "engine %s: a side-channel message failed", self.engine_id, exc_info=True
            )
            return ERROR_PREFIX + b"internal"

    def _rebind(self) -> bool:
        """Close the listening socket and bind a new one on the same endpoint; False if ``close()`` came first.
        Open connections are kept."""
        self._selector.unregister(self._listener)
        self._listener.close()
        error: OSError | None = None
        for _ in range(REBIND_ATTEMPTS):
            try:
                self._listener = self._bound_socket()
            except OSError as e:
                error = e
            else:
                self._selector.register(self._listener, selectors.EVENT_READ, _Listener)
                logger.info("engine %s: the side channel listens on %s again", self.engine_id, self.endpoint)
                return True
            if self._closing.wait(REBIND_PAUSE_S):
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
        return ERROR_PREFIX + b"unauthenticated " + reason.encode()

    def _answer(self, message: bytes) -> bytes:
        try:
            kind, body = self._auth.open(message)
        except Unauthenticated as e:
            return self._refuse(e.kind, e.reason)
        if kind == b"ping":
            return b"OK"
        if kind == b"release":
            if self._on_release is None or not body:
                return ERROR_PREFIX + b"malformed release"
            self._on_release(body.decode(errors="replace"))
            return b"OK"
        if kind == b"pin":
            if self._on_pin is None or not body:
                return ERROR_PREFIX + b"malformed pin"
            return self._on_pin(body.decode(errors="replace"))
        if kind == b"read":
            reader, _, notification = body.partition(b" ")
            if self._on_read is None or not reader or not notification:
                return ERROR_PREFIX + b"malformed read"
            self._on_read(reader.decode(errors="replace"), notification)
            return b"OK"
        if kind == b"report":
            report = self._on_report(body.decode(errors="replace")) if self._on_report is not None else None
            return report or NO_REPORT
        if kind != b"handshake":
            return ERROR_PREFIX + b"malformed unexpected message kind"
        nonce, _, handshake = body.partition(b" ")
        try:
            request = decode_request(handshake, self._topology)
        except HandshakeRejected as e:
            self._refusal_log.warning(f"handshake {e.kind}", "engine %s: refused a handshake: %s", self.engine_id, e)
            return ERROR_PREFIX + e.kind.encode() + b" " + str(e).encode()
        logger.info("engine %s: handshake from engine %s", self.engine_id, request.engine_id)
        if self._answer_delay_s:
            time.sleep(self._answer_delay_s)
        return self._auth.seal(b"handshake-reply", nonce + b" " + self._response)

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive():
            with contextlib.suppress(OSError):  # a wake-up already waits, or the thread closed its end
                self._waker.send(b"\0")
        self._thread.join(timeout=2)
        self._waker.close()
