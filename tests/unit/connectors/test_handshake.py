"""The side-channel handshake's wire format: round trips, every rejection kind, and the response cache."""

from __future__ import annotations

import dataclasses
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from connectors import handshake
from connectors.errors import ConnectorError, HandshakeRejected
from connectors.handshake import (
    MAGIC,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    HandshakeCache,
    HandshakeRequest,
    HandshakeResponse,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from connectors.topology import KVTopology, compatibility_hash
from tests.kv_probes import cached_ranks
from tests.unit.kv_factories import topology_factory

HEADER_SIZE = 4 + 2 + 32 + 1


topology = topology_factory(tp_size=2, total_num_kv_heads=8, layout="HN2D", head_dim=64, dtype="float16", num_layers=4)


def request(**overrides: Any) -> HandshakeRequest:
    return HandshakeRequest(**({"engine_id": "decode-0", "topology": topology()} | overrides))


def response(**overrides: Any) -> HandshakeResponse:
    fields: dict[str, Any] = dict(
        engine_id="prefill-0",
        topology=topology(),
        transports=("nixl",),
        payloads={"nixl": b"\x00nixl-agent\xff" * 3},
        kv_caches_base_addr=(0x7F00_0000_0000, 0x7F00_0010_0000, 2**64 - 1, 0),
        block_len=16 * 4 * 64 * 2,
        num_blocks=1000,
    )
    return HandshakeResponse(**(fields | overrides))


def rejection(decode: Callable[[bytes, KVTopology], object], data: Any, local: KVTopology) -> HandshakeRejected:
    with pytest.raises(HandshakeRejected) as info:
        decode(data, local)
    return info.value


# ---------------------------------------------------------------- round trips


def test_request_round_trip() -> None:
    sent = request(topology=topology(tp_size=4, tp_rank=3, layout="NH2D"))
    received = decode_request(encode_request(sent), topology())
    assert received == sent
    assert received.compatibility_hash == compatibility_hash(sent.topology)
    assert received.protocol_version == PROTOCOL_VERSION


def test_response_round_trip() -> None:
    sent = response()
    received = decode_response(encode_response(sent), topology(tp_size=4, tp_rank=1, block_size=32))
    assert received == sent
    assert received.payload_for("nixl") == b"\x00nixl-agent\xff" * 3
    assert received.kv_caches_base_addr == sent.kv_caches_base_addr


def test_each_transport_payload_travels_with_the_response() -> None:
    sent = response(transports=("cuda-ipc", "nixl"), payloads={"cuda-ipc": b'{"version": 1}', "nixl": b"agent"})
    received = decode_response(encode_response(sent), topology(tp_size=4, tp_rank=1, block_size=32))
    assert received.payload_for("cuda-ipc") == b'{"version": 1}'
    assert received.payload_for("nixl") == b"agent"
    assert received.payload_for("in-memory") == b""


def test_header_layout_is_checkable_without_the_payload() -> None:
    sent = request()
    data = encode_request(sent)
    magic, version, raw_hash, codec_id = struct.unpack_from(">4sH32sB", data)
    assert (magic, version, raw_hash.hex(), codec_id) == (
        MAGIC,
        PROTOCOL_VERSION,
        compatibility_hash(sent.topology),
        handshake.MSGPACK,
    )


def test_dtype_is_normalised_before_hashing() -> None:
    assert request(topology=topology(dtype="torch.float16")) == request()


def test_bad_local_hash_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="64 lowercase hex"):
        request(compatibility_hash="abc")


# ---------------------------------------------------------------- version


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 65535])
@pytest.mark.parametrize("kind", ["request", "response"])
def test_other_protocol_version_is_rejected(kind: str, version: int) -> None:
    if kind == "request":
        data, decode = encode_request(request(protocol_version=version)), decode_request
    else:
        data, decode = encode_response(response(protocol_version=version)), decode_response
    error = rejection(decode, data, topology())
    assert error.kind == "version"
    assert error.reasons == [f"protocol version {version}, expected {PROTOCOL_VERSION}"]


def test_version_is_checked_on_a_truncated_header() -> None:
    # a future version may have a longer header: magic + version alone must be enough to say "version"
    error = rejection(decode_request, MAGIC + struct.pack(">H", PROTOCOL_VERSION + 1), topology())
    assert error.kind == "version"


def test_header_is_checked_before_the_payload_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def payload_decoder_must_not_run(*args: object) -> dict[str, Any]:
        calls.append(args)
        raise RuntimeError("payload decoded before the header was checked")

    monkeypatch.setattr(handshake, "_decode_payload", payload_decoder_must_not_run)
    error = rejection(decode_response, encode_response(response(protocol_version=PROTOCOL_VERSION + 1)), topology())
    assert error.kind == "version"
    assert calls == []


def test_hash_mismatch_falls_back_when_the_payload_cannot_be_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def undecodable(*args: object) -> dict[str, Any]:
        raise HandshakeRejected("malformed", ["payload from another schema"])

    monkeypatch.setattr(handshake, "_decode_payload", undecodable)
    error = rejection(decode_response, encode_response(response(topology=topology(dtype="bfloat16"))), topology())
    assert error.kind == "incompatible"
    assert len(error.reasons) == 1
    assert error.reasons[0].startswith("compatibility hash differs")


# ---------------------------------------------------------------- compatibility


@pytest.mark.parametrize(
    ("field", "local_value", "remote_value"),
    [("dtype", "float16", "bfloat16"), ("head_dim", 64, 128), ("num_layers", 4, 32), ("total_num_kv_heads", 8, 16)],
)
def test_hash_mismatch_names_the_differing_field(field: str, local_value: Any, remote_value: Any) -> None:
    data = encode_response(response(topology=topology(**{field: remote_value})))
    error = rejection(decode_response, data, topology(**{field: local_value}))
    assert error.kind == "incompatible"
    assert error.reasons == [f"{field} differs: local {local_value}, remote {remote_value}"]


def test_hash_mismatch_without_a_field_difference_says_the_hash_differs() -> None:
    # same fields, but the peer hashed them under another compatibility schema
    data = encode_request(request(compatibility_hash="0" * 64))
    error = rejection(decode_request, data, topology())
    assert error.kind == "incompatible"
    assert error.reasons[0].startswith("compatibility hash differs")


def test_tp_sizes_that_do_not_divide_are_rejected_after_decoding() -> None:
    local = topology(tp_size=2, total_num_kv_heads=12)
    data = encode_response(response(topology=topology(tp_size=3, total_num_kv_heads=12)))
    error = rejection(decode_response, data, local)
    assert error.kind == "incompatible"
    assert error.reasons == ["tp sizes do not divide one another: local 2, remote 3"]
    assert isinstance(error.__cause__, ConnectorError)


@pytest.mark.parametrize(
    ("reader_block", "source_block", "compatible"),
    [(32, 16, True), (16, 16, True), (16, 32, False)],
)
def test_block_size_rule_runs_with_the_decode_side_as_reader(
    reader_block: int, source_block: int, compatible: bool
) -> None:
    """Both sides reach the same verdict: the decode engine reads the prefill engine's blocks."""
    decode_side, prefill_side = topology(block_size=reader_block), topology(block_size=source_block)
    outcomes = []
    for decode, data, local in [
        (decode_request, encode_request(request(topology=decode_side)), prefill_side),
        (decode_response, encode_response(response(topology=prefill_side)), decode_side),
    ]:
        try:
            decode(data, local)
            outcomes.append(True)
        except HandshakeRejected as e:
            assert e.kind == "incompatible"
            assert "block size" in e.reasons[0]
            outcomes.append(False)
    assert outcomes == [compatible, compatible]


def test_header_hash_that_contradicts_the_payload_is_malformed() -> None:
    lying = request(topology=topology(dtype="bfloat16"), compatibility_hash=compatibility_hash(topology()))
    error = rejection(decode_request, encode_request(lying), topology())
    assert error.kind == "malformed"
    assert "does not match" in error.reasons[0]


# ---------------------------------------------------------------- malformed input


def _valid() -> bytes:
    return encode_response(response())


def _with_payload(payload: bytes, codec: int = handshake.MSGPACK) -> bytes:
    return _valid()[: HEADER_SIZE - 1] + bytes([codec]) + payload


def _response_payload(**changes: Any) -> bytes:
    wire = msgspec.msgpack.decode(encode_response(response())[HEADER_SIZE:])
    for key, value in changes.items():
        if value is None:
            del wire[key]
        else:
            wire[key] = value
    return _with_payload(msgspec.msgpack.encode(wire))


MALFORMED: dict[str, Callable[[], Any]] = {
    "empty": lambda: b"",
    "magic only": lambda: MAGIC,
    "truncated magic": lambda: MAGIC[:2],
    "truncated header": lambda: _valid()[:20],
    "truncated payload": lambda: _valid()[:-5],
    "garbage": lambda: bytes(range(256)) * 4,
    "wrong magic": lambda: b"XXXX" + _valid()[4:],
    "http request": lambda: b"GET / HTTP/1.1\r\n\r\n",
    "not bytes": lambda: "PDKV",
    "none": lambda: None,
    "unknown codec": lambda: _with_payload(b"{}", codec=99),
    "the JSON codec of protocol 1": lambda: _with_payload(b'{"engine_id": "prefill-0"}', codec=2),
    "payload is a list": lambda: _with_payload(msgspec.msgpack.encode([1, 2])),
    "payload is garbage msgpack": lambda: _with_payload(b"\xc1\xc1\xc1"),
    "deeply nested msgpack": lambda: _with_payload(b"\x91" * 1_000_000),
    "missing engine id": lambda: _response_payload(engine_id=None),
    "negative block_len": lambda: _response_payload(block_len=-1),
    "bool num_blocks": lambda: _response_payload(num_blocks=True),
    "negative address": lambda: _response_payload(kv_caches_base_addr=[-1]),
    "no payloads": lambda: _response_payload(payloads=None),
    "no transports": lambda: _response_payload(transports=None),
    "payloads not a map": lambda: _response_payload(payloads=["cuda-ipc"]),
    "payload of an unknown transport": lambda: _response_payload(payloads={"rdma-magic": ""}),
    "payload not bytes": lambda: _response_payload(payloads={"cuda-ipc": "%%%"}),
    "topology missing field": lambda: _response_payload(topology={"tp_size": 2}),
    "topology invalid": lambda: _response_payload(
        topology=dict(_TOPOLOGY_WIRE, tp_rank=5),
    ),
    "topology string for int": lambda: _response_payload(topology=dict(_TOPOLOGY_WIRE, head_dim="64")),
}
_TOPOLOGY_WIRE = {f.name: getattr(topology(), f.name) for f in dataclasses.fields(KVTopology)} | {"layout": "HN2D"}


# fields only a response carries: a request decoder ignores them
RESPONSE_ONLY = {
    "negative block_len",
    "bool num_blocks",
    "negative address",
    "no payloads",
    "no transports",
    "payloads not a map",
    "payload of an unknown transport",
    "payload not bytes",
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_input_is_rejected_not_raised(name: str) -> None:
    data = MALFORMED[name]()
    decoders = (decode_response,) if name in RESPONSE_ONLY else (decode_request, decode_response)
    for decode in decoders:
        error = rejection(decode, data, topology())
        assert error.kind == "malformed"
        assert error.reasons[0].startswith("malformed handshake message")


def test_oversized_message_is_rejected_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "_decode_payload", lambda *args: pytest.fail("payload decoded"))
    oversized = _valid() + b"\x00" * MAX_MESSAGE_BYTES
    error = rejection(decode_response, oversized, topology())
    assert error.kind == "malformed"
    assert "exceeds" in error.reasons[0]


def test_oversized_message_is_refused_when_encoding() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_response(response(payloads={"nixl": b"\x00" * MAX_MESSAGE_BYTES}))


def test_memoryview_and_bytearray_inputs_are_accepted() -> None:
    data = _valid()
    assert decode_response(memoryview(data), topology()) == decode_response(bytearray(data), topology()) == response()


# ---------------------------------------------------------------- HandshakeRejected


@pytest.mark.parametrize("kind", ["version", "incompatible", "malformed"])
def test_rejection_survives_pickling(kind: str) -> None:
    original = HandshakeRejected(kind, ["first reason", "second reason"])
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is HandshakeRejected
    assert (copy.kind, copy.reasons, str(copy)) == (kind, ["first reason", "second reason"], str(original))
    assert isinstance(copy, ConnectorError)


def test_rejection_kind_is_a_known_label() -> None:
    with pytest.raises(ValueError, match="unknown handshake rejection kind"):
        HandshakeRejected("other", ["x"])


# ---------------------------------------------------------------- HandshakeCache


@pytest.fixture
def cache() -> HandshakeCache:
    return HandshakeCache()


def test_cache_handshakes_once_per_peer(cache: HandshakeCache) -> None:
    calls: list[str] = []

    def handshake_with(engine_id: str) -> Callable[[], HandshakeResponse]:
        return lambda: calls.append(engine_id) or response(engine_id=engine_id)

    first = cache.get_or_handshake("prefill-0", handshake_with("prefill-0"))
    again = cache.get_or_handshake("prefill-0", handshake_with("prefill-0"))
    other = cache.get_or_handshake("prefill-1", handshake_with("prefill-1"))
    assert first is again
    assert other.engine_id == "prefill-1"
    assert calls == ["prefill-0", "prefill-1"]
    assert cached_ranks(cache) == {("prefill-0", 0), ("prefill-1", 0)}


def test_cache_invalidation_forces_a_new_handshake(cache: HandshakeCache) -> None:
    cache.put(response())
    assert cache.invalidate("prefill-0") is True
    assert cache.invalidate("prefill-0") is False
    assert cache.get("prefill-0") is None
    fresh = response(num_blocks=7)
    assert cache.get_or_handshake("prefill-0", lambda: fresh) is fresh


def test_cache_keeps_one_answer_per_tp_rank_of_an_engine(cache: HandshakeCache) -> None:
    ranks = [response(topology=topology(tp_size=2, tp_rank=rank)) for rank in (0, 1)]
    assert cache.get_or_handshake("prefill-0", lambda: ranks[1], tp_rank=1) is ranks[1]
    assert cache.get_or_handshake("prefill-0", lambda: ranks[0], tp_rank=0) is ranks[0]
    assert cache.get_or_handshake("prefill-0", lambda: pytest.fail("cached"), tp_rank=1) is ranks[1]
    assert cached_ranks(cache) == {("prefill-0", 0), ("prefill-0", 1)}
    assert cache.invalidate("prefill-0", 1) is True
    assert cache.get("prefill-0", 1) is None and cache.get("prefill-0", 0) is ranks[0]
    cache.put(ranks[1])
    assert cache.invalidate("prefill-0") is True  # every rank
    assert cached_ranks(cache) == set()


def test_cache_refuses_an_answer_from_another_rank(cache: HandshakeCache) -> None:
    wrong = response(topology=topology(tp_size=2, tp_rank=0))
    with pytest.raises(HandshakeRejected, match="engine prefill-0 answered as TP rank 0, expected 1"):
        cache.get_or_handshake("prefill-0", lambda: wrong, tp_rank=1)
    assert cached_ranks(cache) == set()


def test_cache_keeps_nothing_when_the_handshake_fails(cache: HandshakeCache) -> None:
    def refused() -> HandshakeResponse:
        raise HandshakeRejected("version", ["protocol version 9, expected 1"])

    with pytest.raises(HandshakeRejected):
        cache.get_or_handshake("prefill-0", refused)
    assert cached_ranks(cache) == set()
    with pytest.raises(HandshakeRejected, match="answered as engine 'prefill-9'"):
        cache.get_or_handshake("prefill-0", lambda: response(engine_id="prefill-9"))
    assert cached_ranks(cache) == set()


def test_cache_is_consistent_under_threads(cache: HandshakeCache) -> None:
    engine_ids = [f"prefill-{i}" for i in range(8)]
    start = threading.Barrier(8)

    wrong_answers: list[tuple[str, str]] = []

    def worker(index: int) -> None:
        start.wait()
        for round_ in range(200):
            engine_id = engine_ids[(index + round_) % len(engine_ids)]
            got = cache.get_or_handshake(engine_id, lambda e=engine_id: response(engine_id=e))
            if got.engine_id != engine_id:
                wrong_answers.append((engine_id, got.engine_id))
            if round_ % 7 == 0:
                cache.invalidate(engine_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong_answers == []
    for engine_id in engine_ids:
        assert cache.get_or_handshake(engine_id, lambda e=engine_id: response(engine_id=e)).engine_id == engine_id
    assert cached_ranks(cache) == {(engine_id, 0) for engine_id in engine_ids}


def test_a_response_carries_the_transports_and_node_of_its_rank() -> None:
    sent = response(transports=("cuda-ipc", "nixl"), node="boot-1/4026531840")
    got = decode_response(encode_response(sent), topology())
    assert (got.transports, got.node) == (("cuda-ipc", "nixl"), "boot-1/4026531840")


def test_an_empty_offer_of_transports_is_malformed(monkeypatch) -> None:
    real_encode = handshake._encode

    def bad(version, hash_hex, payload):
        return real_encode(version, hash_hex, payload | {"transports": []})

    monkeypatch.setattr(handshake, "_encode", bad)
    with pytest.raises(HandshakeRejected, match="transports must be a non-empty list"):
        decode_response(encode_response(response()), topology())
