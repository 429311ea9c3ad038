"""connectors.wire: the one endpoint formula and the wire keys every package uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from connectors import wire


def test_rank_r_of_an_engine_listens_on_kv_port_plus_r():
    assert wire.side_channel_endpoints("198.18.0.11", 5600, 3) == (
        "tcp://198.18.0.11:5600",
        "tcp://198.18.0.11:5601",
        "tcp://198.18.0.11:5602",
    )
    assert wire.side_channel_endpoint("198.18.0.11", 5600, 2) == "tcp://198.18.0.11:5602"


def test_ipv6_hosts_are_bracketed_and_parse_back():
    endpoint = wire.side_channel_endpoint("fd00::5", 5700, 1)
    assert endpoint == "tcp://[fd00::5]:5701"
    assert wire.parse_tcp_endpoint(endpoint) == ("fd00::5", 5701)
    assert wire.http_url("fd00::5", 8100) == "http://[fd00::5]:8100"
    assert wire.http_url("node-3", 8100) == "http://node-3:8100"


@pytest.mark.parametrize("bad", ["http://h:1", "tcp://h", "tcp://h:port", "tcp://a/b:1", "h:5600"])
def test_a_malformed_endpoint_is_refused_with_its_text(bad):
    with pytest.raises(ValueError, match="is not tcp://host:port"):
        wire.parse_tcp_endpoint(bad)


def test_the_prefill_request_asks_to_keep_kv_for_a_decode_engine():
    params = wire.PREFILL_REQUEST_PARAMS
    assert params[wire.DO_REMOTE_DECODE] is True and params[wire.DO_REMOTE_PREFILL] is False


def test_importable_without_vllm_ray_or_zmq():
    code = (
        "import sys, connectors.wire, proxy.pool\n"
        "bad = [m for m in ('vllm', 'ray', 'zmq', 'torch') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
