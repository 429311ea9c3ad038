"""Byte runs of a direct READ: which bytes of a remote rank's block land where in a local block.

A local rank reads, from each remote rank its ``ReadPlan`` names, one head
slice of every layer of a request's blocks straight into its own KV cache: no
staging buffer, no copy after the read. Inside one layer's block both caches
hold *rows*, one per (K or V, head, token), each ``head_dim`` elements long
(MLA: one per token, its latent; kv and h are 0). Where a row lies is the
layout's business (``_row_positions``), with ``B`` tokens per block and ``H``
heads on the rank::

    H2ND  row (kv, h, t) at ((h * 2 + kv) * B + t) * row_bytes   (vLLM's CPU cache)
    HN2D  row (kv, h, t) at ((h * B + t) * 2 + kv) * row_bytes   (vLLM 0.32 on GPU, LBHNC)
    NH2D  row (kv, h, t) at ((t * H + h) * 2 + kv) * row_bytes   (vLLM 0.32 on GPU, LBNHC)
    MLA   row (0, 0, t) at t * row_bytes

With a remote block size ``Br`` smaller than the local ``Bl`` (``ratio = Bl / Br``),
the remote blocks of a group fill a local block in token order: the j-th fills
tokens [j*Br, (j+1)*Br), *sub-block* j.

``plan_plane_ranges`` lists the slice's rows in remote order and merges rows
that follow each other on both sides into *runs*: ``PlaneRanges``. The runs are
the same for every sub-block, only their local offsets move. What that gives
per remote block and layer, for a slice of n of the remote rank's heads:

- the same layout on both sides, all the remote rank's heads, ratio 1: one run
  per block -- whole blocks;
- H2ND or HN2D on both sides, ratio 1: one run -- a head slice is contiguous,
  K and V with it;
- ratio > 1, head-major layouts (H2ND, HN2D): one run per head (and K/V for
  H2ND), ``Br`` tokens long;
- the token-major layout (NH2D): whole blocks at any ratio with all the
  heads, one run per token with a partial head slice: the heads interleave;
- MLA: one run, its rows are tokens;
- layouts that order rows differently: down to one run per row (H2ND from
  HN2D: K and V alternate remotely and lie apart locally).

Descriptors follow from runs and a side's ``KVRegions``. The remote list has
one row per (layer, remote block, run), the local list one per (layer, local
block, sub-block, run); both are prepared once per peer, and ``read_indices``
picks, for one request, index arrays that line up element by element: one
batched READ moves every layer of every block. Nothing here imports NIXL or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from connectors.errors import BlockMappingError, TopologyMismatch
from connectors.topology import HeadSlice, KVLayout, KVTopology, block_size_ratio, plan_reads

__all__ = [
    "KVRegions",
    "checked_read_ids",
    "PlaneRanges",
    "local_descriptors",
    "plan_peer_ranges",
    "plan_plane_ranges",
    "read_indices",
    "remote_descriptors",
    "whole_plane_ranges",
]


@dataclass(frozen=True, slots=True)
class KVRegions:
    """Where an engine's registered KV caches lie, as a peer needs them to prepare reads.

    ``region_addrs`` holds one base address per (layer, plane) region, layer
    by layer (plane 0 first when a layer has two); each region is ``num_blocks``
    block planes of ``block_len_bytes``. Plain data: picklable, and cheap to
    send through a side channel.
    """

    layer_names: tuple[str, ...]
    region_addrs: tuple[int, ...]
    num_blocks: int
    block_len_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def planes_per_layer(self) -> int:
        """Regions per layer: 1 for every layout vLLM 0.32 hands over, 2 for caches registered as two planes."""
        return len(self.region_addrs) // max(1, len(self.layer_names))

    def descriptors(self) -> np.ndarray:
        """Nx3 ``(address, length, device)`` rows, one per whole block plane, region by region."""
        addrs = np.asarray(self.region_addrs, dtype=np.uint64)[:, None]
        offsets = np.arange(self.num_blocks, dtype=np.uint64)[None, :] * np.uint64(self.block_len_bytes)
        rows = np.empty((len(self.region_addrs) * self.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = (addrs + offsets).ravel()
        rows[:, 1] = self.block_len_bytes
        rows[:, 2] = self.device_id
        return rows


@dataclass(frozen=True, slots=True)
class PlaneRanges:
    """The runs one local rank reads from one remote rank, per remote block and layer.

    Run r copies ``lengths[r]`` bytes from plane ``remote_planes[r]`` of the
    remote block at ``remote_offsets[r]`` to plane ``local_planes[r]`` of the
    local block at ``local_offsets[j][r]`` when the remote block is sub-block j.
    Planes count within a layer; offsets within a block plane.
    """

    ratio: int
    remote_planes: tuple[int, ...]
    remote_offsets: tuple[int, ...]
    local_planes: tuple[int, ...]
    local_offsets: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]

    @property
    def num_runs(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_block(self) -> int:
        """Bytes read per remote block and layer."""
        return sum(self.lengths)

    def local_key(self) -> tuple[object, ...]:
        """What decides the local descriptor list: peers with equal keys can share one."""
        return (self.ratio, self.local_planes, self.local_offsets, self.lengths)


def _row_positions(
    topology: KVTopology, kv: np.ndarray, head: np.ndarray, token: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Plane (within the layer) and byte offset (within the block plane) of rows (kv, head, token)."""
    row_bytes = topology.head_dim * topology.element_size
    blocks, heads = topology.block_size, topology.num_heads
    one_plane = np.zeros_like(kv)
    match topology.layout:
        case KVLayout.H2ND:
            return one_plane, ((head * 2 + kv) * blocks + token) * row_bytes
        case KVLayout.HN2D:
            return one_plane, ((head * blocks + token) * 2 + kv) * row_bytes
        case KVLayout.NH2D:
            return one_plane, ((token * heads + head) * 2 + kv) * row_bytes
        case KVLayout.MLA:
            return one_plane, token * row_bytes


def plan_plane_ranges(local: KVTopology, remote: KVTopology, head_slice: HeadSlice) -> PlaneRanges:
    """The runs that move ``head_slice`` of a remote block into its local block, for every sub-block.

    Raises ``TopologyMismatch`` when the block sizes do not pair.
    """
    ratio = block_size_ratio(local.block_size, remote.block_size)
    kv, head, token = (
        axis.ravel()
        for axis in np.meshgrid(
            np.arange(remote.kv_components),
            np.arange(head_slice.num_heads),
            np.arange(remote.block_size),
            indexing="ij",
        )
    )
    remote_plane, remote_offset = _row_positions(remote, kv, head_slice.remote_head_start + head, token)
    order = np.lexsort((remote_offset, remote_plane))
    kv, head, token = kv[order], head[order], token[order]
    remote_plane, remote_offset = remote_plane[order], remote_offset[order]
    local_head = head_slice.local_head_start + head
    local_plane = _row_positions(local, kv, local_head, token)[0]
    local_offset = np.stack(
        [_row_positions(local, kv, local_head, token + j * remote.block_size)[1] for j in range(ratio)]
    )  # [sub-block, row]
    row_bytes = remote.head_dim * remote.element_size
    # A run ends where the next row does not follow on the remote side or, for any sub-block, on the local side.
    breaks = (
        (np.diff(remote_plane) != 0)
        | (np.diff(remote_offset) != row_bytes)
        | (np.diff(local_plane) != 0)
        | (np.diff(local_offset, axis=1) != row_bytes).any(axis=0)
    )
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    ends = np.append(starts[1:], len(kv))
    return PlaneRanges(
        ratio=ratio,
        remote_planes=tuple(remote_plane[starts].tolist()),
        remote_offsets=tuple(remote_offset[starts].tolist()),
        local_planes=tuple(local_plane[starts].tolist()),
        local_offsets=tuple(tuple(row.tolist()) for row in local_offset[:, starts]),
        lengths=tuple(((ends - starts) * row_bytes).tolist()),
    )


def plan_peer_ranges(local: KVTopology, remote: KVTopology) -> PlaneRanges:
    """The runs ``local`` reads from remote rank ``remote.tp_rank`` (the topology its handshake answered).

    Raises ``TopologyMismatch`` when the pair is incompatible or ``local``'s plan does not read that rank.
    """
    for head_slice in plan_reads(local, remote).slices:
        if head_slice.remote_rank == remote.tp_rank:
            return plan_plane_ranges(local, remote, head_slice)
    raise TopologyMismatch([f"local rank {local.tp_rank} reads nothing from remote rank {remote.tp_rank}"])


def whole_plane_ranges(planes_per_layer: int, block_len_bytes: int) -> PlaneRanges:
    """Every plane of a block 1:1 into the same plane of a local block: peers with equal caches."""
    planes = tuple(range(planes_per_layer))
    return PlaneRanges(
        ratio=1,
        remote_planes=planes,
        remote_offsets=(0,) * planes_per_layer,
        local_planes=planes,
        local_offsets=((0,) * planes_per_layer,),
        lengths=(block_len_bytes,) * planes_per_layer,
    )


# ---------------------------------------------------------------- descriptors


def _plane_bases(regions: KVRegions, planes: tuple[int, ...]) -> np.ndarray:
    """``[layer, run]`` base address of the region holding each run's plane."""
    bases = np.asarray(regions.region_addrs, dtype=np.uint64).reshape(regions.num_layers, regions.planes_per_layer)
    return bases[:, list(planes)]


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    """Nx3 ``(address, length, device)``; ``lengths`` broadcasts against ``addresses``' last axis."""
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0] = addresses.ravel()
    rows[:, 1] = np.broadcast_to(lengths, addresses.shape).ravel()
    rows[:, 2] = device_id
    return rows


def remote_descriptors(ranges: PlaneRanges, regions: KVRegions) -> np.ndarray:
    """One row per (layer, remote block, run); index ``(layer * num_blocks + block) * num_runs + run``."""
    blocks = np.arange(regions.num_blocks, dtype=np.uint64) * np.uint64(regions.block_len_bytes)
    offsets = np.asarray(ranges.remote_offsets, dtype=np.uint64)
    addresses = _plane_bases(regions, ranges.remote_planes)[:, None, :] + blocks[None, :, None] + offsets
    return _rows(addresses, np.asarray(ranges.lengths, dtype=np.uint64), regions.device_id)


def local_descriptors(ranges: PlaneRanges, regions: KVRegions) -> np.ndarray:
    """One row per (layer, local block, sub-block j, run).

    Index ``((layer * num_blocks + block) * ratio + j) * num_runs + run``.
    """
    blocks = np.arange(regions.num_blocks, dtype=np.uint64) * np.uint64(regions.block_len_bytes)
    offsets = np.asarray(ranges.local_offsets, dtype=np.uint64)  # [sub-block, run]
    bases = _plane_bases(regions, ranges.local_planes)  # [layer, run]
    addresses = bases[:, None, None, :] + blocks[None, :, None, None] + offsets[None, None, :, :]
    return _rows(addresses, np.asarray(ranges.lengths, dtype=np.uint64), regions.device_id)


def read_indices(
    ranges: PlaneRanges,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    *,
    num_layers: int,
    local_num_blocks: int,
    remote_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(local, remote)`` descriptor indices of one READ, element by element.

    Remote block q fills sub-block ``q % ratio`` of local block ``q // ratio``.

    Raises ``BlockMappingError`` when the id lists do not pair at the ratio or an id is out of range.
    """
    ratio = ranges.ratio
    local_ids, remote_ids = checked_read_ids(ratio, local_block_ids, remote_block_ids, local_num_blocks,
                                             remote_num_blocks)  # fmt: skip
    position = np.arange(len(remote_ids), dtype=np.int64)
    layer = np.arange(num_layers, dtype=np.int64)[:, None, None]
    run = np.arange(ranges.num_runs, dtype=np.int64)[None, None, :]
    remote = (layer * remote_num_blocks + remote_ids[None, :, None]) * ranges.num_runs + run
    local_block = local_ids[position // ratio][None, :, None]
    local = ((layer * local_num_blocks + local_block) * ratio + (position % ratio)[None, :, None]) * ranges.num_runs
    local = local + run
    return _as_index(local.ravel()), _as_index(remote.ravel())


def checked_read_ids(
    ratio: int,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    local_num_blocks: int,
    remote_num_blocks: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A read's ``(local, remote)`` block ids as int64 arrays, each in its cache, and as many local ids as
    the remote ones fill at ``ratio``; ``BlockMappingError`` otherwise. Every transport checks a read so."""
    local_ids = _checked_ids(local_block_ids, local_num_blocks, "local")
    remote_ids = _checked_ids(remote_block_ids, remote_num_blocks, "remote")
    needed = -(-len(remote_ids) // ratio)
    if len(local_ids) != needed:
        detail = f" (at block size ratio {ratio} they fill {needed})" if ratio > 1 else ""
        raise BlockMappingError(f"{len(local_ids)} local block ids for {len(remote_ids)} remote block ids{detail}")
    return local_ids, remote_ids


def _checked_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> np.ndarray:
    if isinstance(block_ids, list) and block_ids:  # vLLM's lists: Python's min and max are the quicker here
        low, high = min(block_ids), max(block_ids)
        ids = np.array(block_ids, dtype=np.int64)
    else:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if ids.size and (low < 0 or high >= num_blocks):
        raise BlockMappingError(f"{side} block ids must lie in [0, {num_blocks}), got {low}..{high}")
    return ids


def _as_index(indices: np.ndarray) -> np.ndarray:
    # NIXL takes int32 indices; a list that large could not have been prepared anyway.
    if indices.size and indices.max() >= 2**31:
        raise BlockMappingError(f"descriptor index {indices.max()} does not fit NIXL's int32 indices")
    return indices.astype(np.int32)
