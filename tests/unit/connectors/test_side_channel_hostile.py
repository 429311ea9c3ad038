"""That no message, peer or callback stops the connector's side channel (random bodies, a wrong magic, a header
announcing too much or nothing, a half-open connection, 64 MiB, another cluster's key, a replay, a fuzz), and that
no peer makes it hold more than its bound or starve a ping (a hostile client announcing 1 MiB and trickling, more
connections than it keeps, a slow loris, a flood)."""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time

import pytest

import connectors.side_channel as side_channel
import connectors.side_client as side_client
from connectors.errors import TransportError
from connectors.handshake import HandshakeRequest, encode_request
from connectors.side_channel import MAX_CONNECTIONS, SideChannelServer
from connectors.side_client import ping, request_handshake
from connectors.side_messages import MAX_REQUEST_BYTES, release_message
from contract.auth import KINDS
from contract.framing import HEADER_BYTES, frame
from contract.wire import parse_tcp_endpoint
from tests.unit.connectors.side_channel_peers import (
    AUTH,
    STRANGER,
    WatchedServer,
    answer_on,
    assert_serves,
    buffered_bytes,
    closed_by_server,
    connect,
    dropped_unanswered,
    eventually,
    exchange,
    flood,
    free_port,
    header,
    records,
    send_release,
    watched_server,
)
from tests.unit.connectors.test_handshake import topology

pytestmark = pytest.mark.timeout(15)


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
    assert buffered_bytes(channel) == 0


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
    assert buffered_bytes(channel) == 0


# ---------------------------------------------------------------- what a peer can make it hold, and wait


def test_what_hostile_clients_announcing_1_mib_and_trickling_make_it_hold_is_bounded(monkeypatch) -> None:
    """20 clients each announce a 1 MiB message, send all of it but 1 KiB, then trickle: the server holds at
    most ``MAX_CONNECTIONS`` x (header + ``MAX_REQUEST_BYTES``) (8 connections here; 64 MiB at 64), each new
    client taking the place of the one that waited longest, and a ping is still answered."""
    assert (MAX_CONNECTIONS, MAX_REQUEST_BYTES) == (64, 1 << 20)  # at most 64 x (8 B + 1 MiB) held: about 64 MiB
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
            assert buffered_bytes(channel) <= bound
        trickle_until = time.monotonic() + 1.0
        while time.monotonic() < trickle_until:
            for sock in hostile:
                try:
                    sock.send(b"\0")
                except OSError:
                    pass
            assert buffered_bytes(channel) <= bound
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
    assert buffered_bytes(channel) == 0


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
        assert buffered_bytes(channel) == 0 and channel.refused.take() == {}
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
    assert time.monotonic() - channel.turned_at < 1.0 + side_channel.IDLE_TURN_S
