"""The handshake side channel: a ZMQ REP socket on the prefill worker, a REQ call from the decode worker.

The server thread answers every well-formed ``HandshakeRequest`` with one
pre-encoded ``HandshakeResponse`` (agent metadata and KV regions do not change
after registration). A request it rejects gets an ``ERR`` reply carrying the
reason, which the caller raises as ``HandshakeRejected``.
"""

from __future__ import annotations

import logging
import threading

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

__all__ = ["SideChannelServer", "request_handshake"]

logger = logging.getLogger(__name__)

_ERROR_PREFIX = b"ERR "
_POLL_MS = 100


class SideChannelServer:
    """Answers handshakes on ``tcp://host:port`` from a daemon thread until ``close()``."""

    def __init__(self, engine_id: str, host: str, port: int, topology: KVTopology, response: bytes):
        self.engine_id = engine_id
        self.endpoint = f"tcp://{host}:{port}"
        self._topology = topology
        self._response = response
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
            try:
                request = decode_request(message, self._topology)
            except HandshakeRejected as e:
                logger.warning("engine %s: refused a handshake: %s", self.engine_id, e)
                self._socket.send(_ERROR_PREFIX + e.kind.encode() + b" " + str(e).encode())
                continue
            logger.info("engine %s: handshake from engine %s", self.engine_id, request.engine_id)
            self._socket.send(self._response)
        self._socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._context.term()


def request_handshake(
    engine_id: str, topology: KVTopology, host: str, port: int, timeout_s: float = 5.0
) -> HandshakeResponse:
    """Ask the prefill worker at ``host:port`` for its handshake response; raise on timeout or refusal."""
    endpoint = f"tcp://{host}:{port}"
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
