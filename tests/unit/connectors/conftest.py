"""Side channel servers for the side channel's tests (``side_channel_peers`` holds what they share)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from connectors.handshake import encode_response
from connectors.side_channel import RecentReports, SideChannelServer
from tests.unit.connectors.side_channel_peers import AUTH, WatchedServer, free_port, watched_server
from tests.unit.connectors.test_handshake import response, topology


@pytest.fixture
def server() -> Iterator[tuple[SideChannelServer, RecentReports, list[str]]]:
    reports, released = RecentReports(limit=2), []
    channel = SideChannelServer(
        "prefill-0", "127.0.0.1", free_port(), topology(), encode_response(response()), AUTH,
        on_release=released.append, on_report=reports.encoded,
    )  # fmt: skip
    yield channel, reports, released
    channel.close()


@pytest.fixture
def watched() -> Iterator[tuple[WatchedServer, list[str]]]:
    channel, released = watched_server()
    yield channel, released
    channel.close()
