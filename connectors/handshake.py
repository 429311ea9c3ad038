"""Wire format of the side-channel handshake between a decode and a prefill connector.

Before a decode engine's connector reads KV from a prefill engine, it sends a
``HandshakeRequest`` (its engine id and ``KVTopology``); the prefill side
answers with a ``HandshakeResponse`` (its topology, each transport's payload,
NIXL's agent metadata among them, and where its KV caches live). This module only turns those messages into bytes
and back; the socket that carries them lives elsewhere.

Every message is a fixed header followed by a payload::

    magic b"PDKV" | protocol version (uint16) | compatibility hash (32 raw bytes) | codec (uint8) | payload

Like vLLM's NIXL handshake, the receiver checks the header before it decodes
the payload: size cap, magic, version (``HandshakeRejected`` kind
``"version"``), compatibility hash (kind ``"incompatible"``), and only then
the payload, followed by the pairwise rules of ``check_compatible`` (TP sizes,
block sizes). Anything that is not a well-formed message is kind
``"malformed"``; no input makes a decoder raise anything else.

The payload is msgpack (msgspec, which vLLM ships); the codec byte leaves room
for another encoding in a later protocol version.
``HandshakeCache`` keeps accepted responses so a decode engine handshakes once per remote rank.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from connectors.errors import HandshakeRejected, TopologyError, TopologyMismatch
from connectors.topology import KVTopology, check_compatible, compatibility_hash, incompatibilities
from connectors.transport import TRANSPORTS

__all__ = [
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "HandshakeCache",
    "HandshakeRequest",
    "HandshakeResponse",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
]

MAGIC = b"PDKV"
# Bump when the header or payload fields change; peers on another version are refused before decoding.
# 2: NIXL's agent metadata travels in ``payloads`` like every transport's; msgpack only.
PROTOCOL_VERSION = 2
# A response carries per-layer addresses and NIXL metadata: kilobytes. The cap
# keeps a garbage length or a hostile peer from making us decode gigabytes.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_PREFIX = struct.Struct(">4sH")  # enough to check magic and version on a truncated message
_HEADER = struct.Struct(">4sH32sB")
_HASH_PATTERN = re.compile(r"[0-9a-f]{64}")
_TOPOLOGY_FIELDS = tuple(f.name for f in dataclasses.fields(KVTopology))
_TOPOLOGY_TEXT = ("layout", "dtype", "model_identity")
_MAX_ADDRESS = 2**64


MSGPACK = 1
"""The header's codec byte: the payload is msgpack."""


def _checked_hash(value: str, topology: KVTopology) -> str:
    if not value:
        return compatibility_hash(topology)
    if not isinstance(value, str) or not _HASH_PATTERN.fullmatch(value):
        raise ValueError(f"compatibility_hash must be 64 lowercase hex digits, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeRequest:
    """Decode -> prefill: who asks, and the KV topology it reads into.

    ``compatibility_hash`` defaults to ``compatibility_hash(topology)``.
    """

    engine_id: str
    topology: KVTopology
    compatibility_hash: str = ""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "compatibility_hash", _checked_hash(self.compatibility_hash, self.topology))


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeResponse:
    """Prefill -> decode: the source's topology and what the transport needs to read its blocks.

    ``kv_caches_base_addr`` holds one base address per registered KV cache
    region (layer-major), ``block_len`` the bytes of one block in a region.
    """

    engine_id: str
    topology: KVTopology
    kv_caches_base_addr: tuple[int, ...]
    block_len: int
    num_blocks: int
    transports: tuple[str, ...] = ("nixl",)
    """The transports this rank can serve reads over (``connectors.transport``)."""
    payloads: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    """What a reader needs per transport (NIXL: the agent's metadata)."""
    epoch: str = ""
    """This start of the engine (``connectors.identity.engine_epoch``): a reader's mapping belongs to one start."""
    node: str = ""
    """This rank's node (``connectors.transport.node_identity``): a reader on the same node may take a
    node-local transport."""
    compatibility_hash: str = ""
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "compatibility_hash", _checked_hash(self.compatibility_hash, self.topology))
        object.__setattr__(self, "kv_caches_base_addr", tuple(self.kv_caches_base_addr))
        object.__setattr__(self, "transports", tuple(self.transports))
        object.__setattr__(self, "payloads", dict(self.payloads))

    def payload_for(self, transport: str) -> bytes:
        """The source's handshake payload for ``transport`` (empty if it sent none)."""
        return self.payloads.get(transport, b"")


# ---------------------------------------------------------------- encoding


def encode_request(request: HandshakeRequest) -> bytes:
    """``request`` as header + payload bytes."""
    payload = {"engine_id": request.engine_id, "topology": _topology_to_wire(request.topology)}
    return _encode(request.protocol_version, request.compatibility_hash, payload)


def encode_response(response: HandshakeResponse) -> bytes:
    """``response`` as header + payload bytes."""
    payload = {
        "engine_id": response.engine_id,
        "topology": _topology_to_wire(response.topology),
        "kv_caches_base_addr": list(response.kv_caches_base_addr),
        "block_len": response.block_len,
        "num_blocks": response.num_blocks,
        "transports": list(response.transports),
        "payloads": {name: bytes(data) for name, data in response.payloads.items()},
        "node": response.node,
        "epoch": response.epoch,
    }
    return _encode(response.protocol_version, response.compatibility_hash, payload)


def _topology_to_wire(topology: KVTopology) -> dict[str, Any]:
    wire = {name: getattr(topology, name) for name in _TOPOLOGY_FIELDS}
    wire["layout"] = str(topology.layout)
    return wire


def _encode(version: int, hash_hex: str, payload: dict[str, Any]) -> bytes:
    message = _HEADER.pack(MAGIC, version, bytes.fromhex(hash_hex), MSGPACK) + msgspec.msgpack.encode(payload)
    if len(message) > MAX_MESSAGE_BYTES:
        raise ValueError(f"handshake message of {len(message)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    return message


# ---------------------------------------------------------------- decoding


def decode_request(data: bytes | bytearray | memoryview, local_topology: KVTopology) -> HandshakeRequest:
    """Check and decode a request received by the prefill side whose topology is ``local_topology``.

    The requester reads from us, so the pairwise rules run with the requester
    as reader: ``check_compatible(request.topology, local_topology)``.
    Raises ``HandshakeRejected`` for every kind of bad input.
    """
    hash_hex, codec, body = _check_header(data, "request")
    expected_hash = compatibility_hash(local_topology)
    if hash_hex != expected_hash:
        _reject_hash(hash_hex, expected_hash, body, codec, lambda remote: incompatibilities(remote, local_topology))
    payload = _decode_payload(body, codec)
    request = HandshakeRequest(
        engine_id=_str_field(payload, "engine_id"),
        topology=_topology_field(payload),
        compatibility_hash=hash_hex,
    )
    _check_pair(request.topology, hash_hex, reader=request.topology, source=local_topology)
    return request


def decode_response(data: bytes | bytearray | memoryview, local_topology: KVTopology) -> HandshakeResponse:
    """Check and decode a response received by the decode side whose topology is ``local_topology``.

    We read from the responder: ``check_compatible(local_topology, response.topology)``.
    Raises ``HandshakeRejected`` for every kind of bad input.
    """
    hash_hex, codec, body = _check_header(data, "response")
    expected_hash = compatibility_hash(local_topology)
    if hash_hex != expected_hash:
        _reject_hash(hash_hex, expected_hash, body, codec, lambda remote: incompatibilities(local_topology, remote))
    payload = _decode_payload(body, codec)
    addresses = payload.get("kv_caches_base_addr")
    if not isinstance(addresses, list) or not all(_is_int(a) and 0 <= a < _MAX_ADDRESS for a in addresses):
        raise _malformed("kv_caches_base_addr must be a list of unsigned 64-bit ints")
    response = HandshakeResponse(
        engine_id=_str_field(payload, "engine_id"),
        topology=_topology_field(payload),
        kv_caches_base_addr=tuple(addresses),
        block_len=_int_field(payload, "block_len", minimum=1),
        num_blocks=_int_field(payload, "num_blocks", minimum=1),
        transports=_transports_field(payload),
        payloads=_payloads_field(payload),
        node=str(payload.get("node") or ""),
        epoch=str(payload.get("epoch") or "")[:64],
        compatibility_hash=hash_hex,
    )
    _check_pair(response.topology, hash_hex, reader=local_topology, source=response.topology)
    return response


def _malformed(reason: str) -> HandshakeRejected:
    return HandshakeRejected("malformed", [f"malformed handshake message: {reason}"])


def _check_header(data: object, what: str) -> tuple[str, int, memoryview]:
    """Size, magic and version; returns the header's hash (hex), codec byte and the payload bytes."""
    try:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise _malformed(f"expected a bytes-like {what}, got {type(data).__name__}") from None
    if len(view) > MAX_MESSAGE_BYTES:
        raise _malformed(f"{what} of {len(view)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    if bytes(view[: len(MAGIC)]) != MAGIC[: len(view)]:
        raise _malformed(f"{what} does not start with magic {MAGIC!r}")
    if len(view) < _PREFIX.size:
        raise _malformed(f"{what} truncated at {len(view)} bytes, inside the header")
    _, version = _PREFIX.unpack_from(view)
    if version != PROTOCOL_VERSION:
        raise HandshakeRejected("version", [f"protocol version {version}, expected {PROTOCOL_VERSION}"])
    if len(view) < _HEADER.size:
        raise _malformed(f"{what} truncated at {len(view)} bytes, inside the {_HEADER.size}-byte header")
    _, _, raw_hash, codec = _HEADER.unpack_from(view)
    return raw_hash.hex(), codec, view[_HEADER.size :]


def _decode_payload(body: memoryview, codec: int) -> dict[str, Any]:
    """The payload as plain Python values; bad bytes become ``HandshakeRejected('malformed')``."""
    if codec != MSGPACK:
        raise _malformed(f"unknown payload codec {codec}")
    try:
        payload = msgspec.msgpack.decode(body)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise _malformed(f"payload does not decode as msgpack: {e}") from e
    if not isinstance(payload, dict):
        raise _malformed(f"payload is a {type(payload).__name__}, expected a map")
    return payload


def _reject_hash(
    remote_hash: str,
    local_hash: str,
    body: memoryview,
    codec: int,
    reasons_for: Callable[[KVTopology], list[str]],
) -> None:
    """Raise the ``"incompatible"`` rejection for a hash mismatch, naming the fields when the payload decodes."""
    reasons: list[str] = []
    try:
        reasons = reasons_for(_topology_field(_decode_payload(body, codec)))
    except HandshakeRejected:
        pass  # a peer on another compatibility schema may send a payload we cannot read
    if not reasons:
        reasons = [f"compatibility hash differs: local {local_hash[:16]}…, remote {remote_hash[:16]}…"]
    raise HandshakeRejected("incompatible", reasons)


def _check_pair(remote: KVTopology, header_hash: str, *, reader: KVTopology, source: KVTopology) -> None:
    if compatibility_hash(remote) != header_hash:
        raise _malformed("header compatibility hash does not match the payload's topology")
    try:
        check_compatible(reader, source)
    except TopologyMismatch as e:
        raise HandshakeRejected("incompatible", e.reasons) from e


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(payload: dict[str, Any], name: str, *, minimum: int) -> int:
    value = payload.get(name)
    if not _is_int(value) or value < minimum:
        raise _malformed(f"{name} must be an int >= {minimum}, got {value!r:.80}")
    return value


def _transports_field(payload: dict[str, Any]) -> tuple[str, ...]:
    """The offered transports."""
    offered = payload.get("transports")
    if not isinstance(offered, list) or not offered or not all(isinstance(name, str) for name in offered):
        raise _malformed("transports must be a non-empty list of names")
    return tuple(offered)


def _payloads_field(payload: dict[str, Any]) -> dict[str, bytes]:
    """Per-transport payloads: a map from known transport names to bytes."""
    value = payload.get("payloads")
    if (
        not isinstance(value, dict)
        or not all(name in TRANSPORTS for name in value)
        or not all(isinstance(data, bytes) for data in value.values())
    ):
        raise _malformed(f"payloads must be a map from transport names ({', '.join(TRANSPORTS)}) to bytes")
    return dict(value)


def _str_field(payload: dict[str, Any], name: str) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value:
        raise _malformed(f"{name} must be a non-empty string, got {value!r:.80}")
    return value


def _topology_field(payload: dict[str, Any]) -> KVTopology:
    wire = payload.get("topology")
    if not isinstance(wire, dict) or set(wire) != set(_TOPOLOGY_FIELDS):
        raise _malformed(f"topology must be a map with exactly the fields {', '.join(_TOPOLOGY_FIELDS)}")
    for name, value in wire.items():
        if name in _TOPOLOGY_TEXT and not isinstance(value, str):
            raise _malformed(f"topology.{name} must be a string, got {value!r:.80}")
        if name not in _TOPOLOGY_TEXT and not _is_int(value):
            raise _malformed(f"topology.{name} must be an int, got {value!r:.80}")
    try:
        return KVTopology(**wire)
    except TopologyError as e:
        raise _malformed(f"invalid topology: {e}") from e


# ---------------------------------------------------------------- cache


class HandshakeCache:
    """Accepted responses by (prefill engine id, TP rank), so the decode side handshakes once per remote rank.

    Thread-safe. ``get_or_handshake`` runs the handshake outside the lock, so
    handshakes to different peers do not wait on each other; two threads
    racing on one new peer may both handshake, and the later answer is kept.
    """

    def __init__(self) -> None:
        self._responses: dict[tuple[str, int], HandshakeResponse] = {}
        self._lock = threading.Lock()

    def get(self, engine_id: str, tp_rank: int = 0) -> HandshakeResponse | None:
        with self._lock:
            return self._responses.get((engine_id, tp_rank))

    def put(self, response: HandshakeResponse) -> None:
        with self._lock:
            self._responses[(response.engine_id, response.topology.tp_rank)] = response

    def invalidate(self, engine_id: str, tp_rank: int | None = None) -> bool:
        """Forget one rank of ``engine_id`` (every rank when None), after a failed transfer, say; True if cached."""
        with self._lock:
            keys = [key for key in self._responses if key[0] == engine_id and tp_rank in (None, key[1])]
            for key in keys:
                del self._responses[key]
        return bool(keys)

    def get_or_handshake(
        self, engine_id: str, handshake: Callable[[], HandshakeResponse], tp_rank: int = 0
    ) -> HandshakeResponse:
        """The cached response of ``engine_id``'s rank ``tp_rank``, or ``handshake()``'s, cached if from that rank.

        If ``handshake`` raises, the entry is dropped and the error propagates.
        """
        cached = self.get(engine_id, tp_rank)
        if cached is not None:
            return cached
        try:
            response = handshake()
            if response.engine_id != engine_id:
                reason = f"peer answered as engine {response.engine_id!r}, expected {engine_id!r}"
                raise HandshakeRejected("incompatible", [reason])
            if response.topology.tp_rank != tp_rank:
                reason = f"engine {engine_id} answered as TP rank {response.topology.tp_rank}, expected {tp_rank}"
                raise HandshakeRejected("incompatible", [reason])
        except Exception:
            self.invalidate(engine_id, tp_rank)
            raise
        self.put(response)
        return response
