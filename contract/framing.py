"""The side channel's wire format: one message is one frame, an 8-byte header then the body.

    magic (4 bytes, ``MAGIC``: "pdserve frame", version 1) | body length (4 bytes, big-endian) | body

Both ways the same: a request (a sealed message, ``contract.auth``) and its answer. Whoever reads a frame
reads its header first and checks it against its own limit before it reads, or allocates, a byte of the
body (``body_length``): a wrong magic, a zero length or one over the limit is a ``FramingError``, and the
reader drops the connection. There are no multi-frame messages, so a message is at most one frame.

The server (``connectors.side_channel``) reads frames from non-blocking sockets a chunk at a time
(``FrameReader``); its clients read a whole answer from a blocking socket (``recv_frame``: the decode
workers' and the engine actor's) or an asyncio stream (``read_frame``: the proxy's). Plain stdlib: the
connectors and the proxy both speak it, so it is the contract's.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from contract.errors import ContractError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_FRAME_BYTES",
    "FrameReader",
    "FramingError",
    "body_length",
    "frame",
    "read_frame",
    "recv_frame",
]

MAGIC = b"PDF1"
_HEADER = struct.Struct(">4sI")
HEADER_BYTES = _HEADER.size
MAX_FRAME_BYTES = 1 << 20
"""The longest body the side channel reads from a peer; the proxy's answers (``OK``, ``NONE``, a KV report,
an ``ERR`` line) are far shorter, and it refuses a longer one too."""


class FramingError(ContractError, ValueError):
    """A frame that is not ours (wrong magic), empty, too long for its reader, or cut short."""


def frame(body: bytes) -> bytes:
    """``body`` with its header."""
    return _HEADER.pack(MAGIC, len(body)) + body


def body_length(header: bytes, max_body_bytes: int) -> int:
    """The body length a header announces; ``FramingError`` unless it is ours and 1..``max_body_bytes``."""
    magic, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise FramingError(f"not a pdserve frame (magic {magic!r})")
    if not 0 < length <= max_body_bytes:
        raise FramingError(f"a frame announcing {length} bytes (1..{max_body_bytes} taken)")
    return length


class FrameReader:
    """One frame read from a non-blocking socket, a chunk at a time: the header, then the body it announces.

    ``buffered`` is what it holds so far: at most ``HEADER_BYTES + max_body_bytes``, since the header is
    checked before the body is read, and the body is read no further than its announced length."""

    __slots__ = ("_body", "_header", "_length", "_max_body_bytes")

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body_bytes = max_body_bytes
        self._header = b""
        self._length = 0  # 0 until the header is whole and checked
        self._body = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._header) + len(self._body)

    def read_from(self, sock: socket.socket, chunk_bytes: int) -> bytes | None:
        """Read what ``sock`` has of this frame (the rest of the header, then at most ``chunk_bytes`` of the
        body); the whole body once it is there, else None. ``FramingError`` for a bad header (no body byte
        read), ``EOFError`` when the peer closed, ``OSError`` from the socket."""
        try:
            if not self._length:
                part = sock.recv(HEADER_BYTES - len(self._header))
                if not part:
                    raise EOFError("the peer closed the connection")
                self._header += part
                if len(self._header) < HEADER_BYTES:
                    return None
                self._length = body_length(self._header, self._max_body_bytes)
            part = sock.recv(min(chunk_bytes, self._length - len(self._body)))
        except (BlockingIOError, InterruptedError):
            return None
        if not part:
            raise EOFError("the peer closed the connection")
        self._body += part
        return bytes(self._body) if len(self._body) == self._length else None


def recv_frame(sock: socket.socket, max_body_bytes: int, deadline: float) -> bytes:
    """One frame's body from a blocking ``sock``, whole by ``deadline`` (``time.monotonic()``) or
    ``TimeoutError``; ``FramingError`` for a bad header or a connection closed mid-frame."""
    length = body_length(_recv_exactly(sock, HEADER_BYTES, deadline), max_body_bytes)
    return _recv_exactly(sock, length, deadline)


def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"{got} of {size} bytes came in time")
        sock.settimeout(left_s)
        read = sock.recv_into(view[got:])
        if not read:
            raise FramingError(f"the connection closed after {got} of {size} bytes")
        got += read
    return bytes(data)


async def read_frame(reader: asyncio.StreamReader, max_body_bytes: int) -> bytes:
    """One frame's body from an asyncio stream (the caller bounds the time); ``FramingError`` for a bad header
    or a connection closed mid-frame."""
    try:
        length = body_length(await reader.readexactly(HEADER_BYTES), max_body_bytes)
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise FramingError(f"the connection closed after {len(e.partial)} of {e.expected} bytes") from e
