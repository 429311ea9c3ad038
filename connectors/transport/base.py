"""The protocol every KV transport implements, and the state of one transfer.

A transport belongs to one worker (one TP rank). Both sides register their
caches (``register_kv_caches``: regions of block planes, ``KVRegions``); the
source hands a reader its ``handshake_payload()`` and regions over the side
channel; the reader ``add_peer``s it, then ``read_blocks`` moves runs of
blocks from the peer's cache into its own and returns a ``Transfer`` to poll.
When a read completes the source sees ``notify`` in ``poll_notifications``
(and frees the blocks). Every transfer ends DONE or FAILED, never pending for
ever: a transport fails a transfer still pending at its deadline. FAILED is
the reader's verdict, not the wire's: an aborted read may still be moving
bytes, so a transfer also says when it is ``drained`` (no byte of it can land
any more), and only then may the blocks it writes go back to vLLM.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from connectors.block_ranges import KVRegions, PlaneRanges, whole_plane_ranges
from connectors.errors import TransportError

if TYPE_CHECKING:
    import torch

__all__ = ["KVTransport", "ReadState", "Transfer", "TransferState", "cache_regions", "checked_ranges"]

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@runtime_checkable
class Transfer(Protocol):
    """One posted read: poll it until DONE or FAILED; ``abort`` fails it now, ``drained`` says when it is over on
    the wire too."""

    peer: str
    num_bytes: int

    @property
    def drained(self) -> bool:
        """Whether no byte of this read can land any more (a FAILED read may still be moving: poll it)."""
        ...

    @property
    def state(self) -> TransferState: ...

    @property
    def failure_reason(self) -> str | None: ...

    @property
    def elapsed_s(self) -> float: ...

    def poll(self) -> TransferState: ...

    def abort(self, reason: str = "aborted") -> None: ...


class ReadState:
    """What every transport's read keeps: whom it reads, how much, its state and why it failed, its times.

    A transport's read adds ``poll``, ``abort`` and ``wait`` and ends itself with ``_finish``.
    """

    def __init__(self, peer: str, num_bytes: int, deadline: float, started_at: float | None = None) -> None:
        self.peer = peer
        self.num_bytes = num_bytes
        self.deadline = deadline
        self.started_at = time.monotonic() if started_at is None else started_at
        self.finished_at: float | None = None
        self._state = TransferState.PENDING
        self._reason: str | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def failure_reason(self) -> str | None:
        return self._reason

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    def _finish(self, state: TransferState, reason: str | None) -> None:
        self._state, self._reason = state, reason
        self.finished_at = time.monotonic()
        if state is TransferState.FAILED:
            logger.warning("KV read from peer %s failed: %s", self.peer, reason)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(peer={self.peer!r}, bytes={self.num_bytes}, state={self._state.name})"


@runtime_checkable
class KVTransport(Protocol):
    """Moves KV blocks between the caches of two workers."""

    name: str
    notifies_source: bool
    """Whether a finished read tells the source itself (``poll_notifications`` there); when not, the reader
    sends the READ notification over the side channel."""

    def register_kv_caches(
        self, caches: Mapping[str, torch.Tensor], block_len_bytes: int, *, planes_per_layer: int
    ) -> KVRegions: ...

    def kv_regions(self) -> KVRegions: ...

    def handshake_payload(self) -> bytes:
        """What a reader needs to reach this transport (opaque to everything above the seam)."""
        ...

    def cannot_read(self, payload: bytes) -> str | None:
        """Why this transport cannot read from the source whose ``handshake_payload()`` this is (None: it can)."""
        ...

    def add_peer(self, peer: str, payload: bytes, regions: KVRegions, ranges: PlaneRanges | None = None) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

    def read_blocks(
        self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], notify: bytes = b""
    ) -> Transfer: ...

    def poll_notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- helpers every transport uses


def cache_regions(
    caches: Mapping[str, torch.Tensor], block_len_bytes: int, planes_per_layer: int | None, owner: str
) -> KVRegions:
    """The block-plane regions of ``caches`` (one tensor per layer), checked to be cut by address.

    A cache is ``[num_blocks, ...]`` (one plane per block: every layout vLLM
    0.32 hands over) or ``[2, num_blocks, ...]`` (two planes per block), dense
    in memory, on CPU or one CUDA device; every layer has the same shape.
    ``planes_per_layer`` (1 or 2) says which; by default a leading dim of 2
    means two planes. ``TransportError`` naming the layer otherwise.
    """
    if not caches or block_len_bytes <= 0:
        raise TransportError(f"engine {owner}: need >= 1 cache and block_len_bytes > 0")
    region_addrs: list[int] = []
    first = next(iter(caches.values()))
    for name, cache in caches.items():
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise TransportError(f"layer {name}: cache {tuple(cache.shape)} differs from the first layer's")
        if not _is_dense(cache):
            raise TransportError(f"layer {name}: cache must be dense in memory (a permuted contiguous tensor)")
        num_regions = planes_per_layer or (2 if cache.dim() >= 2 and cache.shape[0] == 2 else 1)
        if num_regions not in (1, 2):
            raise TransportError(f"planes_per_layer must be 1 or 2, got {planes_per_layer}")
        num_blocks = cache.shape[1] if num_regions == 2 else cache.shape[0]
        if cache.numel() * cache.element_size() != num_regions * num_blocks * block_len_bytes:
            raise TransportError(
                f"layer {name}: {num_regions} x {num_blocks} blocks of {block_len_bytes} bytes "
                f"do not make up its cache of {tuple(cache.shape)} {cache.dtype}"
            )
        # Regions and blocks are cut by address: the plane and block dims must be outermost in memory.
        block_dim = 1 if num_regions == 2 else 0
        outer = ((0, num_blocks * block_len_bytes),) if num_regions == 2 else ()
        for dim, stride_bytes in (*outer, (block_dim, block_len_bytes)):
            if cache.shape[dim] > 1 and cache.stride(dim) * cache.element_size() != stride_bytes:
                raise TransportError(
                    f"layer {name}: dim {dim} of its cache {tuple(cache.shape)} is not outermost in memory "
                    f"(stride {cache.stride(dim)} elements)"
                )
        region_bytes = num_blocks * block_len_bytes
        region_addrs += [cache.data_ptr() + i * region_bytes for i in range(num_regions)]
    return KVRegions(
        layer_names=tuple(caches),
        region_addrs=tuple(region_addrs),
        num_blocks=num_blocks,
        block_len_bytes=block_len_bytes,
        mem_type="VRAM" if first.device.type == "cuda" else "DRAM",
        device_id=first.device.index or 0,
    )


def checked_ranges(peer: str, local: KVRegions, regions: KVRegions, ranges: PlaneRanges | None) -> PlaneRanges:
    """``ranges`` (or, without, whole planes 1:1 between equal caches), refused with ``TransportError`` if a run
    would leave either side's block planes."""
    if ranges is None:
        problems = [
            f"{name} differs: local {getattr(local, name)}, remote {getattr(regions, name)}"
            for name in ("layer_names", "block_len_bytes")
            if getattr(local, name) != getattr(regions, name)
        ]
        if len(local.region_addrs) != len(regions.region_addrs):
            problems.append(f"{len(regions.region_addrs)} remote regions, {len(local.region_addrs)} local")
        if problems:
            raise TransportError(f"cannot read KV from peer {peer}: " + "; ".join(problems))
        ranges = whole_plane_ranges(local.planes_per_layer, local.block_len_bytes)
    problems = []
    if regions.num_layers != local.num_layers or len(regions.region_addrs) % max(1, regions.num_layers):
        problems.append(f"{len(regions.region_addrs)} remote regions for {local.num_layers} local layers")
    if ranges.num_runs == 0:
        problems.append("no runs to read")
    else:
        lengths = np.asarray(ranges.lengths)
        remote_end = int((np.asarray(ranges.remote_offsets) + lengths).max())
        local_end = int((np.asarray(ranges.local_offsets) + lengths).max())
        if remote_end > regions.block_len_bytes or max(ranges.remote_planes) >= regions.planes_per_layer:
            problems.append(f"runs leave the remote block plane of {regions.block_len_bytes} bytes")
        if local_end > local.block_len_bytes or max(ranges.local_planes) >= local.planes_per_layer:
            problems.append(f"runs leave the local block plane of {local.block_len_bytes} bytes")
    if problems:
        raise TransportError(f"cannot read KV from peer {peer}: " + "; ".join(problems))
    return ranges


def _is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers exactly ``numel`` elements from its data pointer: contiguous in some dim order.

    vLLM hands GPU caches as permuted views of contiguous memory (an NH2D cache seen as
    ``[num_blocks, heads, block_size, 2 * head_dim]``).
    """
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape, strict=True) if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
