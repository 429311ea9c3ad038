"""The connector's side channel, a real TCP server: handshakes, releases, report queries, pings, and
what it refuses (anything not sealed with the cluster's KV key), counted; that no message, peer or
callback stops it (random bodies, a wrong magic, a header announcing too much or nothing, a half-open
connection, 64 MiB, another cluster's key, a replay, a fuzz); and that no peer makes it hold more than
its bound or starve a ping (a hostile client announcing 1 MiB and trickling, more connections than it
keeps, a slow loris, a flood).

(Handshakes between real engines run in the integration tests.)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import connectors.side_channel as side_channel
import connectors.side_client as side_client
from connectors.errors import TransportError
from connectors.framing import HEADER_BYTES, MAGIC, MAX_FRAME_BYTES, FramingError, frame, recv_frame
from connectors.handshake import HandshakeRequest, encode_request, encode_response
from connectors.leases import read_notification
from connectors.side_channel import MAX_BUFFERED_BYTES, MAX_CONNECTIONS, RecentReports, SideChannelServer
from connectors.side_client import ping, request_handshake, send_release
from connectors.side_messages import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    read_message,
    release_message,
    report_key,
    report_message,
)
from contract.auth import KINDS, ClusterSecret, KVAuth, Unauthenticated
from contract.kv_report import KVReport
from contract.wire import parse_tcp_endpoint
from testlib.cpu_use import context_switches
from tests.unit.conftest import TEST_SECRET
from tests.unit.connectors.test_handshake import response, topology

pytestmark = pytest.mark.timeout(15)

REPORT = KVReport("transfer", bytes=4096, transfer_ms=0.5, remote_engine_id="prefill-0")
AUTH = KVAuth(TEST_SECRET)
STRANGER = KVAuth(ClusterSecret("a-secret-this-cluster-never-had-000000"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server() -> Iterator[tuple[SideChannelServer, RecentReports, list[str]]]:
    reports, released = RecentReports(limit=2), []
    channel = SideChannelServer(
        "prefill-0", "127.0.0.1", free_port(), topology(), encode_response(response()), AUTH,
        on_release=released.append, on_report=reports.encoded,
    )  # fmt: skip
    yield channel, reports, released
    channel.close()


def ask(endpoint: str, message: bytes, timeout_ms: int = 10_000) -> bytes:
    """One framed request on a connection of its own, as any client on the network could send it."""
    answer = exchange(endpoint, frame(message), timeout_ms)
    if answer is None:
        raise TimeoutError(f"no answer from {endpoint} within {timeout_ms} ms")
    return answer


def test_a_report_query_gets_the_ranks_report_as_json(server) -> None:
    channel, reports, _ = server
    reports.add(report_key("prefill-0", "req-1"), REPORT)

    assert json.loads(ask(channel.endpoint, report_message(AUTH, "prefill-0", "req-1"))) == REPORT.as_dict()
    # another prefill engine's request of the same id is another request
    assert ask(channel.endpoint, report_message(AUTH, "prefill-1", "req-1")) == b"NONE"


def test_only_the_last_reports_are_kept(server) -> None:
    channel, reports, _ = server
    for request_id in ("a", "b", "c"):
        reports.add(report_key("prefill-0", request_id), dataclasses.replace(REPORT, bytes=len(request_id)))

    assert ask(channel.endpoint, report_message(AUTH, "prefill-0", "a")) == b"NONE"
    assert json.loads(ask(channel.endpoint, report_message(AUTH, "prefill-0", "c")))["bytes"] == 1


def test_releases_reach_the_engine(server) -> None:
    channel, _, released = server

    assert send_release(channel.endpoint, release_message(AUTH, "req-9"))
    assert released == ["req-9"]


def test_read_notifications_reach_the_engine_and_only_from_the_cluster() -> None:
    """What a CUDA IPC reader sends once its copy is done: ``on_read`` gets the reader and the notification."""
    notified: list[tuple[str, bytes]] = []
    channel = SideChannelServer(
        "prefill-0", "127.0.0.1", free_port(), topology(), encode_response(response()), AUTH,
        on_read=lambda reader, notification: notified.append((reader, notification)),
    )  # fmt: skip
    try:
        assert send_release(channel.endpoint, read_message(AUTH, "decode/rank1", read_notification("req-3", 2)))
        assert notified == [("decode/rank1", read_notification("req-3", 2))]
        assert ask(channel.endpoint, AUTH.seal(b"read", b"no-notification")) == b"ERR malformed read"
        assert ask(channel.endpoint, STRANGER.seal(b"read", b"decode/rank1 PDRD 1 req-3")).startswith(
            b"ERR unauthenticated"
        )
        assert len(notified) == 1
        assert channel.refused.take() == {"read": 1}
    finally:
        channel.close()


def test_a_handshake_answer_is_sealed_for_the_asker(server) -> None:
    channel, _, _ = server
    answer = request_handshake("decode-0", topology(), channel.endpoint, AUTH, timeout_s=3)
    assert answer == response()


def test_a_client_without_the_secret_is_refused_and_counted(server) -> None:
    """A raw ZMQ client: the old unsealed messages, and sealed ones of another cluster's key."""
    channel, reports, released = server
    reports.add(report_key("prefill-0", "req-1"), REPORT)
    handshake = b"0" * 32 + b" " + encode_request(HandshakeRequest(engine_id="intruder", topology=topology()))
    attempts = {
        "handshake": [encode_request(HandshakeRequest(engine_id="intruder", topology=topology())),
                      STRANGER.seal(b"handshake", handshake)],
        "release": [b"PDRL req-1", STRANGER.seal(b"release", b"req-1")],
        "report": [b"PDKV prefill-0 req-1", STRANGER.seal(b"report", b"prefill-0 req-1")],
    }  # fmt: skip
    for messages in attempts.values():
        for message in messages:
            reply = ask(channel.endpoint, message)
            assert reply.startswith(b"ERR unauthenticated"), reply
            assert json.dumps(REPORT.as_dict()).encode() not in reply
    assert released == []
    counted = channel.refused.take()
    assert counted == {"message": 3, "handshake": 1, "release": 1, "report": 1}, counted
    assert channel.refused.take() == {}  # taken once, by the engine's stats
    # ...and the server still answers the cluster.
    assert json.loads(ask(channel.endpoint, report_message(AUTH, "prefill-0", "req-1"))) == REPORT.as_dict()


def test_an_expired_release_is_refused(server) -> None:
    channel, _, released = server
    stale = AUTH.seal(b"release", b"req-1", ttl_s=-1)
    assert ask(channel.endpoint, stale).startswith(b"ERR unauthenticated expired")
    assert released == []


def test_our_handshake_refused_by_a_peer_of_another_cluster_says_so() -> None:
    channel = SideChannelServer(
        "prefill-9", "127.0.0.1", free_port(), topology(), encode_response(response()), STRANGER
    )
    try:
        with pytest.raises(Unauthenticated, match="refused ours"):
            request_handshake("decode-0", topology(), channel.endpoint, AUTH, timeout_s=3)
    finally:
        channel.close()


@pytest.mark.parametrize("forged", ["replayed answer", "another cluster's answer", "unsealed answer"])
def test_a_handshake_answer_not_sealed_for_this_handshake_is_refused(forged: str) -> None:
    """An impostor on the prefill's address: it answers with an old sealed answer (another nonce), one sealed
    with another key, or the raw response; the decode side refuses all of them."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    answers = {
        "replayed answer": AUTH.seal(b"handshake-reply", b"f" * 32 + b" " + encode_response(response())),
        "another cluster's answer": None,  # sealed with the stranger's key and the right nonce, below
        "unsealed answer": encode_response(response()),
    }

    def answer() -> None:
        sock, _ = listener.accept()
        with sock:
            asked = recv_frame(sock, MAX_REQUEST_BYTES, time.monotonic() + 3)
            _, body = AUTH.open(asked)
            nonce = body.split(b" ", 1)[0]
            reply = answers[forged] or STRANGER.seal(b"handshake-reply", nonce + b" " + encode_response(response()))
            sock.sendall(frame(reply))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(Unauthenticated) as refused:
            request_handshake("decode-0", topology(), f"tcp://127.0.0.1:{port}", AUTH, timeout_s=3)
        assert refused.value.kind == "handshake-reply"
    finally:
        thread.join(timeout=3)
        listener.close()


def test_an_answer_longer_than_a_client_takes_is_refused_unread() -> None:
    """A peer that announces an answer over ``MAX_REPLY_BYTES``: the client gives up at the header."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        sock, _ = listener.accept()
        with sock:
            recv_frame(sock, MAX_REQUEST_BYTES, time.monotonic() + 3)
            sock.sendall(header(MAX_REPLY_BYTES + 1))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(TransportError, match="announcing"):
            request_handshake("decode-0", topology(), f"tcp://127.0.0.1:{listener.getsockname()[1]}", AUTH, 3)
        assert time.monotonic() - started < 1.0
    finally:
        thread.join(timeout=3)
        listener.close()


async def test_the_proxys_client_asks_the_side_channel_in_the_same_frames(server) -> None:
    """``proxy.release.ask`` (asyncio): a release and a report query answered; None from a silent peer within
    its timeout; an answer announcing more than ``MAX_FRAME_BYTES`` refused at its header."""
    from proxy.release import ask as proxy_ask

    channel, reports, released = server
    reports.add(report_key("prefill-0", "req-1"), REPORT)
    assert await proxy_ask(channel.endpoint, release_message(AUTH, "req-5"), 2.0) == b"OK"
    assert released == ["req-5"]
    assert (
        json.loads(await proxy_ask(channel.endpoint, report_message(AUTH, "prefill-0", "req-1"), 2.0))
        == REPORT.as_dict()
    )
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections wait in its backlog, unanswered
        started = time.monotonic()
        assert await proxy_ask(f"tcp://127.0.0.1:{silent.getsockname()[1]}", b"x", 0.3) is None
        assert time.monotonic() - started < 1.0
    with socket.create_server(("127.0.0.1", 0)) as greedy:
        greedy_endpoint = f"tcp://127.0.0.1:{greedy.getsockname()[1]}"

        def answer_too_much() -> None:
            sock, _ = greedy.accept()
            with sock:
                recv_frame(sock, MAX_REQUEST_BYTES, time.monotonic() + 3)
                sock.sendall(header(MAX_FRAME_BYTES + 1) + bytes(64))

        thread = threading.Thread(target=answer_too_much, daemon=True)
        thread.start()
        with pytest.raises(FramingError, match="announcing"):
            await proxy_ask(greedy_endpoint, b"x", 3.0)
        thread.join(timeout=3)


async def test_an_ipv6_side_channel_is_bound_and_asked_at_its_bracketed_endpoint() -> None:
    from proxy.release import ask as proxy_ask

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    channel = SideChannelServer("prefill-0", "::1", port, topology(), encode_response(response()), AUTH)
    try:
        assert channel.endpoint == f"tcp://[::1]:{port}"
        assert ping(channel.endpoint, AUTH, timeout_s=3)
        assert await proxy_ask(channel.endpoint, AUTH.seal(b"ping", b""), 3.0) == b"OK"
    finally:
        channel.close()


def test_an_idle_side_channel_turns_once_a_second_and_closes_at_once(server) -> None:
    """Idle, the loop wakes once a second (``IDLE_TURN_S``), so ``last_loop_at`` tells a live thread from a
    stuck one; it polled ten times a second once (ten wake-ups)."""
    channel, _, released = server
    task = Path(f"/proc/self/task/{channel._thread.native_id}")
    before = context_switches(task)
    time.sleep(3.0)
    assert context_switches(task) - before <= 5
    assert time.monotonic() - channel.last_loop_at < side_channel.IDLE_TURN_S + 0.5
    ask(channel.endpoint, release_message(AUTH, "req-7"))
    assert released == ["req-7"]
    started = time.monotonic()
    channel.close()
    assert not channel._thread.is_alive()
    assert time.monotonic() - started < 0.5


# ---------------------------------------------------------------- no peer can stop or starve it


class WatchedServer(SideChannelServer):
    """A side channel that records the length of every message reaching ``_answer`` (the MAC), and that a
    test can make fail: ``break_listener`` (its next ``accept`` fails: a listening socket in a bad state) or
    ``fail_answers``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.answered: list[int] = []
        self.break_listener = False
        self.fail_answers = False
        super().__init__(*args, **kwargs)

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


@pytest.fixture
def watched() -> Iterator[tuple[WatchedServer, list[str]]]:
    channel, released = watched_server()
    yield channel, released
    channel.close()


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


def test_a_ping_says_whether_the_channel_serves_with_our_key(server) -> None:
    channel, _, _ = server
    assert ping(channel.endpoint, AUTH, timeout_s=3)
    assert not ping(channel.endpoint, STRANGER, timeout_s=3)
    assert channel.refused.take() == {"ping": 1}
    assert not ping(f"tcp://127.0.0.1:{free_port()}", AUTH, timeout_s=0.3)  # nobody there
    channel.close()
    assert not channel.alive
    assert not ping(channel.endpoint, AUTH, timeout_s=0.3)


def test_no_message_stops_the_channel(watched) -> None:
    """Each abuse gets its answer or, if its header is not one the server takes, has its connection dropped
    unanswered; each is counted where it is a refusal, and the same server then answers a ping and a
    handshake from its living thread."""
    channel, released = watched
    rng = random.Random(29)
    replay = AUTH.seal(b"release", b"req-r", ttl_s=0.3)
    assert exchange(channel.endpoint, frame(replay)) == b"OK"
    time.sleep(0.4)  # ...and it expired
    abuses = [
        ("random bytes", frame(rng.randbytes(4096)), b"ERR unauthenticated not a sealed pdserve message", "message"),
        ("a wrong magic", header(16, magic=b"\xff\x00ZM") + bytes(16), None, "message"),
        ("a header announcing too much", header(MAX_REQUEST_BYTES + 1) + bytes(4096), None, "message"),
        ("a header announcing nothing", header(0), None, "message"),
        ("a headless body", rng.randbytes(3), None, None),  # the client closes before its header is whole
        ("a half-open connection", header(100) + bytes(10), None, None),
        ("another cluster's key", frame(STRANGER.seal(b"ping", b"")), b"ERR unauthenticated wrong MAC", "ping"),
        ("a replayed expired release", frame(replay), b"ERR unauthenticated expired", "release"),
        ("a release whose callback raises", frame(release_message(AUTH, "boom")), b"ERR internal", None),
    ]
    for name, data, answer, refused_kind in abuses:
        if answer is None:
            assert dropped_unanswered(channel.endpoint, data, half_close=refused_kind is None), name
        else:
            reply = exchange(channel.endpoint, data)
            assert reply is not None and reply.startswith(answer), (name, reply)
        assert channel.refused.take() == ({refused_kind: 1} if refused_kind else {}), name
        assert_serves(channel, name)

    channel.answered.clear()
    assert dropped_unanswered(channel.endpoint, header(64 << 20) + bytes(1 << 20))
    assert_serves(channel, "a 64 MiB message")
    assert max(channel.answered) < MAX_REQUEST_BYTES  # only the ping and the handshake reached the MAC
    assert channel.refused.take() == {"message": 1}

    channel.break_listener = True
    assert exchange(channel.endpoint, frame(AUTH.seal(b"ping", b"")), timeout_ms=500) is None  # lost with it
    assert_serves(channel, "a listening socket in a bad state")
    assert released == ["req-r"]
    assert channel.buffered_bytes == 0


@pytest.mark.parametrize(
    "refused_header",
    [header(MAX_REQUEST_BYTES + 1), header(0xFFFF_FFFF), header(0), header(64, magic=b"PDS1")],
    ids=["one byte over", "4 GiB", "nothing", "a wrong magic"],
)
def test_a_header_the_server_refuses_drops_the_connection_before_its_body(watched, refused_header) -> None:
    """The server reads the 8 header bytes and nothing more: the body that follows is never read (nor
    buffered, nor MAC'd, nor answered); the refusal is counted as ``message``."""
    channel, _ = watched
    assert dropped_unanswered(channel.endpoint, refused_header + bytes(256 << 10))
    assert channel.buffered_high_water == HEADER_BYTES
    assert channel.answered == []
    assert channel.refused.take() == {"message": 1}
    assert_serves(channel, "a refused header")


def test_the_size_limit_is_the_headers_before_the_mac(watched) -> None:
    channel, _ = watched
    at_limit = exchange(channel.endpoint, frame(b"x" * MAX_REQUEST_BYTES))
    assert at_limit is not None and at_limit.startswith(b"ERR unauthenticated")
    assert channel.answered == [MAX_REQUEST_BYTES]
    assert dropped_unanswered(channel.endpoint, frame(b"x" * (MAX_REQUEST_BYTES + 1)))
    assert channel.answered == [MAX_REQUEST_BYTES]
    assert channel.refused.take() == {"message": 2}  # the first: not sealed; the second: too long to read
    assert_serves(channel, "frames over the limit")


def test_an_exception_while_answering_is_err_internal_logged_and_survived(watched, caplog) -> None:
    channel, released = watched
    with caplog.at_level(logging.WARNING, logger=side_channel.__name__):
        assert not send_release(channel.endpoint, release_message(AUTH, "boom"))
        assert not send_release(channel.endpoint, release_message(AUTH, "boom"))
        assert send_release(channel.endpoint, release_message(AUTH, "req-1"))
        channel.fail_answers = True
        with pytest.raises(TransportError, match="ERR internal"):
            request_handshake("decode-0", topology(), channel.endpoint, AUTH, timeout_s=3)
        channel.fail_answers = False
    assert released == ["req-1"]
    logged = records(caplog, logging.ERROR, "a side-channel message failed")
    assert len(logged) == 1  # the second and third within the interval are left out of the log
    assert "the engine's release queue is gone" in caplog.text  # with its traceback
    assert_serves(channel, "exceptions while answering")


def test_a_broken_listening_socket_is_bound_anew(watched, caplog) -> None:
    channel, _ = watched
    with caplog.at_level(logging.INFO, logger=side_channel.__name__):
        for _ in range(3):
            channel.break_listener = True
            assert exchange(channel.endpoint, frame(AUTH.seal(b"ping", b"")), timeout_ms=500) is None
            assert_serves(channel, "a broken listening socket")
    assert len(records(caplog, logging.WARNING, "binding it anew")) == 1  # then left out, for 10 s
    assert len(records(caplog, logging.INFO, "listens on")) == 3


class Unbindable(WatchedServer):
    """Binds its endpoint once; every later bind finds it taken."""

    binds = 0

    def _bound_socket(self) -> socket.socket:
        self.binds += 1
        if self.binds > 1:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return super()._bound_socket()


def test_a_channel_that_cannot_bind_again_says_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(side_channel, "REBIND_ATTEMPTS", 3)
    monkeypatch.setattr(side_channel, "REBIND_PAUSE_S", 0.01)
    channel, _ = watched_server(Unbindable)
    try:
        with caplog.at_level(logging.WARNING, logger=side_channel.__name__):
            channel.break_listener = True
            assert exchange(channel.endpoint, frame(AUTH.seal(b"ping", b"")), timeout_ms=500) is None
            channel._thread.join(timeout=3)
            assert not channel.alive
            assert channel.binds == 1 + 3
            assert not ping(channel.endpoint, AUTH, timeout_s=0.3)
        stopped = records(caplog, logging.ERROR, "stopped serving")
        assert len(stopped) == 1 and "3 tries" in caplog.text
    finally:
        started = time.monotonic()
        channel.close()
    assert time.monotonic() - started < 0.5
    assert len(records(caplog, logging.ERROR, "stopped serving")) == 1  # close() of a dead channel adds nothing


def test_refusals_are_counted_each_and_logged_once_per_kind_per_interval(caplog) -> None:
    channel, _ = watched_server(refusal_log_interval_s=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger=side_channel.__name__):
            answers = flood(channel.endpoint, [b"junk %d" % i for i in range(50)] + [STRANGER.seal(b"ping", b"")] * 5)
            assert all(a.startswith(b"ERR unauthenticated") for a in answers)
            assert channel.refused.take() == {"message": 50, "ping": 5}
            assert len(records(caplog, logging.WARNING, "refused a side-channel message")) == 1
            assert len(records(caplog, logging.WARNING, "refused a side-channel ping")) == 1
            time.sleep(1.1)
            flood(channel.endpoint, [b"junk again"])
        logged = records(caplog, logging.WARNING, "refused a side-channel message")
        assert len(logged) == 2 and "and 49 more like it" in logged[1].message
        assert channel.refused.take() == {"message": 1}
    finally:
        channel.close()


def fuzz_frame(rng: random.Random) -> bytes:
    """Junk, or one of our sealed messages cut short or with a byte changed, or another cluster's."""
    sealed = AUTH.seal(rng.choice(KINDS), rng.randbytes(rng.randrange(200)))
    shape = rng.randrange(6)
    if shape == 0:
        return rng.randbytes(rng.randrange(2048))
    if shape == 1:
        return sealed[: rng.randrange(len(sealed))]
    if shape == 2:
        at = rng.randrange(len(sealed))
        return sealed[:at] + bytes([sealed[at] ^ rng.randrange(1, 256)]) + sealed[at + 1 :]
    if shape == 3:
        return b"PDS1 " + rng.randbytes(rng.randrange(300))
    if shape == 4:
        return STRANGER.seal(rng.choice(KINDS), rng.randbytes(rng.randrange(200)))
    return b""


@pytest.mark.timeout(60)
def test_a_fuzzed_stream_of_messages_leaves_the_channel_serving(watched) -> None:
    """300 connections, each sending one to ten fuzzed messages in turn (each waits for its answer), some a
    header the server does not take (announcing nothing, too much, a wrong magic): every message is answered
    ``ERR unauthenticated`` (or ``OK``, a ping), and a refused header drops its connection unanswered."""
    channel, released = watched
    rng = random.Random(4)
    refusals = dropped = pings = 0
    for i in range(300):
        with connect(channel.endpoint) as sock:
            for _ in range(rng.choice((1, 1, 1, 1, 2, 3, 10))):
                if rng.random() < 0.1:
                    sock.sendall(frame(AUTH.seal(b"ping", b"")))
                    assert answer_on(sock) == b"OK", i
                    pings += 1
                    continue
                body = fuzz_frame(rng)
                if body and rng.random() > 0.03:
                    sock.sendall(frame(body))
                    reply = answer_on(sock)
                    assert reply is not None and reply.startswith(b"ERR unauthenticated"), (i, len(body), reply)
                    refusals += 1
                    continue
                refused_header = rng.choice(
                    [header(0), header(MAX_REQUEST_BYTES + 1 + rng.randrange(1 << 30)), rng.randbytes(HEADER_BYTES)]
                )
                try:
                    sock.sendall(refused_header + body)
                except ConnectionError:
                    pass
                else:
                    assert closed_by_server(sock), i
                dropped += 1
                break
    assert sum(channel.refused.take().values()) == refusals + dropped
    assert max(channel.answered) <= MAX_REQUEST_BYTES
    assert released == []
    assert refusals > 200 and dropped > 20 and pings > 10  # the seed exercised every path
    assert_serves(channel, "the fuzz")
    assert channel.buffered_bytes == 0


# ---------------------------------------------------------------- what a peer can make it hold, and wait


def test_what_hostile_clients_announcing_1_mib_and_trickling_make_it_hold_is_bounded(monkeypatch) -> None:
    """20 clients each announce a 1 MiB message, send all of it but 1 KiB, then trickle: the server holds at
    most ``MAX_CONNECTIONS`` x (header + ``MAX_REQUEST_BYTES``) (8 connections here; 64 MiB at 64), each new
    client taking the place of the one that waited longest, and a ping is still answered."""
    assert MAX_CONNECTIONS == 64 and MAX_BUFFERED_BYTES == 64 * (HEADER_BYTES + (1 << 20))
    monkeypatch.setattr(side_channel, "MAX_CONNECTIONS", 8)
    bound = 8 * (HEADER_BYTES + MAX_REQUEST_BYTES)
    channel, _ = watched_server()
    hostile: list[socket.socket] = []
    try:
        for _ in range(20):
            hostile.append(connect(channel.endpoint, 10))
            try:
                hostile[-1].sendall(header(MAX_REQUEST_BYTES) + bytes(MAX_REQUEST_BYTES - 1024))
            except ConnectionError:
                pass  # its place was taken while it sent
            assert channel.buffered_bytes <= bound
        trickle_until = time.monotonic() + 1.0
        while time.monotonic() < trickle_until:
            for sock in hostile:
                try:
                    sock.send(b"\0")
                except OSError:
                    pass
            assert channel.buffered_bytes <= bound
            time.sleep(0.02)
        started = time.monotonic()
        assert ping(channel.endpoint, AUTH, timeout_s=2)
        assert time.monotonic() - started < 0.5
    finally:
        for sock in hostile:
            sock.close()
        channel.close()
    assert 7 * MAX_REQUEST_BYTES < channel.buffered_high_water <= bound  # held, up to the bound, never past it
    assert channel.answered == [len(AUTH.seal(b"ping", b""))]  # no hostile message was ever whole
    assert channel.buffered_bytes == 0


def test_one_connection_too_many_takes_the_place_of_the_one_waiting_longest(monkeypatch) -> None:
    monkeypatch.setattr(side_channel, "MAX_CONNECTIONS", 4)
    channel, _ = watched_server()
    waiting: list[socket.socket] = []
    try:
        for _ in range(4):
            waiting.append(connect(channel.endpoint))
            waiting[-1].sendall(header(100)[:3])  # a partial header
            time.sleep(0.05)  # so each is younger than the last
        assert eventually(lambda: len(channel._connections) == 4)
        assert ping(channel.endpoint, AUTH, timeout_s=1)  # the fifth connection
        assert closed_by_server(waiting[0], 1.0)  # the oldest, waiting for the rest of its message
        assert not any(closed_by_server(sock, 0.1) for sock in waiting[1:])
    finally:
        for sock in waiting:
            sock.close()
        channel.close()


def test_a_connection_beyond_the_cap_is_closed_while_every_one_waits_for_its_answer(monkeypatch) -> None:
    """Two clients (the cap, here) ask for a 16 MiB handshake answer and never read it: a third connection is
    closed at once; once the two have not taken their answers for ``IO_TIMEOUT_S``, they go, and pings pass."""
    monkeypatch.setattr(side_channel, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(side_channel, "IO_TIMEOUT_S", 1.0)
    request = encode_request(HandshakeRequest(engine_id="decode-0", topology=topology()))
    handshake = AUTH.seal(b"handshake", b"0" * 32 + b" " + request)
    channel = SideChannelServer("prefill-0", "127.0.0.1", free_port(), topology(), b"r" * (16 << 20), AUTH)
    readers: list[socket.socket] = []
    try:
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answer cannot all be taken
            sock.connect(parse_tcp_endpoint(channel.endpoint))
            sock.sendall(frame(handshake))
            readers.append(sock)
        answering = lambda: [c for c in list(channel._connections.values()) if c.answer is not None]  # noqa: E731
        assert eventually(lambda: len(answering()) == 2, 5)
        assert dropped_unanswered(channel.endpoint, frame(AUTH.seal(b"ping", b"")))
        assert side_client.probe(channel.endpoint, AUTH, 0.5) == side_client.BUSY  # flooded, not dead
        assert eventually(lambda: ping(channel.endpoint, AUTH, timeout_s=0.5), 5)  # they timed out
        assert channel.refused.take() == {}
    finally:
        for sock in readers:
            sock.close()
        channel.close()


def test_a_slow_loris_and_an_idle_connection_are_dropped_after_the_read_timeout(monkeypatch) -> None:
    monkeypatch.setattr(side_channel, "IO_TIMEOUT_S", 0.5)
    channel, _ = watched_server()
    idle, loris = connect(channel.endpoint), connect(channel.endpoint)
    stop = threading.Event()

    def trickle() -> None:  # a byte every 50 ms: never still for long, never done
        loris.sendall(header(1000))
        while not stop.wait(0.05):
            try:
                loris.send(b"x")
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    started = time.monotonic()
    sender.start()
    try:
        assert closed_by_server(loris, 3) and closed_by_server(idle, 3)
        assert 0.4 < time.monotonic() - started < 0.5 + side_channel.IDLE_TURN_S + 0.5
        assert ping(channel.endpoint, AUTH, timeout_s=1)
        assert channel.buffered_bytes == 0 and channel.refused.take() == {}
    finally:
        stop.set()
        sender.join(timeout=2)
        idle.close()
        loris.close()
        channel.close()


@pytest.mark.timeout(60)
def test_a_ping_is_answered_within_half_a_second_while_other_clients_flood(watched) -> None:
    """One client sends sealed valid pings as fast as it can (32 at a time on one connection), another junk
    (well-framed, answered ERR; then a header it refuses, and again on a new connection); each of 30 pings of
    a third client, a connection each, is answered within 0.5 s."""
    channel, _ = watched
    stop = threading.Event()
    flooded = [0, 0]

    def flood_pings() -> None:
        batch = frame(AUTH.seal(b"ping", b"")) * 32
        with connect(channel.endpoint, 10) as sock:
            while not stop.is_set():
                sock.sendall(batch)
                flooded[0] += sum(answer_on(sock) == b"OK" for _ in range(32))

    def flood_junk() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            with connect(channel.endpoint, 10) as sock:
                for _ in range(16):
                    sock.sendall(frame(rng.randbytes(512)))
                    flooded[1] += answer_on(sock) is not None
                sock.sendall(header(MAX_REQUEST_BYTES + 1))
                closed_by_server(sock)

    floods = [threading.Thread(target=f, daemon=True) for f in (flood_pings, flood_junk)]
    for thread in floods:
        thread.start()
    took: list[float] = []
    try:
        time.sleep(0.3)
        for _ in range(30):
            started = time.monotonic()
            assert ping(channel.endpoint, AUTH, timeout_s=2)
            took.append(time.monotonic() - started)
            time.sleep(0.02)
    finally:
        stop.set()
        for thread in floods:
            thread.join(timeout=10)
    assert max(took) < 0.5, took
    assert flooded[0] > 300 and flooded[1] > 100, flooded  # the floods were on
    assert time.monotonic() - channel.last_loop_at < 1.0 + side_channel.IDLE_TURN_S


def eventually(condition: Any, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_probe_tells_a_serving_channel_from_a_gone_or_stuck_one() -> None:
    """The engine's watchdog restarts only a silent channel: one that refuses connections (its thread and socket
    gone) or takes them without ever answering (stuck); a flooded one closes them (``BUSY``, above)."""
    channel = SideChannelServer("prefill-0", "127.0.0.1", free_port(), topology(), b"r", AUTH)
    assert side_client.probe(channel.endpoint, AUTH, 1.0) == side_client.ANSWERED
    channel.close()
    assert eventually(lambda: not channel._thread.is_alive())  # gone (close waits 2 s for it: a loaded machine
    assert side_client.probe(channel.endpoint, AUTH, 0.3) == side_client.SILENT  # may take longer); refused
    with socket.socket() as stuck:  # listens (the kernel accepts), never reads nor answers
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(8)
        endpoint = f"tcp://127.0.0.1:{stuck.getsockname()[1]}"
        assert side_client.probe(endpoint, AUTH, 0.3) == side_client.SILENT
