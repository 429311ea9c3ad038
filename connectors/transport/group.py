"""The KV transports of one worker (one TP rank), by name: registered together, offered together, polled together.

A worker builds the transports its settings name (``connectors.transport.make_transport``)
and registers its caches with each. A transport that cannot serve these
caches stands aside with a log line -- CUDA IPC on CPU caches, NIXL where it
is not installed -- as long as one remains. The handshake offers the rest
(``names``, ``payloads``); the reader adds each peer to the transport it
chose (``get``); the prefill side polls every transport's notifications.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from connectors.block_ranges import KVRegions
from connectors.errors import TransportError
from connectors.transport import make_transport
from connectors.transport.base import KVTransport

if TYPE_CHECKING:
    import torch

__all__ = ["TransportFactory", "WorkerTransports"]

TransportFactory = Callable[[str, str, float], KVTransport]
"""``factory(name, engine_id, transfer_timeout_s)``: ``connectors.transport.make_transport``, or a test's own."""

logger = logging.getLogger(__name__)


class WorkerTransports:
    """The transports named in ``names`` (best first) for ``engine_id``'s caches."""

    def __init__(
        self,
        engine_id: str,
        names: Sequence[str],
        transfer_timeout_s: float = 30.0,
        factory: TransportFactory = make_transport,
    ) -> None:
        if not names:
            raise TransportError(f"engine {engine_id}: no KV transport named")
        self.engine_id = engine_id
        self._wanted = tuple(names)
        self._timeout_s = transfer_timeout_s
        self._factory = factory
        self._transports: dict[str, KVTransport] = {}
        self._regions: KVRegions | None = None

    def register_kv_caches(
        self, caches: Mapping[str, torch.Tensor], block_len_bytes: int, *, planes_per_layer: int
    ) -> KVRegions:
        """Register ``caches`` with every transport that can serve them; ``TransportError`` when none can."""
        reasons = []
        for name in self._wanted:
            try:
                transport = self._factory(name, self.engine_id, self._timeout_s)
                regions = transport.register_kv_caches(caches, block_len_bytes, planes_per_layer=planes_per_layer)
            except TransportError as e:
                reasons.append(f"{name}: {e}")
                continue
            self._transports[name] = transport
            self._regions = self._regions or regions
        if not self._transports:
            raise TransportError(f"engine {self.engine_id}: no KV transport can serve its caches: {'; '.join(reasons)}")
        for reason in reasons:
            logger.info("engine %s: KV transport %s", self.engine_id, reason)
        return self._regions

    @property
    def names(self) -> tuple[str, ...]:
        """The transports serving, best first."""
        return tuple(self._transports)

    def payloads(self) -> dict[str, bytes]:
        return {name: transport.handshake_payload() for name, transport in self._transports.items()}

    def get(self, name: str) -> KVTransport:
        try:
            return self._transports[name]
        except KeyError:
            raise TransportError(f"engine {self.engine_id}: transport {name} is not serving here") from None

    def kv_regions(self) -> KVRegions:
        if self._regions is None:
            raise TransportError(f"engine {self.engine_id}: no KV caches registered yet")
        return self._regions

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        return [note for transport in self._transports.values() for note in transport.poll_notifications()]

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
