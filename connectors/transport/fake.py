"""``InMemoryTransport``: the transport protocol within one process, by plain memory copies.

For unit tests of everything above the seam (the worker, the block-run
arithmetic of ``connectors.block_ranges``) without NIXL: it builds the same
descriptor lists as the NIXL transport (``remote_descriptors``,
``local_descriptors``, ``read_indices``) and copies each run with
``ctypes.memmove``, so a read moves exactly the bytes a NIXL READ would.
Peers find each other by the name in their handshake payload, in this
process only. Reads complete when posted; ``fail_next`` makes the next one
fail (fault injection); CPU tensors only.
"""

from __future__ import annotations

import ctypes
import itertools
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from connectors.block_ranges import (
    KVRegions,
    PlaneRanges,
    local_descriptors,
    read_indices,
    remote_descriptors,
)
from connectors.errors import TransportError
from connectors.transport.base import TransferState, cache_regions, checked_ranges

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["InMemoryTransfer", "InMemoryTransport"]

_LIVE: weakref.WeakValueDictionary[str, InMemoryTransport] = weakref.WeakValueDictionary()
_NAMES = itertools.count()


@dataclass
class InMemoryTransfer:
    peer: str
    num_bytes: int
    state: TransferState = TransferState.PENDING
    failure_reason: str | None = None
    elapsed_s: float = 0.0

    @property
    def drained(self) -> bool:
        return self.state is not TransferState.PENDING  # a read lands when posted, or never

    def poll(self) -> TransferState:
        return self.state

    def abort(self, reason: str = "aborted") -> None:
        if self.state is TransferState.PENDING:
            self.state, self.failure_reason = TransferState.FAILED, reason


@dataclass
class _Peer:
    source: str
    regions: KVRegions
    ranges: PlaneRanges
    remote_rows: np.ndarray
    local_rows: np.ndarray


@dataclass
class InMemoryTransport:
    engine_id: str
    name: str = "in-memory"
    notifies_source = True
    fail_next: str | None = None
    """A reason: the next read fails with it (then this goes back to None)."""
    _agent: str = field(default="", init=False)
    _regions: KVRegions | None = field(default=None, init=False)
    _caches: list = field(default_factory=list, init=False)
    _peers: dict[str, _Peer] = field(default_factory=dict, init=False)
    _notifications: list[tuple[str, bytes]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._agent = f"{self.engine_id}-mem-{next(_NAMES)}"
        _LIVE[self._agent] = self

    def register_kv_caches(
        self, caches: Mapping[str, torch.Tensor], block_len_bytes: int, *, planes_per_layer: int | None = None
    ) -> KVRegions:
        if self._regions is not None:
            raise TransportError(f"engine {self.engine_id}: KV caches are already registered")
        if any(cache.device.type != "cpu" for cache in caches.values()):
            raise TransportError("the in-memory transport copies CPU tensors only")
        self._regions = cache_regions(caches, block_len_bytes, planes_per_layer, self.engine_id)
        self._caches = list(caches.values())  # keeps the memory alive while peers read it
        return self._regions

    def kv_regions(self) -> KVRegions:
        if self._regions is None:
            raise TransportError(f"engine {self.engine_id}: no KV caches registered yet")
        return self._regions

    def handshake_payload(self) -> bytes:
        return self._agent.encode()

    def cannot_read(self, payload: bytes) -> str | None:
        source = payload.decode(errors="replace")
        return None if source in _LIVE else f"no in-memory transport {source!r} in this process"

    def add_peer(self, peer: str, payload: bytes, regions: KVRegions, ranges: PlaneRanges | None = None) -> str:
        local = self.kv_regions()
        if peer in self._peers:
            raise TransportError(f"peer {peer} is already added")
        source = payload.decode()
        if source not in _LIVE:
            raise TransportError(f"peer {peer}: no in-memory transport {source!r} in this process")
        ranges = checked_ranges(peer, local, regions, ranges)
        self._peers[peer] = _Peer(
            source, regions, ranges, remote_descriptors(ranges, regions), local_descriptors(ranges, local)
        )
        return source

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def read_blocks(
        self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], notify: bytes = b""
    ) -> InMemoryTransfer:
        local = self.kv_regions()
        entry = self._peers.get(peer)
        if entry is None:
            raise TransportError(f"engine {self.engine_id}: unknown peer {peer}; call add_peer first")
        local_idx, remote_idx = read_indices(
            entry.ranges,
            local_block_ids,
            remote_block_ids,
            num_layers=local.num_layers,
            local_num_blocks=local.num_blocks,
            remote_num_blocks=entry.regions.num_blocks,
        )
        num_bytes = len(remote_block_ids) * local.num_layers * entry.ranges.bytes_per_block
        transfer = InMemoryTransfer(peer, num_bytes)
        source = _LIVE.get(entry.source)
        if self.fail_next is not None or source is None:
            transfer.abort(self.fail_next or f"peer {peer} is gone")
            self.fail_next = None
            return transfer
        started = time.perf_counter()
        for li, ri in zip(local_idx.tolist(), remote_idx.tolist(), strict=True):
            address, length, _ = entry.remote_rows[ri].tolist()
            ctypes.memmove(int(entry.local_rows[li][0]), address, length)
        transfer.state, transfer.elapsed_s = TransferState.DONE, time.perf_counter() - started
        if notify:
            source._notifications.append((self._agent, notify))
        return transfer

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        out, self._notifications = self._notifications, []
        return out

    def close(self) -> None:
        self._peers.clear()
        _LIVE.pop(self._agent, None)
