"""The connector's side channel, a real TCP server: handshakes, releases, report queries, pings and probes,
and what it refuses (anything not sealed with the cluster's KV key), counted. What no peer can do to it (stop it,
make it hold more than its bound, starve a ping) is in ``test_side_channel_hostile.py``.

(Handshakes between real engines run in the integration tests.)
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path

import pytest

import connectors.side_channel as side_channel
import connectors.side_client as side_client
from connectors.errors import TransportError
from connectors.handshake import HandshakeRequest, encode_request, encode_response
from connectors.leases import read_notification
from connectors.side_channel import SideChannelServer
from connectors.side_client import ping, request_handshake
from connectors.side_messages import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    read_message,
    release_message,
    report_key,
    report_message,
)
from contract.auth import Unauthenticated
from contract.framing import MAX_FRAME_BYTES, FramingError, frame, recv_frame
from testlib.cpu_use import context_switches
from tests.unit.connectors.side_channel_peers import (
    AUTH,
    REPORT,
    STRANGER,
    ask,
    eventually,
    free_port,
    header,
    send_release,
)
from tests.unit.connectors.test_handshake import response, topology

pytestmark = pytest.mark.timeout(15)


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


def test_an_idle_side_channel_turns_once_a_second_and_closes_at_once(watched) -> None:
    """Idle, the loop wakes once a second (``IDLE_TURN_S``): few wake-ups, and its last turn is never older."""
    channel, released = watched
    task = Path(f"/proc/self/task/{channel._thread.native_id}")
    before = context_switches(task)
    time.sleep(3.0)
    assert context_switches(task) - before <= 5
    assert time.monotonic() - channel.turned_at < side_channel.IDLE_TURN_S + 0.5
    ask(channel.endpoint, release_message(AUTH, "req-7"))
    assert released == ["req-7"]
    started = time.monotonic()
    channel.close()
    assert not channel._thread.is_alive()
    assert time.monotonic() - started < 0.5


def test_a_ping_says_whether_the_channel_serves_with_our_key(server) -> None:
    channel, _, _ = server
    assert ping(channel.endpoint, AUTH, timeout_s=3)
    assert not ping(channel.endpoint, STRANGER, timeout_s=3)
    assert channel.refused.take() == {"ping": 1}
    assert not ping(f"tcp://127.0.0.1:{free_port()}", AUTH, timeout_s=0.3)  # nobody there
    channel.close()
    assert not channel.alive
    assert not ping(channel.endpoint, AUTH, timeout_s=0.3)


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
