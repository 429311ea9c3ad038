"""Block transport over CUDA IPC: a reader on the same node maps the source's KV caches and gathers blocks on the GPU.

Between two processes of one node where the reader sees the source's GPU and
has peer access to it (NVLink, or PCIe peer to peer; or the same GPU), moving KV
needs no network: the reader maps the source's cache memory into its own address
space once and copies blocks device to device. vLLM 0.32's Ray workers, where
the connector's worker side runs, see every GPU of their node: vLLM has Ray
leave ``CUDA_VISIBLE_DEVICES`` unset (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``)
and picks its own GPU by rank. So engines on different GPUs of a node read each
other here; the choice goes by the GPUs' UUIDs (``cannot_read``).

1. The source ``register_kv_caches``: the storages behind its caches are
   exported as IPC handles (PyTorch's own CUDA IPC, ``_share_cuda_``: the
   handle of the allocation, the storage's offset in it and PyTorch's
   cross-process reference count). ``handshake_payload()`` is that export as
   JSON, sent over the authenticated side channel with the handshake.
2. The reader ``add_peer``: the payload is checked field by field (it is
   bytes from the network: no pickle), each storage is opened once
   (``UntypedStorage._new_shared_cuda``, cached for the transport's life), and
   every remote region must lie inside what was exported -- a region that
   does not is refused, so no READ can touch memory the source did not share.
   The runs this rank reads are those of ``connectors.block_ranges``, the same
   as NIXL's.
3. ``read_blocks`` launches ONE batched gather for a read (``connectors.transport.gather``): a Triton
   kernel that computes every run's addresses from the peer's run table and the read's block offsets
   (``copy="triton"``, the default where Triton runs), or, as the stock fallback, one ``index_copy_`` per
   pair of regions (``copy="torch"``). The offsets go through a ring slot (pinned, then copied to the GPU
   on the current stream); the copy runs on the transport's own stream after the current stream's work;
   a CUDA event says when it is done. The host's calls go straight to the CUDA driver where it binds
   (``connectors.transport.cuda_driver``): a 64-MiB read's copy takes ~40 us, so its launch must cost less.

CUDA IPC has no message back to the source: the reader tells it over the side
channel (``notifies_source`` is False; ``connectors.reader`` sends the READ
notification itself), so leases end as they do with NIXL. A read cannot be
cancelled once launched: ``abort`` waits for the copy (microseconds to
milliseconds) before it reports FAILED, so a failed read never writes into
blocks vLLM has since reused.

Nothing here imports torch or Triton at module level: the payload's checks
and the move arithmetic run on any machine (``tests/unit/connectors/test_cuda_ipc.py``).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from connectors.block_ranges import KVRegions, PlaneRanges, checked_read_ids
from connectors.errors import TransportError
from connectors.transport import CUDA_IPC
from connectors.transport.base import ReadState, TransferState, cache_regions, checked_ranges
from connectors.transport.gather import (
    OffsetRing,
    PeerGather,
    RunTable,
    TritonGather,
    copy_moves_torch,
    plan_moves,
    run_table,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "COPY_MODES", "CudaIpcTransport", "IpcExport", "IpcRead", "decode_export", "enable_peer_access", "peer_access",
    "region_views", "visible_gpus",
]  # fmt: skip

logger = logging.getLogger(__name__)

PAYLOAD_VERSION = 1
# "triton": one kernel launch copies every run; "torch": one index_copy_ per pair of regions (the stock
# fallback); "auto": Triton where it imports, else torch.
COPY_MODES = ("auto", "triton", "torch")
_MAX_STORAGES = 4096  # one per layer in vLLM; a payload claiming more is refused
_MAX_BYTES = 1 << 50
_IPC_HANDLE_BYTES = 1024  # PyTorch's handles are 64 (legacy IPC) to a few hundred bytes


# ---------------------------------------------------------------- the export


@dataclass(frozen=True, slots=True)
class IpcStorage:
    """One exported storage: what ``UntypedStorage._new_shared_cuda`` needs, and where it is in the source."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    data_ptr: int
    """The storage's address in the source process: regions are located by it."""


@dataclass(frozen=True, slots=True)
class IpcExport:
    """What a source offers a reader: its GPU and the storages behind its caches."""

    gpu_uuid: str
    gpu_name: str
    storages: tuple[IpcStorage, ...]

    def encode(self) -> bytes:
        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode()

        return json.dumps({
            "version": PAYLOAD_VERSION,
            "gpu_uuid": self.gpu_uuid,
            "gpu_name": self.gpu_name,
            "storages": [
                {
                    "device": s.device, "handle": b64(s.handle), "size": s.size, "offset": s.offset,
                    "ref_counter_handle": b64(s.ref_counter_handle), "ref_counter_offset": s.ref_counter_offset,
                    "event_handle": b64(s.event_handle), "event_sync_required": s.event_sync_required,
                    "data_ptr": s.data_ptr,
                }
                for s in self.storages
            ],
        }, separators=(",", ":")).encode()  # fmt: skip

    def storage_of(self, address: int, length: int) -> int:
        """Index of the storage holding ``[address, address + length)``; ``TransportError`` if none does."""
        for index, storage in enumerate(self.storages):
            if storage.data_ptr <= address and address + length <= storage.data_ptr + storage.size:
                return index
        raise TransportError(f"{length} bytes at {address:#x} lie outside every storage the peer exported")


def decode_export(payload: bytes) -> IpcExport:
    """Check and decode a peer's ``handshake_payload()``; ``TransportError`` naming the field for anything else."""
    try:
        data = json.loads(payload)
    except (ValueError, TypeError, RecursionError) as e:
        raise TransportError(f"CUDA IPC payload does not decode as JSON: {e}") from None
    if not isinstance(data, dict) or data.get("version") != PAYLOAD_VERSION:
        raise TransportError(f"CUDA IPC payload is not version {PAYLOAD_VERSION} of our export")
    storages = data.get("storages")
    if not isinstance(storages, list) or not 1 <= len(storages) <= _MAX_STORAGES:
        raise TransportError(f"CUDA IPC payload: storages must be a list of 1 to {_MAX_STORAGES}")
    return IpcExport(
        gpu_uuid=_text(data, "gpu_uuid"),
        gpu_name=_text(data, "gpu_name"),
        storages=tuple(_storage(entry, i) for i, entry in enumerate(storages)),
    )


def _text(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise TransportError(f"CUDA IPC payload: {name} must be a non-empty string")
    return value


def _storage(entry: object, index: int) -> IpcStorage:
    if not isinstance(entry, dict):
        raise TransportError(f"CUDA IPC payload: storage {index} is not a map")

    def integer(name: str, low: int, high: int) -> int:
        value = entry.get(name)
        if type(value) is not int or not low <= value <= high:
            raise TransportError(f"CUDA IPC payload: storage {index}: {name} must be an int in [{low}, {high}]")
        return value

    def raw(name: str, allow_empty: bool = False) -> bytes:
        value = entry.get(name)
        try:
            data = base64.b64decode(value, validate=True) if isinstance(value, str) else None
        except (binascii.Error, ValueError):
            data = None
        if data is None or len(data) > _IPC_HANDLE_BYTES or (not data and not allow_empty):
            raise TransportError(f"CUDA IPC payload: storage {index}: {name} must be base64 of a handle")
        return data

    sync = entry.get("event_sync_required")
    if not isinstance(sync, bool):
        raise TransportError(f"CUDA IPC payload: storage {index}: event_sync_required must be a bool")
    return IpcStorage(
        device=integer("device", 0, 1023),
        handle=raw("handle"),
        size=integer("size", 1, _MAX_BYTES),
        offset=integer("offset", 0, _MAX_BYTES),
        ref_counter_handle=raw("ref_counter_handle"),
        ref_counter_offset=integer("ref_counter_offset", 0, _MAX_BYTES),
        event_handle=raw("event_handle", allow_empty=True),
        event_sync_required=sync,
        data_ptr=integer("data_ptr", 1, 2**64 - 1),
    )


def visible_gpus() -> dict[str, int]:
    """The GPUs this process sees, ``{uuid: device index}`` (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def peer_access(reader: int, source: int) -> bool:
    """Whether a kernel on GPU ``reader`` can read memory of GPU ``source`` (the same GPU, or CUDA peer access:
    NVLink or PCIe)."""
    import torch

    return reader == source or torch.cuda.can_device_access_peer(reader, source)


def enable_peer_access(reader: int, source: int) -> None:
    """Let kernels on GPU ``reader`` read GPU ``source``'s memory. PyTorch enables peer access, once per pair of
    GPUs and process, when it first copies between them: a one-element copy makes it do so."""
    import torch

    if reader != source:
        torch.empty(1, device=f"cuda:{source}").to(f"cuda:{reader}")


# ---------------------------------------------------------------- reads


class IpcRead(ReadState):
    """One launched gather: DONE when its event has fired, FAILED past its deadline or when aborted."""

    def __init__(self, peer: str, num_bytes: int, started: Any, event: Any, deadline: float, started_at: float) -> None:
        super().__init__(peer, num_bytes, deadline, started_at)
        self.launched_s = time.monotonic() - started_at
        """Host time to check, plan and launch the read."""
        self.gpu_s: float | None = None
        """Seconds from the gather's start on the GPU to its end (None until DONE)."""
        self._started = started
        self._event = event
        self._over = False  # the copy is known over (its slot's event may be recorded again by a later read)

    def poll(self) -> TransferState:
        if self._state is TransferState.PENDING:
            if self._event.query():
                self.gpu_s = self._started.elapsed_time(self._event) / 1e3
                self._finish(TransferState.DONE, None)
            elif time.monotonic() >= self.deadline:
                self.abort(f"the copy from {self.peer} did not finish within {self.deadline - self.started_at:.1f} s")
        return self._state

    def wait(self) -> TransferState:
        if self._state is TransferState.PENDING:
            self._event.synchronize()
        return self.poll()

    @property
    def drained(self) -> bool:
        """Over on the GPU too: a launched copy cannot be cancelled, and an aborted one runs to its end."""
        if not self._over and self._state is not TransferState.PENDING:
            self._over = self._state is TransferState.DONE or bool(self._event.query())
        return self._over

    def abort(self, reason: str = "aborted") -> None:
        """FAILED now, without waiting on the GPU (this runs on vLLM's model-runner thread): the copy may still
        run, and the read is ``drained`` once its event has fired."""
        if self._state is TransferState.PENDING:
            self._finish(TransferState.FAILED, reason)

    def settle(self) -> None:
        """Over, whatever the caller has asked so far: its events and offsets may serve another read."""
        if not self.drained:
            self._event.synchronize()
            self.poll()
            self._over = True


# ---------------------------------------------------------------- the transport


@dataclass(slots=True)
class _Peer:
    regions: KVRegions
    ranges: PlaneRanges
    src: list[Any]  # flat uint8 views of the peer's regions, in our address space
    table: RunTable
    keys: frozenset[bytes] = frozenset()  # the mappings it reads (``_mapping_key``)
    kernel: Any = None  # the Triton gather's ``PeerGather`` (its table on the GPU)


@dataclass
class CudaIpcTransport:
    """KV reads from the CUDA caches of processes on this node (see the module docstring)."""

    engine_id: str
    transfer_timeout_s: float = 30.0
    copy: str = "auto"
    name: str = CUDA_IPC
    notifies_source = False
    """Reads do not tell the source: the reader sends the READ notification over the side channel."""
    _regions: KVRegions | None = field(default=None, init=False)
    _export: IpcExport | None = field(default=None, init=False)
    _dst: list[Any] = field(default_factory=list, init=False)
    _dst_bases: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), init=False)
    _opened: dict[bytes, Any] = field(default_factory=dict, init=False)
    _peers: dict[str, _Peer] = field(default_factory=dict, init=False)
    _stream: Any = field(default=None, init=False)
    _gather: Any = field(default=None, init=False)
    _ring: OffsetRing = field(default_factory=OffsetRing, init=False)
    triton_chunk: int = 2048
    """Words (8 bytes) each Triton program copies."""
    triton_warps: int = 4
    driver: str = "auto"
    """``auto``: the host's calls of a read (the offsets' copy, its events) go straight to the CUDA driver where it
    binds (``connectors.transport.cuda_driver``); ``torch``: through PyTorch's objects."""
    _driver: Any = field(default=None, init=False)
    _raw_stream: int = field(default=0, init=False)
    offsets_on: str = "device"
    """Where the Triton gather reads a read's block offsets: ``device`` (copied there on the current stream) or
    ``host`` (pinned memory, read over the bus: no copy)."""

    def __post_init__(self) -> None:
        if self.copy not in COPY_MODES:
            raise TransportError(f"copy must be one of {', '.join(COPY_MODES)}, got {self.copy!r}")

    def register_kv_caches(
        self, caches: Mapping[str, torch.Tensor], block_len_bytes: int, *, planes_per_layer: int | None = None
    ) -> KVRegions:
        import torch

        if self._regions is not None:
            raise TransportError(f"engine {self.engine_id}: KV caches are already registered")
        first = next(iter(caches.values()), None)
        if first is None or first.device.type != "cuda":
            raise TransportError("CUDA IPC moves CUDA caches only")
        regions = cache_regions(caches, block_len_bytes, planes_per_layer, self.engine_id)
        device = first.device
        storages: dict[int, torch.UntypedStorage] = {}
        for cache in caches.values():
            storages.setdefault(cache.untyped_storage().data_ptr(), cache.untyped_storage())
        try:
            exported = tuple(_export_storage(storage) for storage in storages.values())
        except RuntimeError as e:  # e.g. memory from a virtual-memory allocator, which has no legacy IPC handle
            raise TransportError(f"engine {self.engine_id}: cannot export the KV caches by CUDA IPC: {e}") from e
        properties = torch.cuda.get_device_properties(device)
        self._export = IpcExport(str(properties.uuid), properties.name, exported)
        self._regions = regions
        self._dst = region_views(regions, self._export, [_flat(s, device) for s in storages.values()])
        self._dst_bases = np.asarray([view.data_ptr() for view in self._dst], dtype=np.int64)
        self._stream = torch.cuda.Stream(device)
        self._raw_stream = self._stream.cuda_stream
        if self.driver == "auto":
            from connectors.transport.cuda_driver import DriverCalls

            self._driver = DriverCalls.load()
        return regions

    def kv_regions(self) -> KVRegions:
        if self._regions is None:
            raise TransportError(f"engine {self.engine_id}: no KV caches registered yet")
        return self._regions

    def handshake_payload(self) -> bytes:
        if self._export is None:
            raise TransportError(f"engine {self.engine_id}: no KV caches registered yet")
        return self._export.encode()

    def cannot_read(self, payload: bytes) -> str | None:
        """Why this transport cannot read from the source that sent ``payload`` (None: it can)."""
        try:
            export = decode_export(payload)
        except TransportError as e:
            return str(e)
        return self._unreachable(export, visible_gpus())

    def _unreachable(self, export: IpcExport, devices: Mapping[str, int]) -> str | None:
        """Why the GPU of ``export`` cannot be read from here, among ``devices`` (``visible_gpus``), or None."""
        if export.gpu_uuid not in devices:
            return f"its GPU {export.gpu_uuid} ({export.gpu_name}) is not visible to this process"
        if self._regions is not None and not peer_access(self._device_index(), devices[export.gpu_uuid]):
            return f"its GPU {export.gpu_uuid} ({export.gpu_name}) has no peer access from this process's GPU"
        return None

    def _device_index(self) -> int:
        return self._stream.device.index

    def add_peer(self, peer: str, payload: bytes, regions: KVRegions, ranges: PlaneRanges | None = None) -> str:
        import torch

        local = self.kv_regions()
        if peer in self._peers:
            raise TransportError(f"peer {peer} is already added")
        export = decode_export(payload)
        devices = visible_gpus()
        if (why := self._unreachable(export, devices)) is not None:
            raise TransportError(f"peer {peer}: {why}")
        ranges = checked_ranges(peer, local, regions, ranges)
        device = torch.device("cuda", devices[export.gpu_uuid])
        enable_peer_access(self._device_index(), device.index)  # another GPU of the node: read over NVLink or PCIe
        keys = [_mapping_key(storage) for storage in export.storages]
        try:
            opened = [self._open(storage, device) for storage in export.storages]
            src = region_views(regions, export, opened)
        except (RuntimeError, TransportError) as e:
            self._close_unused()
            raise TransportError(f"peer {peer}: cannot map its KV caches by CUDA IPC: {e}") from e
        src_bases = np.asarray([view.data_ptr() for view in src], dtype=np.int64)
        table = run_table(ranges, local, regions, self._dst_bases, src_bases)
        self._peers[peer] = _Peer(regions, ranges, src, table, keys=frozenset(keys))
        return export.gpu_uuid

    def _open(self, storage: IpcStorage, device: torch.device) -> torch.Tensor:
        """The storage mapped here (once, while a peer uses it), as flat uint8."""
        import torch

        key = _mapping_key(storage)
        if key not in self._opened:
            with torch.cuda.device(device):
                shared = torch.UntypedStorage._new_shared_cuda(
                    device.index,
                    storage.handle,
                    storage.size,
                    storage.offset,
                    storage.ref_counter_handle,
                    storage.ref_counter_offset,
                    storage.event_handle,
                    storage.event_sync_required,
                )
            self._opened[key] = _flat(shared, device)
        return self._opened[key]

    def remove_peer(self, peer: str) -> None:
        """Forget the peer, and unmap what no other peer uses (a restarted engine's old caches are not held)."""
        if self._peers.pop(peer, None) is not None:
            self._close_unused()

    def _close_unused(self) -> None:
        in_use = set().union(*(entry.keys for entry in self._peers.values()))
        unused = [key for key in self._opened if key not in in_use]
        if unused and self._stream is not None:
            self._stream.synchronize()  # unmapping is not ordered on the stream: no gather may still read it
        for key in unused:
            del self._opened[key]

    def read_blocks(
        self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int], notify: bytes = b""
    ) -> IpcRead:
        """Launch the gather of those blocks; ``notify`` is the reader's to send (``notifies_source``)."""
        import torch

        started_at = time.monotonic()
        local = self.kv_regions()
        entry = self._peers.get(peer)
        if entry is None:
            raise TransportError(f"engine {self.engine_id}: unknown peer {peer}; call add_peer first")
        local_ids, remote_ids = checked_read_ids(entry.ranges.ratio, local_block_ids, remote_block_ids,
                                                 local.num_blocks, entry.regions.num_blocks)  # fmt: skip
        num_bytes = len(remote_ids) * local.num_layers * entry.ranges.bytes_per_block
        by_driver = self._driver is not None and self.offsets_on == "device" and self.copy != "torch"
        if by_driver and num_bytes and entry.table.whole_words and self._triton() is not None:
            try:
                return self._read_by_driver(peer, entry, local_ids, remote_ids, num_bytes, started_at)
            except TransportError as e:  # a driver that refuses a call: PyTorch's calls from now on
                logger.warning("engine %s: CUDA IPC reads go through PyTorch from now on: %s", self.engine_id, e)
                self._driver = None
        stream = self._stream
        current = torch.cuda.current_stream(stream.device)
        copy, slot = self._plan(entry, local_ids, remote_ids, current) if num_bytes else (None, self._ring.take(0))
        ready, started, done = slot.events
        ready.record(current)  # the blocks' last users (and the offsets' copy) go first
        stream.wait_event(ready)
        started.record(stream)
        if copy is not None:
            copy()
        done.record(stream)
        read = slot.last = IpcRead(peer, num_bytes, started, done, started_at + self.transfer_timeout_s, started_at)
        return read

    def _read_by_driver(
        self, peer: str, entry: _Peer, local_ids: np.ndarray, remote_ids: np.ndarray, num_bytes: int, started_at: float
    ) -> IpcRead:
        """``read_blocks`` with the host's calls made straight to the driver: the offsets copied on the current
        stream, which the transport's stream then waits for; events around the gather."""
        import torch

        stream, raw, driver = self._stream, self._raw_stream, self._driver
        peer_gather, count = self._peer_gather(entry), len(remote_ids)
        slot = self._ring.take(count + len(local_ids), stream.device)
        size = slot.write(peer_gather, remote_ids, local_ids)
        ready, started, done = slot.handles
        current = torch._C._cuda_getCurrentRawStream(stream.device.index)
        on_device = slot.on_device.data_ptr()
        driver.copy_to_device(on_device, slot.offsets.data_ptr(), size * TritonGather.WORD, current)
        driver.record(ready, current)  # the blocks' last users (and the offsets' copy) go first
        driver.wait(raw, ready)
        driver.record(started, raw)
        self._gather(peer_gather, on_device, count, stream, raw)
        driver.record(done, raw)
        _, started_event, done_event = slot.events
        deadline = started_at + self.transfer_timeout_s
        read = slot.last = IpcRead(peer, num_bytes, started_event, done_event, deadline, started_at)
        return read

    def _triton(self) -> TritonGather | None:
        """The Triton gather (made at the first read that needs it), or None where reads copy with torch: without
        Triton, ``copy="auto"`` turns to torch for good, and ``copy="triton"`` is an error."""
        if self.copy == "torch":
            return None
        if self._gather is None:
            try:
                self._gather = TritonGather(self.triton_chunk, self.triton_warps)
            except ImportError as e:
                if self.copy == "triton":
                    raise TransportError(f"copy='triton' needs Triton: {e}") from e
                logger.info("engine %s: Triton is not available (%s); CUDA IPC copies with torch", self.engine_id, e)
                self.copy = "torch"
                return None
        return self._gather

    def _peer_gather(self, entry: _Peer) -> PeerGather:
        """The peer's launch of the Triton gather, its table on the GPU (made at its first read)."""
        if entry.kernel is None:
            entry.kernel = self._gather.upload(entry.table, self._stream.device)
        return entry.kernel

    def _plan(self, entry: _Peer, local_ids: np.ndarray, remote_ids: np.ndarray, current: Any) -> tuple[Any, Any]:
        """The read's copy, to launch on the transport's stream, and its ring slot (its offsets written, and on the
        GPU by ``current``'s work where the gather reads them there)."""
        import torch

        stream = self._stream
        if self._triton() is None or not entry.table.whole_words:
            moves = plan_moves(entry.ranges, self.kv_regions(), entry.regions, local_ids, remote_ids)

            def by_torch() -> None:
                with torch.cuda.stream(stream):
                    copy_moves_torch(moves, entry.src, self._dst)

            return by_torch, self._ring.take(0)
        peer, count = self._peer_gather(entry), len(remote_ids)
        on_device = self.offsets_on == "device"
        slot = self._ring.take(count + len(local_ids), stream.device if on_device else None)
        size = slot.write(peer, remote_ids, local_ids)
        if on_device:
            slot.on_device[:size].copy_(slot.offsets[:size], non_blocking=True)  # on ``current``
            address = slot.on_device.data_ptr()
        else:
            address = slot.offsets.data_ptr()
        return (lambda: self._gather(peer, address, count, stream)), slot

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        return []

    def close(self) -> None:
        self._ring.settle()
        if self._stream is not None:
            self._stream.synchronize()
        self._peers.clear()
        self._opened.clear()


def _mapping_key(storage: IpcStorage) -> bytes:
    return storage.handle + storage.offset.to_bytes(8, "little")


def _export_storage(storage: torch.UntypedStorage) -> IpcStorage:
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    return IpcStorage(
        device=int(device),
        handle=bytes(handle),
        size=int(size),
        offset=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
        data_ptr=storage.data_ptr(),
    )


def _flat(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def region_views(regions: KVRegions, export: IpcExport, storages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One flat uint8 view per region of ``regions`` (addresses in the exporting process), cut from the
    ``storages`` of ``export`` as mapped here; ``TransportError`` for a region outside every storage."""
    region_bytes = regions.num_blocks * regions.block_len_bytes
    views = []
    for address in regions.region_addrs:
        index = export.storage_of(address, region_bytes)
        start = address - export.storages[index].data_ptr
        views.append(storages[index][start : start + region_bytes])
    return views
