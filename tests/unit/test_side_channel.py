"""The connector's side channel, a real ZMQ REP server: handshakes, releases, report queries, and what
it refuses (anything not sealed with the cluster's KV key), counted.

(Handshakes between real engines run in the integration tests.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from connectors.auth import ClusterSecret, KVAuth, Unauthenticated
from connectors.handshake import HandshakeRequest, encode_request, encode_response
from connectors.side_channel import (
    RecentReports,
    SideChannelServer,
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
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(endpoint)
        sock.send(message)
        return sock.recv()
    finally:
        sock.close()


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
