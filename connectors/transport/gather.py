"""How a read's bytes move on a GPU: a read as moves, a peer's run table, and the two gathers.

``plan_moves`` turns a read (a peer's ``PlaneRanges`` and the request's block
ids) into copies: source region and offset, destination region and offset,
length. ``run_table`` is the same arithmetic done once per peer, so a read
needs only its block ids; the Triton gather (``TritonGather``) computes each
run's addresses from it on the GPU and copies every run of every layer of a
read in one launch. ``copy_moves_torch`` is the stock fallback: one
``index_copy_`` per pair of regions. Nothing here maps memory: the regions'
addresses and views come from the transport (``connectors.transport.cuda_ipc``).
Torch and Triton are imported only where used: the arithmetic runs anywhere
(``tests/unit/connectors/test_cuda_ipc.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from connectors.block_ranges import KVRegions, PlaneRanges, checked_read_ids

if TYPE_CHECKING:
    import torch

__all__ = ["Moves", "RunTable", "TritonGather", "copy_moves_torch", "plan_moves", "run_table"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Moves:
    """A read as copies: run i copies ``lengths[i]`` bytes from ``src_offsets[i]`` of source region
    ``src_regions[i]`` to ``dst_offsets[i]`` of local region ``dst_regions[i]``. ``row_bytes`` divides every
    offset and length: the rows a gather may index."""

    src_regions: np.ndarray
    src_offsets: np.ndarray
    dst_regions: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    row_bytes: int

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())


def plan_moves(
    ranges: PlaneRanges,
    local: KVRegions,
    remote: KVRegions,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
) -> Moves:
    """The copies of one READ: every run of every layer of the blocks, ordered (layer, remote block, run).

    Remote block ``remote_block_ids[q]`` fills sub-block ``q % ratio`` of local
    block ``local_block_ids[q // ratio]``, as in ``read_indices``; regions are
    ``layer * planes + plane`` on each side, offsets are within a region. Block
    ids are checked (``BlockMappingError``) as for NIXL.
    """
    ratio = ranges.ratio
    local_ids, remote_ids = checked_read_ids(ratio, local_block_ids, remote_block_ids, local.num_blocks,
                                             remote.num_blocks)  # fmt: skip
    layers = np.arange(local.num_layers, dtype=np.int64)[:, None, None]
    position = np.arange(len(remote_ids))
    remote_planes = np.asarray(ranges.remote_planes, dtype=np.int64)
    local_planes = np.asarray(ranges.local_planes, dtype=np.int64)
    src_offsets = remote_ids[:, None] * remote.block_len_bytes + np.asarray(ranges.remote_offsets, dtype=np.int64)
    dst_offsets = (local_ids[position // ratio] * local.block_len_bytes)[:, None] + np.asarray(
        ranges.local_offsets, dtype=np.int64
    )[position % ratio]
    shape = (local.num_layers, len(remote_ids), ranges.num_runs)
    lengths = np.asarray(ranges.lengths, dtype=np.int64)
    values = np.concatenate((ranges.remote_offsets, np.ravel(ranges.local_offsets), lengths)).astype(np.int64)
    common = int(np.gcd.reduce(np.append(values, [remote.block_len_bytes, local.block_len_bytes])))
    return Moves(
        src_regions=np.broadcast_to(layers * remote.planes_per_layer + remote_planes, shape).ravel(),
        src_offsets=np.broadcast_to(src_offsets[None], shape).ravel(),
        dst_regions=np.broadcast_to(layers * local.planes_per_layer + local_planes, shape).ravel(),
        dst_offsets=np.broadcast_to(dst_offsets[None], shape).ravel(),
        lengths=np.broadcast_to(lengths, shape).ravel(),
        row_bytes=common,
    )


def copy_moves_torch(moves: Moves, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """The stock gather: per pair of regions, one ``index_copy_`` of rows (on the current stream).

    ``src`` and ``dst`` are flat uint8 tensors, one per region; rows are ``moves.row_bytes`` long (a whole
    block plane when whole planes move).
    """
    import torch

    granule = moves.row_bytes
    # Index whole rows of the widest integer: a gather of bytes would move one per thread.
    element = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[math.gcd(granule, 8)]
    per_row = granule // element.itemsize
    pairs = moves.src_regions * len(dst) + moves.dst_regions
    for pair in np.unique(pairs).tolist():
        chosen = pairs == pair
        s, d = divmod(pair, len(dst))
        starts_src = moves.src_offsets[chosen] // granule
        starts_dst = moves.dst_offsets[chosen] // granule
        counts = moves.lengths[chosen] // granule
        within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        src_rows = torch.from_numpy(np.repeat(starts_src, counts) + within)
        dst_rows = torch.from_numpy(np.repeat(starts_dst, counts) + within)
        device = dst[d].device
        rows = src[s].view(element).view(-1, per_row)[src_rows.to(device)]
        dst[d].view(element).view(-1, per_row).index_copy_(0, dst_rows.to(device), rows)


@dataclass(frozen=True, slots=True)
class RunTable:
    """Where every run of every layer starts in block 0 of either side, in this process's address space.

    A run of remote block ``q`` starts at ``src[layer, run] + q * remote_block_bytes``
    and lands at ``dst[layer, sub, run] + b * local_block_bytes`` of local block ``b``
    (sub-block ``sub``): a read then needs only its block ids, and the gather
    computes each run's addresses itself. Built once per peer (``run_table``).
    """

    src: np.ndarray  # [layers, runs]
    dst: np.ndarray  # [layers, ratio, runs]
    words: np.ndarray  # [runs]: lengths in 8-byte words
    remote_block_bytes: int
    local_block_bytes: int
    whole_words: bool
    """Every length is a multiple of 8 bytes: the Triton gather can move this peer's runs."""
    aligned: bool
    """Every address and length is a multiple of 16 bytes: the gather may move 16 bytes at a time."""


def run_table(ranges: PlaneRanges, local: KVRegions, remote: KVRegions, dst_bases: np.ndarray,
              src_bases: np.ndarray) -> RunTable:  # fmt: skip
    """The ``RunTable`` of a peer: ``src_bases``/``dst_bases`` are the regions' addresses here."""
    layers = np.arange(local.num_layers, dtype=np.int64)[:, None]
    src = src_bases[layers * remote.planes_per_layer + np.asarray(ranges.remote_planes)] + np.asarray(
        ranges.remote_offsets, dtype=np.int64
    )
    dst = (
        dst_bases[layers * local.planes_per_layer + np.asarray(ranges.local_planes)][:, None, :]
        + np.asarray(ranges.local_offsets, dtype=np.int64)[None]
    )
    lengths = np.asarray(ranges.lengths, dtype=np.int64)
    values = np.concatenate((src.ravel(), dst.ravel(), lengths, [remote.block_len_bytes, local.block_len_bytes]))
    return RunTable(
        src=src,
        dst=dst,
        words=lengths // TritonGather.WORD,
        remote_block_bytes=remote.block_len_bytes,
        local_block_bytes=local.block_len_bytes,
        whole_words=bool((lengths % TritonGather.WORD == 0).all()),
        aligned=bool((values % 16 == 0).all()),
    )


class TritonGather:
    """One launch for a whole read: program (layer and run, block, chunk) copies one chunk of one run.

    It moves 8-byte words, and tells the compiler it may move two at once when
    the peer's runs are 16-byte aligned (``RunTable.aligned``). KV runs are
    whole rows (``head_dim`` elements: 64 bytes and more), so lengths and
    offsets are multiples of 8; a peer whose are not goes to the stock gather.
    The per-peer tables live on the GPU; a read uploads only its block offsets.
    """

    WORD = 8
    MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third dims

    def __init__(self, chunk: int = 2048, num_warps: int = 4) -> None:
        import triton
        import triton.language as tl

        self.chunk, self.num_warps = chunk, num_warps  # words per program, and its warps
        self.hints = True  # off once a Triton could not compile the aligned variant

        @triton.jit
        def gather_blocks(src_runs, dst_runs, words, offsets, num_remote, runs, ratio, CHUNK: tl.constexpr,
                          ALIGNED: tl.constexpr):  # noqa: N803 - Triton's constexpr style  # fmt: skip
            layer_run = tl.program_id(0)
            block = tl.program_id(1)
            start = tl.program_id(2) * CHUNK
            layer = layer_run // runs
            run = layer_run % runs
            length = tl.load(words + run)
            if ALIGNED:
                length = tl.multiple_of(length, 2)
            if start < length:
                src = tl.load(src_runs + layer_run) + tl.load(offsets + block)
                sub = (layer * ratio + block % ratio) * runs + run
                dst = tl.load(dst_runs + sub) + tl.load(offsets + num_remote + block // ratio)
                if ALIGNED:
                    src = tl.multiple_of(src, 16)
                    dst = tl.multiple_of(dst, 16)
                src_ptr = src.to(tl.pointer_type(tl.int64))
                dst_ptr = dst.to(tl.pointer_type(tl.int64))
                index = start + tl.arange(0, CHUNK)
                mask = index < length
                tl.store(dst_ptr + index, tl.load(src_ptr + index, mask=mask), mask=mask)

        self._kernel = gather_blocks

    def upload(self, table: RunTable, device: torch.device) -> tuple[Any, ...]:
        """The table's arrays on ``device`` (once per peer)."""
        import torch

        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (table.src, table.dst, table.words))

    def __call__(
        self, table: RunTable, on_device: tuple[Any, ...], remote_ids: np.ndarray, local_ids: np.ndarray, device
    ) -> None:
        import torch

        offsets = np.concatenate((remote_ids * table.remote_block_bytes, local_ids * table.local_block_bytes))
        offsets_on_device = torch.from_numpy(offsets).pin_memory().to(device, non_blocking=True)
        layers, runs = table.src.shape
        chunks = -(-int(table.words.max()) // self.chunk)
        ratio = table.dst.shape[1]
        step = self.MAX_GRID_Y // ratio * ratio  # whole local blocks per launch
        for first in range(0, len(remote_ids), step):
            count = min(step, len(remote_ids) - first)
            # A slice of blocks: remote offsets from ``first``, local offsets of the same sub-blocks.
            part = offsets_on_device if count == len(remote_ids) else torch.cat((
                offsets_on_device[first : first + count],
                offsets_on_device[len(remote_ids) + first // ratio :],
            ))  # fmt: skip
            self._launch((layers * runs, count, chunks), *on_device, part, count, runs, ratio, table.aligned)

    def _launch(self, grid: tuple[int, int, int], *args: Any) -> None:
        *kernel_args, aligned = args
        if aligned and self.hints:
            try:
                self._kernel[grid](*kernel_args, CHUNK=self.chunk, ALIGNED=True, num_warps=self.num_warps)
                return
            except Exception as e:  # noqa: BLE001 - a Triton that cannot compile the hints: the plain variant
                logger.warning("the aligned CUDA IPC gather does not compile here (%s); using 8-byte words", e)
                self.hints = False
        self._kernel[grid](*kernel_args, CHUNK=self.chunk, ALIGNED=False, num_warps=self.num_warps)
