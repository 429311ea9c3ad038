"""contract.wire: the one endpoint formula and the wire keys every package uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from contract import wire


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
        "import sys, contract.wire, proxy.pool\n"
        "bad = [m for m in ('vllm', 'ray', 'zmq', 'torch') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- KVTransferParams: the one checked model of what a decode engine acts on --------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-1-0",
    "remote_host": "198.18.0.11",
    "remote_port": 5600,
    "remote_block_ids": [3, 4],
    "remote_num_tokens": 200,
    "tp_size": 2,
    "block_size": 128,
    "pdserve_expires": 1.9e9,
}


def test_well_formed_params_parse_and_name_their_side_channels():
    params = wire.parse_remote_prefill(GOOD)
    assert params.remote_block_ids == (3, 4) and params.side_channel(1) == "tcp://198.18.0.11:5601"
    # vLLM's own connector's shape: one list per KV cache group
    assert wire.parse_remote_prefill(dict(GOOD, remote_block_ids=[[3, 4]])) == params


@given(field=st.sampled_from(sorted(GOOD)), value=JSON_VALUES)
@settings(max_examples=400, deadline=None)
def test_any_value_in_any_field_parses_or_is_refused_never_raises_otherwise(field, value):
    try:
        wire.parse_remote_prefill(dict(GOOD, **{field: value}))
    except wire.InvalidTransferParams:
        pass


@given(raw=JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_any_json_as_the_whole_params_parses_or_is_refused(raw):
    try:
        wire.parse_remote_prefill(raw)
    except wire.InvalidTransferParams:
        pass
    assert wire.asks_remote_decode(raw) in (True, False)
    assert wire.reader_named(raw) is None or isinstance(wire.reader_named(raw), str)


def test_a_giant_block_list_is_refused_before_it_is_used():
    with pytest.raises(wire.InvalidTransferParams, match="remote_block_ids"):
        wire.parse_remote_prefill(dict(GOOD, remote_block_ids=list(range(wire.MAX_BLOCK_IDS + 1))))
