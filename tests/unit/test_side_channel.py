"""The connector's side channel, a real ZMQ REP server: releases and the proxy's report queries.

(Handshakes over it run in the integration tests, between real engines.)
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import zmq

from connectors.side_channel import RecentReports, SideChannelServer, release_message, report_key, report_message
from tests.unit.kv_factories import topology_factory

pytestmark = pytest.mark.timeout(15)

REPORT = {"source": "transfer", "bytes": 4096, "transfer_ms": 0.5, "remote_engine_id": "prefill-0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server() -> Iterator[tuple[SideChannelServer, RecentReports, list[str]]]:
    reports, released = RecentReports(limit=2), []
    channel = SideChannelServer(
        "decode-0", "127.0.0.1", free_port(), topology_factory()(), b"handshake",
        on_release=released.append, on_report=reports.encoded,
    )  # fmt: skip
    yield channel, reports, released
    channel.close()


def ask(endpoint: str, message: bytes) -> bytes:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(endpoint)
        sock.send(message)
        return sock.recv()
    finally:
        sock.close()


def test_a_report_query_gets_the_ranks_report_as_json(server) -> None:
    channel, reports, _ = server
    reports.add(report_key("prefill-0", "req-1"), REPORT)

    assert json.loads(ask(channel.endpoint, report_message("prefill-0", "req-1"))) == REPORT
    # another prefill engine's request of the same id is another request
    assert ask(channel.endpoint, report_message("prefill-1", "req-1")) == b"NONE"


def test_only_the_last_reports_are_kept(server) -> None:
    channel, reports, _ = server
    for request_id in ("a", "b", "c"):
        reports.add(report_key("prefill-0", request_id), REPORT | {"bytes": len(request_id)})

    assert ask(channel.endpoint, report_message("prefill-0", "a")) == b"NONE"
    assert json.loads(ask(channel.endpoint, report_message("prefill-0", "c")))["bytes"] == 1


def test_releases_still_reach_the_engine(server) -> None:
    channel, _, released = server

    assert ask(channel.endpoint, release_message("req-9")) == b"OK"
    assert released == ["req-9"]
