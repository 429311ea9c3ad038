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

__all__ = [
    "Moves", "OffsetRing", "PeerGather", "RunTable", "TritonGather", "copy_moves_torch", "plan_moves", "run_table",
]  # fmt: skip

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
    """Every address and length is a multiple of 8 bytes: the Triton gather can move this peer's runs."""
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
        whole_words=bool((values % TritonGather.WORD == 0).all()),
        aligned=bool((values % 16 == 0).all()),
    )


class TritonGather:
    """One launch for a whole read: program (layer and run, block, chunk) copies one chunk of one run.

    It moves 8-byte words, two at once where the peer's runs are 16-byte aligned
    (``RunTable.aligned``): every address is a count of words from an anchor
    tensor, so the compiler knows the alignment. Where every run is a whole number
    of chunks (whole block planes) it copies without masks. KV runs are whole rows
    (``head_dim`` elements: 64 bytes and more), so lengths and offsets are
    multiples of 8; a peer whose are not goes to the stock gather. The per-peer
    tables live on the GPU (``upload``); a read's block offsets are read at the
    address the caller gives (a ring slot's device copy: ``OffsetRing``). After a
    variant's first launch (Triton's JIT: compile, then cache), reads launch the
    compiled kernel directly; every integer argument is left unspecialized, so one
    compiled kernel is right for every peer and read.
    """

    WORD = 8
    MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third dims

    def __init__(self, chunk: int = 2048, num_warps: int = 4) -> None:
        import triton
        import triton.language as tl

        self.chunk, self.num_warps = chunk, num_warps  # words per program, and its warps
        self.hints = True  # off once a Triton could not compile the aligned variant
        self.fast_launch = True  # off once a Triton's compiled kernel could not be launched directly
        self._compiled: dict[tuple[bool, bool], Any] = {}

        def gather_blocks(anchor, src_table, dst_table, words_table, remote_offsets, local_offsets, runs, ratio,
                          CHUNK: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr):  # noqa: N803  # fmt: skip
            # Every address is a count of words from ``anchor`` (a tensor of ours, so 16-byte aligned): the
            # compiler then knows the alignment of what it moves, and moves 16 bytes at a time where ALIGNED.
            layer_run = tl.program_id(0)
            block = tl.program_id(1)
            start = tl.program_id(2) * CHUNK
            layer = layer_run // runs
            run = layer_run % runs
            # tables and offsets by address (integers: one compiled kernel serves every peer and read)
            src_runs = src_table.to(tl.pointer_type(tl.int64))
            dst_runs = dst_table.to(tl.pointer_type(tl.int64))
            words = words_table.to(tl.pointer_type(tl.int64))
            remote = remote_offsets.to(tl.pointer_type(tl.int64))
            local = local_offsets.to(tl.pointer_type(tl.int64))
            src = tl.load(src_runs + layer_run) + tl.load(remote + block)
            sub = (layer * ratio + block % ratio) * runs + run
            dst = tl.load(dst_runs + sub) + tl.load(local + block // ratio)
            if ALIGNED:
                src = tl.multiple_of(src, 2)
                dst = tl.multiple_of(dst, 2)
            index = start + tl.arange(0, CHUNK)
            if EVEN:  # every run a whole number of chunks: no masks
                tl.store(anchor + dst + index, tl.load(anchor + src + index))
            else:
                length = tl.load(words + run)
                if ALIGNED:
                    length = tl.multiple_of(length, 2)
                mask = index < length
                tl.store(anchor + dst + index, tl.load(anchor + src + index, mask=mask), mask=mask)

        loose = ["src_table", "dst_table", "words_table", "remote_offsets", "local_offsets", "runs", "ratio"]
        self._kernel = triton.jit(gather_blocks, do_not_specialize=loose)
        self._anchors: dict[Any, Any] = {}

    def anchor(self, device: torch.device) -> Any:
        """The tensor whose address every address of this gather on ``device`` is counted from."""
        import torch

        if device not in self._anchors:
            self._anchors[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return self._anchors[device]

    def upload(self, table: RunTable, device: torch.device) -> PeerGather:
        """A peer's table on ``device``, in words from the anchor, and its launch's shape (once per peer)."""
        import torch

        anchor = self.anchor(device)
        base = anchor.data_ptr()
        src, dst = ((np.ascontiguousarray(a) - base) // self.WORD for a in (table.src, table.dst))
        tensors = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (src, dst, table.words))
        layers, runs = table.src.shape
        return PeerGather(
            tensors=tensors,
            args=(anchor, *(t.data_ptr() for t in tensors)),
            programs=layers * runs,
            runs=runs,
            ratio=table.dst.shape[1],
            chunks=-(-int(table.words.max()) // self.chunk),
            aligned=table.aligned,
            even=bool((table.words % self.chunk == 0).all()),
            remote_words=table.remote_block_bytes // self.WORD,
            local_words=table.local_block_bytes // self.WORD,
        )

    def __call__(
        self, peer: PeerGather, address: int, num_remote: int, stream: Any, raw_stream: int | None = None
    ) -> None:
        """Launch the gather of one read on ``stream``. The memory at ``address`` (device memory, or pinned host
        memory, whose address the GPU shares) holds the ``num_remote`` remote blocks' offsets in words, then the
        local ones'; it must not change until the launch is over (``OffsetRing``). ``raw_stream``: the stream's
        handle, where the caller has it."""
        raw = stream.cuda_stream if raw_stream is None else raw_stream
        variant = (peer.aligned and self.hints, peer.even)
        ratio = peer.ratio
        step = self.MAX_GRID_Y // ratio * ratio  # whole local blocks per launch
        for first in range(0, num_remote, step):
            count = min(step, num_remote - first)
            # A slice of blocks: remote offsets from ``first``, local offsets of the same sub-blocks.
            remote_at = address + first * self.WORD
            local_at = address + (num_remote + first // ratio) * self.WORD
            grid = (peer.programs, count, peer.chunks)
            self._launch(grid, variant, stream, raw, (*peer.args, remote_at, local_at, peer.runs, ratio))

    def _launch(
        self, grid: tuple[int, int, int], variant: tuple[bool, bool], stream: Any, raw: int, args: tuple
    ) -> None:
        aligned, even = variant
        compiled = self._compiled.get(variant)
        if compiled is not None and self.fast_launch:
            try:
                compiled[grid](*args, self.chunk, aligned, even, stream=raw)
                return
            except Exception as e:  # noqa: BLE001 - a Triton whose compiled kernels launch otherwise: the JIT's call
                logger.warning("the CUDA IPC gather cannot launch its compiled kernel here (%s); launching by JIT", e)
                self.fast_launch = False
        import torch

        with torch.cuda.stream(stream):
            try:
                launched = self._kernel[grid](*args, CHUNK=self.chunk, ALIGNED=aligned, EVEN=even,
                                             num_warps=self.num_warps)  # fmt: skip
            except Exception as e:  # a Triton that cannot compile the hints: the plain variant
                if not aligned:
                    raise
                logger.warning("the aligned CUDA IPC gather does not compile here (%s); using 8-byte words", e)
                self.hints = False
                return self._launch(grid, (False, even), stream, raw, args)
        if launched is not None and hasattr(launched, "__getitem__"):
            self._compiled[variant] = launched


@dataclass(frozen=True, slots=True)
class PeerGather:
    """What the gather launches a peer's reads with (``TritonGather.upload``)."""

    tensors: tuple[Any, ...]  # the table on the GPU, kept alive here: the kernel gets its addresses
    args: tuple[Any, ...]  # the anchor and the table's addresses
    programs: int  # layers x runs
    runs: int
    ratio: int
    chunks: int  # programs per run
    aligned: bool
    even: bool  # every run a whole number of chunks
    remote_words: int  # a block, in words, on either side
    local_words: int


@dataclass
class _Slot:
    offsets: Any  # a pinned int64 tensor
    view: np.ndarray  # the same memory, as numpy
    events: tuple[Any, Any, Any]  # (ready, started, done): recorded again by each read that takes the slot
    on_device: Any = None  # a device copy of ``offsets``, for a gather that reads them there
    last: Any = None  # the last read that used the slot (its ``settle`` ends it)

    def write(self, peer: PeerGather, remote_ids: np.ndarray, local_ids: np.ndarray) -> int:
        """A read's block offsets in words, the remote blocks' then the local ones', as the gather reads them;
        how many."""
        count, size = len(remote_ids), len(remote_ids) + len(local_ids)
        np.multiply(remote_ids, peer.remote_words, out=self.view[:count])
        np.multiply(local_ids, peer.local_words, out=self.view[count:size])
        return size

    @property
    def handles(self) -> tuple[int, int, int]:
        """The events' CUDA handles (each made at the slot's making)."""
        return tuple(event.cuda_event for event in self.events)


class OffsetRing:
    """The pinned host buffers (and CUDA events) a transport's reads take in turn: the gather reads a read's block
    offsets from its slot by address, so a slot is written again only once the read that last used it is over
    (``settle``: at once, unless ``slots`` reads are in flight)."""

    def __init__(self, slots: int = 32) -> None:
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0

    def take(self, size: int, device: Any = None) -> _Slot:
        """The next slot, with room for ``size`` offsets (on ``device`` too, when given), its last read over."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        if self._slots[index] is None:  # the first read: every slot made at once, not one per early read
            self._slots = [self._make(size, device) for _ in self._slots]
        slot = self._slots[index]
        if slot.last is not None:
            slot.last.settle()
            slot.last = None
        if slot.view.size < size:
            slot = self._slots[index] = self._make(size, device, slot.events)
        elif device is not None and (slot.on_device is None or slot.on_device.numel() < slot.view.size):
            slot.on_device = self._on_device(slot.view.size, device)
        return slot

    @staticmethod
    def _make(size: int, device: Any, events: tuple[Any, Any, Any] | None = None) -> _Slot:
        import torch

        offsets = torch.empty(max(size, 1024), dtype=torch.int64, pin_memory=True)
        if events is None:
            events = tuple(torch.cuda.Event(enable_timing=i > 0) for i in range(3))
            for event in events:
                event.record()  # made now: its handle is valid from here on
        on_device = OffsetRing._on_device(offsets.numel(), device) if device is not None else None
        return _Slot(offsets, offsets.numpy(), events, on_device)

    @staticmethod
    def _on_device(size: int, device: Any) -> Any:
        import torch

        return torch.empty(size, dtype=torch.int64, device=device)

    def settle(self) -> None:
        """Every read that used a slot is over (before the transport lets go of its memory)."""
        for slot in self._slots:
            if slot is not None and slot.last is not None:
                slot.last.settle()
                slot.last = None
