"""The connector's side channel, a real ZMQ REP server: handshakes, releases, report queries, pings, and
what it refuses (anything not sealed with the cluster's KV key), counted; and that no message, peer or
callback stops it (random frames, many frames, none, 64 MiB, another cluster's key, a replay, a fuzz).

(Handshakes between real engines run in the integration tests.)
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import connectors.side_channel as side_channel
from connectors.auth import KINDS, ClusterSecret, KVAuth, Unauthenticated
from connectors.errors import TransportError
from connectors.handshake import HandshakeRequest, encode_request, encode_response
from connectors.leases import read_notification
from connectors.side_channel import (
    MAX_REQUEST_BYTES,
    RecentReports,
    SideChannelServer,
    ping,
    read_message,
    release_message,
    report_key,
    report_message,
    request_handshake,
    send_release,
)
from orchestrator.cluster import context_switches
from tests.unit.conftest import TEST_SECRET
from tests.unit.test_handshake import response, topology

pytestmark = pytest.mark.timeout(15)

REPORT = {"source": "transfer", "bytes": 4096, "transfer_ms": 0.5, "remote_engine_id": "prefill-0"}
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
    """One raw ZMQ request, as any client on the network could send it."""
    answer = send_frames(endpoint, [message], timeout_ms)
    if answer is None:
        raise TimeoutError(f"no answer from {endpoint} within {timeout_ms} ms")
    return answer


def test_a_report_query_gets_the_ranks_report_as_json(server) -> None:
    channel, reports, _ = server
    reports.add(report_key("prefill-0", "req-1"), REPORT)

    assert json.loads(ask(channel.endpoint, report_message(AUTH, "prefill-0", "req-1"))) == REPORT
    # another prefill engine's request of the same id is another request
    assert ask(channel.endpoint, report_message(AUTH, "prefill-1", "req-1")) == b"NONE"


def test_only_the_last_reports_are_kept(server) -> None:
    channel, reports, _ = server
    for request_id in ("a", "b", "c"):
        reports.add(report_key("prefill-0", request_id), REPORT | {"bytes": len(request_id)})

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
            assert json.dumps(REPORT).encode() not in reply
    assert released == []
    counted = channel.refused.take()
    assert counted == {"message": 3, "handshake": 1, "release": 1, "report": 1}, counted
    assert channel.refused.take() == {}  # taken once, by the engine's stats
    # ...and the server still answers the cluster.
    assert json.loads(ask(channel.endpoint, report_message(AUTH, "prefill-0", "req-1"))) == REPORT


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
    context = zmq.Context.instance()
    rep = context.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    answers = {
        "replayed answer": AUTH.seal(b"handshake-reply", b"f" * 32 + b" " + encode_response(response())),
        "another cluster's answer": None,  # sealed with the stranger's key and the right nonce, below
        "unsealed answer": encode_response(response()),
    }

    def answer() -> None:
        asked = rep.recv()
        _, body = AUTH.open(asked)
        nonce = body.split(b" ", 1)[0]
        reply = answers[forged] or STRANGER.seal(b"handshake-reply", nonce + b" " + encode_response(response()))
        rep.send(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(Unauthenticated) as refused:
            request_handshake("decode-0", topology(), f"tcp://127.0.0.1:{port}", AUTH, timeout_s=3)
        assert refused.value.kind == "handshake-reply"
    finally:
        thread.join(timeout=3)
        rep.close()


def test_an_idle_side_channel_sleeps_until_a_message_and_closes_at_once(server) -> None:
    channel, _, released = server
    task = Path(f"/proc/self/task/{channel._thread.native_id}")
    before = context_switches(task)
    time.sleep(1.0)
    assert context_switches(task) - before <= 1  # it polled ten times a second before: ten wake-ups
    ask(channel.endpoint, release_message(AUTH, "req-7"))
    assert released == ["req-7"]
    started = time.monotonic()
    channel.close()
    assert not channel._thread.is_alive()
    assert time.monotonic() - started < 0.5


# ---------------------------------------------------------------- no peer can stop or starve it


class WatchedServer(SideChannelServer):
    """A side channel that records the length of every message reaching ``_answer`` (the MAC), and that a
    test can make fail: ``break_socket`` (its REP socket reads twice: zmq's EFSM) or ``fail_answers``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.answered: list[int] = []
        self.break_socket = False
        self.fail_answers = False
        super().__init__(*args, **kwargs)

    def _answer(self, message: bytes) -> bytes:
        self.answered.append(len(message))
        if self.fail_answers:
            raise RuntimeError("a bug in answering")
        return super()._answer(message)

    def _serve_one(self) -> None:
        if self.break_socket:
            self.break_socket = False
            self._socket.recv_multipart(flags=zmq.NOBLOCK)
            self._socket.recv_multipart(flags=zmq.NOBLOCK)  # a REP socket must answer first: EFSM
        super()._serve_one()


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


def send_frames(endpoint: str, frames: list[bytes], timeout_ms: int = 5_000) -> bytes | None:
    """One request of any frames, on a fresh REQ socket (one whose request was dropped is stuck for good);
    None if no answer came within ``timeout_ms``."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        return sock.recv()
    except zmq.Again:
        return None
    finally:
        sock.close()


def flood(endpoint: str, messages: list[bytes]) -> list[bytes]:
    """Send every message at once through a DEALER (no wait between them), then take their answers."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock.connect(endpoint)
        for message in messages:
            sock.send_multipart([b"", message])
        return [sock.recv_multipart()[1] for _ in messages]
    finally:
        sock.close()


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
    """Each abuse gets its one-frame answer (a too long one: none, and it never reaches the MAC), is counted
    where it is a refusal, and the same server then answers a ping and a handshake from its living thread."""
    channel, released = watched
    rng = random.Random(29)
    sealed_ping = AUTH.seal(b"ping", b"")
    replay = AUTH.seal(b"release", b"req-r", ttl_s=0.3)
    assert send_frames(channel.endpoint, [replay]) == b"OK"
    time.sleep(0.4)  # ...and it expired
    abuses = [
        ("random bytes", [rng.randbytes(4096)], b"ERR unauthenticated not a sealed pdserve message", "message"),
        ("two frames", [sealed_ping] * 2, b"ERR unauthenticated not a sealed pdserve message (2 frames)", "message"),
        ("ten frames", [sealed_ping] * 10, b"ERR unauthenticated not a sealed pdserve message (10 frames)", "message"),
        ("an empty message", [b""], b"ERR unauthenticated not a sealed pdserve message (empty)", "message"),
        ("another cluster's key", [STRANGER.seal(b"ping", b"")], b"ERR unauthenticated wrong MAC", "ping"),
        ("a replayed expired release", [replay], b"ERR unauthenticated expired", "release"),
        ("a release whose callback raises", [release_message(AUTH, "boom")], b"ERR internal", None),
    ]
    for name, frames, answer, refused_kind in abuses:
        reply = send_frames(channel.endpoint, frames)
        assert reply is not None and reply.startswith(answer), (name, reply)
        assert channel.refused.take() == ({refused_kind: 1} if refused_kind else {}), name
        assert_serves(channel, name)

    channel.answered.clear()
    assert send_frames(channel.endpoint, [bytes(64 << 20)], timeout_ms=500) is None  # zmq dropped the sender
    assert_serves(channel, "a 64 MiB frame")
    assert max(channel.answered) < MAX_REQUEST_BYTES  # only the ping and the handshake reached the MAC
    assert channel.refused.take() == {}

    channel.break_socket = True
    assert send_frames(channel.endpoint, [sealed_ping], timeout_ms=500) is None  # lost with the broken socket
    assert_serves(channel, "a socket in a bad state")
    assert released == ["req-r"]


def test_the_size_limit_is_the_sockets_before_the_mac(watched) -> None:
    channel, _ = watched
    at_limit = send_frames(channel.endpoint, [b"x" * MAX_REQUEST_BYTES])
    assert at_limit is not None and at_limit.startswith(b"ERR unauthenticated")
    assert channel.answered == [MAX_REQUEST_BYTES]
    assert send_frames(channel.endpoint, [b"x" * (MAX_REQUEST_BYTES + 1)], timeout_ms=500) is None
    # one frame too long drops the whole message, and the answer to that peer
    assert send_frames(channel.endpoint, [b"x", b"x" * (MAX_REQUEST_BYTES + 1)], timeout_ms=500) is None
    assert channel.answered == [MAX_REQUEST_BYTES]
    assert channel.refused.take() == {"message": 1}
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


def test_a_broken_socket_is_bound_anew(watched, caplog) -> None:
    channel, _ = watched
    with caplog.at_level(logging.INFO, logger=side_channel.__name__):
        for _ in range(3):
            channel.break_socket = True
            assert send_frames(channel.endpoint, [AUTH.seal(b"ping", b"")], timeout_ms=500) is None
            assert_serves(channel, "a broken socket")
    assert len(records(caplog, logging.WARNING, "binding it anew")) == 1  # then left out, for 10 s
    assert len(records(caplog, logging.INFO, "listens on")) == 3


class Unbindable(WatchedServer):
    """Binds its endpoint once; every later bind finds it taken."""

    binds = 0

    def _bound_socket(self) -> zmq.Socket:
        self.binds += 1
        if self.binds > 1:
            raise zmq.ZMQError(zmq.EADDRINUSE)
        return super()._bound_socket()


def test_a_channel_that_cannot_bind_again_says_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(side_channel, "REBIND_ATTEMPTS", 3)
    monkeypatch.setattr(side_channel, "REBIND_PAUSE_S", 0.01)
    channel, _ = watched_server(Unbindable)
    try:
        with caplog.at_level(logging.WARNING, logger=side_channel.__name__):
            channel.break_socket = True
            assert send_frames(channel.endpoint, [AUTH.seal(b"ping", b"")], timeout_ms=500) is None
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
    channel, released = watched
    rng = random.Random(4)
    refusals = dropped = pings = 0
    for i in range(300):
        if rng.random() < 0.1:
            frames, expected = [AUTH.seal(b"ping", b"")], b"OK"
            pings += 1
        else:
            frames = [fuzz_frame(rng) for _ in range(rng.choice((1, 1, 1, 1, 2, 3, 10)))]
            expected = b"ERR unauthenticated"
            if rng.random() < 0.02:
                frames[rng.randrange(len(frames))] = rng.randbytes(MAX_REQUEST_BYTES + 1 + rng.randrange(4096))
                expected = None
        reply = send_frames(channel.endpoint, frames, timeout_ms=300 if expected is None else 5_000)
        if expected is None:
            assert reply is None, (i, reply)
            dropped += 1
        else:
            assert reply is not None and reply.startswith(expected), (i, [len(f) for f in frames], reply)
            refusals += expected != b"OK"
    assert sum(channel.refused.take().values()) == refusals
    assert max(channel.answered) <= MAX_REQUEST_BYTES
    assert released == []
    assert refusals > 200 and dropped > 0 and pings > 10  # the seed exercised every path
    assert_serves(channel, "the fuzz")
