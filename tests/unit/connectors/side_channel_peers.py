"""What the side channel's tests share: the cluster's key and a stranger's, clients that talk to a server as
any host on the network could (framed or raw bytes, half-open, flooding), and a server a test can watch and break
(``WatchedServer``). The fixtures on them are in ``conftest.py``."""

from __future__ import annotations

import errno
import logging
import socket
import struct
import time
from typing import Any

import pytest

import connectors.side_channel as side_channel
from connectors.handshake import encode_response
from connectors.side_channel import SideChannelServer
from connectors.side_client import ping, request_handshake
from connectors.side_messages import MAX_REPLY_BYTES
from contract.auth import ClusterSecret, KVAuth
from contract.framing import MAGIC, FramingError, frame, recv_frame
from contract.kv_report import KVReport
from contract.wire import parse_tcp_endpoint
from tests.unit.conftest import TEST_SECRET
from tests.unit.connectors.test_handshake import response, topology

REPORT = KVReport("transfer", bytes=4096, transfer_ms=0.5, remote_engine_id="prefill-0")
AUTH = KVAuth(TEST_SECRET)
STRANGER = KVAuth(ClusterSecret("a-secret-this-cluster-never-had-000000"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(endpoint: str, message: bytes, timeout_ms: int = 10_000) -> bytes:
    """One framed request on a connection of its own, as any client on the network could send it."""
    answer = exchange(endpoint, frame(message), timeout_ms)
    if answer is None:
        raise TimeoutError(f"no answer from {endpoint} within {timeout_ms} ms")
    return answer


def send_release(endpoint: str, message: bytes, timeout_s: float = 2.0) -> bool:
    """Whether the side channel at ``endpoint`` takes ``message`` (a sealed release or READ notification): it
    answers ``OK`` within ``timeout_s``."""
    return exchange(endpoint, frame(message), int(timeout_s * 1000)) == b"OK"


def buffered_bytes(channel: SideChannelServer) -> int:
    """The request bytes ``channel`` holds now, read and not yet answered, all connections together."""
    return channel._buffered


class WatchedServer(SideChannelServer):
    """A side channel that records the length of every message reaching ``_answer`` (the MAC) and when its loop
    last turned (``turned_at``), and that a test can make fail: ``break_listener`` (its next ``accept`` fails: a
    listening socket in a bad state) or ``fail_answers``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.answered: list[int] = []
        self.break_listener = False
        self.fail_answers = False
        self.turned_at = time.monotonic()
        super().__init__(*args, **kwargs)

    def _wait_s(self) -> float:
        self.turned_at = time.monotonic()  # each turn of the loop asks how long to wait
        return super()._wait_s()

    def _answer(self, message: bytes) -> bytes:
        self.answered.append(len(message))
        if self.fail_answers:
            raise RuntimeError("a bug in answering")
        return super()._answer(message)

    def _accept(self) -> tuple[socket.socket, Any]:
        if self.break_listener:
            self.break_listener = False
            raise OSError(errno.EBADF, "a listening socket in a bad state")
        return super()._accept()


def watched_server(server_class: type[WatchedServer] = WatchedServer, **kwargs: Any) -> tuple[WatchedServer, list[str]]:
    """A watched server on a free port whose ``on_release`` raises for request ``boom``; and what it released."""
    released: list[str] = []

    def on_release(request_id: str) -> None:
        if request_id == "boom":
            raise RuntimeError("the engine's release queue is gone")
        released.append(request_id)

    channel = server_class(
        "prefill-0", "127.0.0.1", free_port(), topology(), encode_response(response()), AUTH,
        on_release=on_release, **kwargs,
    )  # fmt: skip
    return channel, released


def header(length: int, magic: bytes = MAGIC) -> bytes:
    """A frame's header announcing ``length`` body bytes (whatever follows)."""
    return struct.pack(">4sI", magic, length)


def connect(endpoint: str, timeout_s: float = 5.0) -> socket.socket:
    return socket.create_connection(parse_tcp_endpoint(endpoint), timeout=timeout_s)


def answer_on(sock: socket.socket, timeout_s: float = 5.0) -> bytes | None:
    """The next answer on ``sock``; None if none came within ``timeout_s`` (silent, closed or reset)."""
    try:
        return recv_frame(sock, MAX_REPLY_BYTES, time.monotonic() + timeout_s)
    except (OSError, FramingError):
        return None


def exchange(endpoint: str, data: bytes, timeout_ms: int = 5_000) -> bytes | None:
    """Send ``data`` (a framed message, or any bytes) on a fresh connection, as any host could; the answer,
    or None if none came within ``timeout_ms``."""
    try:
        with connect(endpoint, timeout_ms / 1000) as sock:
            sock.sendall(data)
            return answer_on(sock, timeout_ms / 1000)
    except OSError:
        return None


def closed_by_server(sock: socket.socket, timeout_s: float = 3.0) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` without a byte of answer."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True  # reset: it closed with our bytes unread
    except TimeoutError:
        return False


def dropped_unanswered(endpoint: str, data: bytes, half_close: bool = False) -> bool:
    """Whether the server drops the connection ``data`` came on, unanswered (within 3 s, not by a timeout of
    ours); ``half_close``: the client then closes its side, a half-open connection."""
    with connect(endpoint) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except ConnectionError:
            return True  # reset while sending: it read no further
        return closed_by_server(sock)


def flood(endpoint: str, messages: list[bytes]) -> list[bytes | None]:
    """Send every message at once on one connection (no wait between them), then take their answers."""
    with connect(endpoint, 10) as sock:
        sock.sendall(b"".join(frame(message) for message in messages))
        return [answer_on(sock, 10) for _ in messages]


def assert_serves(channel: SideChannelServer, after: str) -> None:
    assert channel.alive, f"the serving thread ended after {after}"
    assert ping(channel.endpoint, AUTH, timeout_s=3), f"no answer to a ping after {after}"
    answer = request_handshake("decode-0", topology(), channel.endpoint, AUTH, timeout_s=3)
    assert answer == response(), f"a wrong handshake answer after {after}"


def records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == side_channel.__name__ and r.levelno == level and text in r.message]


def eventually(condition: Any, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
