"""The side channel's messages (``connectors.side_channel`` serves them, ``connectors.side_client`` sends them).

Each is one frame (``contract.framing``) holding a body sealed with the cluster's KV key (``contract.auth``)
under a kind: ``handshake`` (a nonce and a ``HandshakeRequest``), ``release``, ``pin``, ``read`` (a READ
notification), ``report`` and ``ping``. What each means and how it is answered: ``connectors.side_channel``.
"""

from __future__ import annotations

from connectors.handshake import MAX_MESSAGE_BYTES
from contract.auth import LIVE_TTL_S, KVAuth
from contract.framing import MAX_FRAME_BYTES

__all__ = [
    "ERROR_PREFIX",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "NONCE_BYTES",
    "NO_REPORT",
    "pin_message",
    "read_message",
    "release_message",
    "report_key",
    "report_message",
]

ERROR_PREFIX = b"ERR "
"""How an answer that refuses begins: ``ERR <kind> <reason>``."""
NO_REPORT = b"NONE"
NONCE_BYTES = 16
MAX_REQUEST_BYTES = MAX_FRAME_BYTES
"""The longest request the server reads (1 MiB); a handshake request, the largest, is a few hundred bytes (a
topology and an engine id), so this leaves room for any model identity and request id."""
_SEAL_BYTES = 1024
"""More than sealing adds to a body: magic, kind, expiry, MAC, a handshake's nonce, and the spaces between."""
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES + _SEAL_BYTES
"""The longest answer a client reads: a sealed handshake answer."""


def release_message(auth: KVAuth, request_id: str, ttl_s: float = LIVE_TTL_S, by: str | None = None) -> bytes:
    """A sealed release of ``request_id``'s blocks, valid for ``ttl_s``; ``by`` names the reader giving up its own
    pin (a release that names none is refused while any reader holds a pin)."""
    return auth.seal(b"release", (request_id if by is None else f"{request_id} {by}").encode(), ttl_s)


def pin_message(auth: KVAuth, reader: str, request_id: str, epoch: str) -> bytes:
    """A sealed pin: ``reader`` is about to READ ``request_id``'s blocks, as issued by start ``epoch``."""
    return auth.seal(b"pin", f"{reader} {request_id} {epoch}".encode())


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
