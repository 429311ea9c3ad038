"""Block transport over NIXL: one agent per worker, one batched READ per request and peer.

Life of a read, from the reading (decode) side:

1. Both sides ``register_kv_caches``: every layer's cache is registered with
   the agent and cut into *block planes* (one K or V plane of one block of one
   layer, ``block_len_bytes`` long), prepared once as a local descriptor list.
2. The reader learns a source with ``add_peer(engine_id, metadata, regions)``,
   where ``metadata`` is the source's ``agent_metadata()`` and ``regions`` its
   ``kv_regions()``; the source's block planes are prepared once as a remote list.
3. ``read_blocks(engine_id, local_block_ids, remote_block_ids, notify)`` posts
   ONE READ covering every plane of every layer of those blocks and returns a
   ``KVRead``. Its state machine is PENDING -> DONE | FAILED; a read still
   PENDING at its deadline becomes FAILED, so nothing waits forever.
4. When the READ completes NIXL hands ``notify`` to the source, which sees it
   in ``poll_notifications()`` and may free the blocks.

Descriptor index of plane (region r, block b) is ``r * num_blocks + b`` on both
sides, with regions in registration order (layer, then K before V), so local
and remote index arrays of a read line up element by element.

``nixl`` is imported only here, when a transport is built; torch only where
tensors are inspected.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from connectors.errors import BlockMappingError, TransportError

if TYPE_CHECKING:
    import torch

__all__ = ["KVRead", "KVRegions", "NixlKVTransport", "TransferState"]

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0


class TransferState(enum.Enum):
    """Where one READ stands; DONE and FAILED are final."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class KVRegions:
    """Where an engine's registered KV caches lie, as a peer needs them to prepare reads.

    ``region_addrs`` holds one base address per (layer, K/V) region, in
    descriptor order; each region is ``num_blocks`` planes of ``block_len_bytes``.
    Plain data: picklable, and cheap to send through a side channel.
    """

    layer_names: tuple[str, ...]
    region_addrs: tuple[int, ...]
    num_blocks: int
    block_len_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def descriptors(self) -> np.ndarray:
        """Nx3 ``(address, length, device)`` rows, one per block plane, in descriptor order."""
        addrs = np.asarray(self.region_addrs, dtype=np.uint64)[:, None]
        offsets = np.arange(self.num_blocks, dtype=np.uint64)[None, :] * np.uint64(self.block_len_bytes)
        rows = np.empty((len(self.region_addrs) * self.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = (addrs + offsets).ravel()
        rows[:, 1] = self.block_len_bytes
        rows[:, 2] = self.device_id
        return rows


class KVRead:
    """One posted READ of a request's blocks from one peer: a small state machine.

    ``poll()`` advances it, ``abort()`` ends it as FAILED, ``failure_exception()``
    says why it failed. The NIXL handle is released as soon as the read is final.
    """

    def __init__(self, transport: NixlKVTransport, peer: str, num_bytes: int, deadline: float):
        self.peer = peer
        self.num_bytes = num_bytes
        self.deadline = deadline
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self._transport = transport
        self._xfer: Any = None
        self._state = TransferState.PENDING
        self._reason: str | None = None

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def failure_reason(self) -> str | None:
        return self._reason

    def poll(self) -> TransferState:
        """Check NIXL once (no blocking) and return the state, failing the read past its deadline."""
        if self._state is not TransferState.PENDING:
            return self._state
        try:
            status = self._transport._agent.check_xfer_state(self._xfer)
        except self._transport._nixl_errors as e:  # e.g. the peer disconnected
            self._finish(TransferState.FAILED, f"checking the READ from {self.peer} raised: {e}")
            return self._state
        if status == "DONE":
            self._finish(TransferState.DONE, None)
        elif status != "PROC":
            self._finish(TransferState.FAILED, f"NIXL reported {status} for the READ from {self.peer}")
        elif time.monotonic() >= self.deadline:
            timeout = self.deadline - self.started_at
            self._finish(TransferState.FAILED, f"READ from {self.peer} did not finish within {timeout:.1f} s")
        return self._state

    def wait(self, poll_interval_s: float = 0.0005) -> TransferState:
        """Poll until final; ends by the deadline at the latest."""
        while self.poll() is TransferState.PENDING:
            time.sleep(poll_interval_s)
        return self._state

    def abort(self, reason: str = "aborted") -> None:
        """End a pending read as FAILED (NIXL is asked to cancel it); a final read is left as it is."""
        if self._state is TransferState.PENDING:
            self._finish(TransferState.FAILED, reason)

    def failure_exception(self) -> TransportError | None:
        """The error to raise for a FAILED read; None otherwise."""
        if self._state is not TransferState.FAILED:
            return None
        return TransportError(self._reason or f"READ from {self.peer} failed")

    @property
    def elapsed_s(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at

    def _finish(self, state: TransferState, reason: str | None) -> None:
        self._state, self._reason = state, reason
        self.finished_at = time.monotonic()
        if state is TransferState.FAILED:
            logger.warning("KV read from peer %s failed: %s", self.peer, reason)
        self._transport._release_xfer(self._xfer)
        self._xfer = None

    def __repr__(self) -> str:
        return f"KVRead(peer={self.peer!r}, bytes={self.num_bytes}, state={self._state.name})"


@dataclass(slots=True)
class _Peer:
    agent_name: str
    regions: KVRegions
    prepped: Any  # nixl_prepped_dlist_handle of the peer's block planes


def _import_nixl() -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """nixl's agent and config classes, and the exception classes its bindings raise (they share no base)."""
    try:
        from nixl import _api
    except ImportError as e:
        raise TransportError(
            "NIXL is not installed or not loadable (`pip install nixl` with nixl-cu12/cu13); "
            f"the NIXL transport cannot start: {e}"
        ) from e
    bindings = _api.nixlBind
    errors = tuple(
        getattr(bindings, name) for name in dir(bindings) if name.startswith("nixl") and name.endswith("Error")
    )
    return _api.nixl_agent, _api.nixl_agent_config, errors


class NixlKVTransport:
    """One NIXL agent (UCX backend by default) moving KV blocks of registered caches between engines.

    Not thread-safe: one worker thread drives it, as vLLM's worker does.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        backends: Sequence[str] = ("UCX",),
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        num_threads: int = 0,
    ):
        if transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s}")
        nixl_agent, nixl_agent_config, self._nixl_errors = _import_nixl()
        self.engine_id = engine_id
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self.transfer_timeout_s = transfer_timeout_s
        self._backends = list(backends)
        try:
            config = nixl_agent_config(backends=self._backends, num_threads=num_threads)
            self._agent = nixl_agent(self.agent_name, config)
        except (RuntimeError, *self._nixl_errors) as e:  # RuntimeError: no NIXL plugins found
            raise TransportError(f"cannot start NIXL agent {self.agent_name} with {self._backends}: {e}") from e
        missing = [b for b in self._backends if b not in self._agent.backends]
        if missing:
            raise TransportError(
                f"NIXL agent {self.agent_name} has no {missing} backend (plugins: {self._agent.plugin_list})"
            )
        self._regions: KVRegions | None = None
        self._reg_descs: Any = None
        self._local_prepped: Any = None
        self._peers: dict[str, _Peer] = {}
        self._unreleased: list[Any] = []
        self._closed = False
        logger.info("NIXL transport for engine %s started as agent %s", engine_id, self.agent_name)

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, caches: Mapping[str, torch.Tensor], block_len_bytes: int) -> KVRegions:
        """Register every layer's cache and prepare its block planes; returns ``kv_regions()``.

        A cache is ``[2, num_blocks, ...]`` (K and V planes apart) or
        ``[num_blocks, ...]`` (one plane per block, as MLA), contiguous, on
        CPU or one CUDA device; every layer has the same shape.
        """
        if self._regions is not None:
            raise TransportError(f"engine {self.engine_id}: KV caches are already registered")
        if not caches or block_len_bytes <= 0:
            raise TransportError(f"engine {self.engine_id}: need >= 1 cache and block_len_bytes > 0")
        region_addrs: list[int] = []
        first = next(iter(caches.values()))
        for name, cache in caches.items():
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise TransportError(f"layer {name}: cache {tuple(cache.shape)} differs from the first layer's")
            if not cache.is_contiguous():
                raise TransportError(f"layer {name}: cache must be contiguous")
            num_regions = 2 if cache.dim() >= 2 and cache.shape[0] == 2 else 1
            num_blocks = cache.shape[1] if num_regions == 2 else cache.shape[0]
            if cache.numel() * cache.element_size() != num_regions * num_blocks * block_len_bytes:
                raise TransportError(
                    f"layer {name}: {num_regions} x {num_blocks} blocks of {block_len_bytes} bytes "
                    f"do not make up its cache of {tuple(cache.shape)} {cache.dtype}"
                )
            region_bytes = num_blocks * block_len_bytes
            region_addrs += [cache.data_ptr() + i * region_bytes for i in range(num_regions)]
        on_cuda = first.device.type == "cuda"
        regions = KVRegions(
            layer_names=tuple(caches),
            region_addrs=tuple(region_addrs),
            num_blocks=num_blocks,
            block_len_bytes=block_len_bytes,
            mem_type="VRAM" if on_cuda else "DRAM",
            device_id=first.device.index or 0,
        )
        whole = [(c.data_ptr(), c.numel() * c.element_size(), regions.device_id, "") for c in caches.values()]
        try:
            self._reg_descs = self._agent.register_memory(whole, regions.mem_type, backends=self._backends)
            self._local_prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", regions.descriptors(), regions.mem_type, backends=self._backends
            )
        except self._nixl_errors as e:
            raise TransportError(f"engine {self.engine_id}: registering KV caches with NIXL failed: {e}") from e
        self._regions = regions
        logger.info(
            "engine %s registered %d layers, %d block planes of %d bytes",
            self.engine_id,
            len(caches),
            len(region_addrs) * num_blocks,
            block_len_bytes,
        )
        return regions

    def kv_regions(self) -> KVRegions:
        return self._require_regions()

    def agent_metadata(self) -> bytes:
        """This agent's NIXL metadata, for a peer's ``add_peer`` (send it after ``register_kv_caches``)."""
        return self._agent.get_agent_metadata()

    # ------------------------------------------------------------ peers

    def add_peer(self, engine_id: str, metadata: bytes, regions: KVRegions) -> str:
        """Learn a source engine's agent and prepare its block planes; returns its NIXL agent name."""
        local = self._require_regions()
        if engine_id in self._peers:
            raise TransportError(f"peer engine {engine_id} is already added")
        problems = [
            f"{field} differs: local {getattr(local, field)}, remote {getattr(regions, field)}"
            for field in ("layer_names", "block_len_bytes")
            if getattr(local, field) != getattr(regions, field)
        ]
        if len(local.region_addrs) != len(regions.region_addrs):
            problems.append(f"{len(regions.region_addrs)} remote regions, {len(local.region_addrs)} local")
        if problems:
            raise TransportError(f"cannot read KV from engine {engine_id}: " + "; ".join(problems))
        try:
            agent_name = self._agent.add_remote_agent(metadata)
        except self._nixl_errors as e:
            raise TransportError(f"cannot load NIXL metadata of engine {engine_id}: {e}") from e
        try:
            prepped = self._agent.prep_xfer_dlist(
                agent_name, regions.descriptors(), regions.mem_type, backends=self._backends
            )
        except self._nixl_errors as e:
            self._agent.remove_remote_agent(agent_name)
            raise TransportError(f"cannot prepare block descriptors of engine {engine_id}: {e}") from e
        self._peers[engine_id] = _Peer(agent_name, regions, prepped)
        logger.info("engine %s added peer engine %s (agent %s)", self.engine_id, engine_id, agent_name)
        return agent_name

    def remove_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        try:
            peer.prepped.release()
            self._agent.remove_remote_agent(peer.agent_name)
        except self._nixl_errors as e:  # a dead peer may fail to disconnect cleanly; it is gone either way
            logger.warning("engine %s: removing peer engine %s: %s", self.engine_id, engine_id, e)

    # ------------------------------------------------------------ transfers

    def read_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notify: bytes = b"",
        *,
        timeout_s: float | None = None,
    ) -> KVRead:
        """Post one READ of the given blocks (every layer, K and V) from ``peer`` into local blocks.

        ``notify`` reaches the peer's ``poll_notifications()`` when the READ is
        done. A READ NIXL refuses to post comes back FAILED, not raised; bad
        block ids or an unknown peer raise.
        """
        local = self._require_regions()
        if peer not in self._peers:
            raise TransportError(f"engine {self.engine_id}: unknown peer engine {peer}; call add_peer first")
        remote = self._peers[peer]
        local_ids = _check_block_ids(local_block_ids, local.num_blocks, "local")
        remote_ids = _check_block_ids(remote_block_ids, remote.regions.num_blocks, "remote")
        if len(local_ids) != len(remote_ids):
            raise BlockMappingError(f"{len(local_ids)} local block ids for {len(remote_ids)} remote block ids")
        num_regions = len(local.region_addrs)
        local_idx = _plane_indices(local_ids, num_regions, local.num_blocks)
        remote_idx = _plane_indices(remote_ids, num_regions, remote.regions.num_blocks)
        timeout = self.transfer_timeout_s if timeout_s is None else timeout_s
        read = KVRead(self, peer, len(local_idx) * local.block_len_bytes, time.monotonic() + timeout)
        if len(local_idx) == 0:
            read._finish(TransferState.DONE, None)
            return read
        try:
            read._xfer = self._agent.make_prepped_xfer(
                "READ", self._local_prepped, local_idx, remote.prepped, remote_idx, notif_msg=notify
            )
            status = self._agent.transfer(read._xfer)
        except self._nixl_errors as e:
            read._finish(TransferState.FAILED, f"posting the READ from {peer} failed: {e}")
            return read
        if status == "DONE":
            read._finish(TransferState.DONE, None)
        elif status != "PROC":
            read._finish(TransferState.FAILED, f"NIXL reported {status} posting the READ from {peer}")
        return read

    def poll(self, read: KVRead) -> TransferState:
        return read.poll()

    def release(self, read: KVRead) -> None:
        """Give up a read: a pending one is aborted; a final one holds nothing already."""
        read.abort("released while pending")

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Messages peers attached to READs of our blocks that completed, as ``(agent_name, message)``."""
        notifs = self._agent.get_new_notifs()
        return [(agent, message) for agent, messages in notifs.items() for message in messages]

    def close(self) -> None:
        """Release peers, descriptors and memory registrations; the transport is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        for xfer in self._unreleased:
            self._release_xfer(xfer, retry=False)
        try:
            if self._local_prepped is not None:
                self._local_prepped.release()
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs, backends=self._backends)
        except self._nixl_errors as e:
            logger.warning("engine %s: releasing NIXL registrations: %s", self.engine_id, e)

    def __enter__(self) -> NixlKVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _require_regions(self) -> KVRegions:
        if self._closed:
            raise TransportError(f"engine {self.engine_id}: transport is closed")
        if self._regions is None:
            raise TransportError(f"engine {self.engine_id}: register_kv_caches first")
        return self._regions

    def _release_xfer(self, xfer: Any, retry: bool = True) -> None:
        # Releasing an active READ asks NIXL to cancel it; if it cannot yet, keep
        # the handle and try again at close() rather than free memory under a transfer.
        if xfer is None:
            return
        try:
            self._agent.release_xfer_handle(xfer)
        except self._nixl_errors as e:
            if retry:
                self._unreleased.append(xfer)
            logger.debug("engine %s: NIXL handle not released yet: %s", self.engine_id, e)


def _check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise BlockMappingError(f"{side} block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
    return ids


def _plane_indices(block_ids: np.ndarray, num_regions: int, num_blocks: int) -> np.ndarray:
    """Descriptor indices of every region's plane of each block: region-major, blocks in the given order."""
    offsets = np.arange(num_regions, dtype=np.int64)[:, None] * num_blocks
    return (offsets + block_ids[None, :]).ravel().astype(np.int32)
