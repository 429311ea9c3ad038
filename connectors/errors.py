"""The connectors package's exception tree: every error it raises on purpose is a ConnectorError.

``TopologyError`` and ``BlockMappingError`` are also ``ValueError``s: each means
that what was handed in (a topology, a list of block ids) cannot be used as given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

_T = TypeVar("_T")


class ConnectorError(Exception):
    """Base of every error the connectors package raises on purpose."""


def registered(value: _T | None, engine_id: str) -> _T:
    """``value``, set once the engine's KV caches are registered; ``ConnectorError`` before."""
    if value is None:
        raise ConnectorError(f"engine {engine_id}: register_kv_caches has not run")
    return value


class TopologyError(ConnectorError, ValueError):
    """A KV topology is unusable, alone or together with its peer's."""


class InvalidTopology(TopologyError):
    """One side's KV topology is inconsistent in itself (e.g. heads not divisible by TP)."""


class TopologyMismatch(TopologyError):
    """Two KV topologies cannot exchange KV blocks; ``reasons`` lists every cause."""

    def __init__(self, reasons: Sequence[str]):
        self.reasons = tuple(reasons)
        super().__init__("cannot exchange KV between these topologies: " + "; ".join(self.reasons))

    def __reduce__(self):  # keeps ``reasons`` when pickled across processes
        return (type(self), (self.reasons,))


class BlockMappingError(ConnectorError, ValueError):
    """Local and remote block id lists do not describe the same tokens."""


class TransportError(ConnectorError):
    """The KV transport cannot move blocks: NIXL is missing, a peer is unknown, or a transfer failed or timed out."""


class HandshakeRejected(ConnectorError):
    """A side-channel handshake message was refused; ``kind`` labels why for metrics.

    ``kind`` is one of ``HANDSHAKE_REJECTION_KINDS``: ``"version"`` (another
    protocol version), ``"incompatible"`` (the peers' KV caches cannot pair) or
    ``"malformed"`` (not a well-formed handshake message). ``reasons`` lists every cause.
    """

    def __init__(self, kind: str, reasons: Sequence[str]):
        if kind not in HANDSHAKE_REJECTION_KINDS:
            raise ValueError(f"unknown handshake rejection kind {kind!r}; expected one of {HANDSHAKE_REJECTION_KINDS}")
        self.kind = kind
        self.reasons = list(reasons)
        super().__init__(f"handshake rejected ({kind}): " + "; ".join(self.reasons))

    def __reduce__(self):  # keeps ``kind`` and ``reasons`` when pickled across processes
        return (type(self), (self.kind, self.reasons))


HANDSHAKE_REJECTION_KINDS = ("version", "incompatible", "malformed")


class LeaseError(ConnectorError, ValueError):
    """A KV block lease cannot be taken as asked: the request already holds one, or a count or TTL is out of range."""
