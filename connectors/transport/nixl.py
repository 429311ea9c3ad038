"""Block transport over NIXL: one agent per worker, one batched READ per request and peer.

A *peer* is one remote TP rank: its own NIXL agent and caches. Life of a read,
from the reading (decode) side:

1. Both sides ``register_kv_caches``: every layer's cache is registered with
   the agent as *regions* of block planes (one block of one layer's K, V, or
   both as in vLLM's CPU cache; ``block_len_bytes`` long).
2. The reader learns a source rank with ``add_peer(peer, payload, regions,
   ranges)``: ``payload`` is the source's ``handshake_payload()`` (its NIXL agent metadata), ``regions``
   its ``kv_regions()``, ``ranges`` the ``PlaneRanges`` this rank reads from it
   (``connectors.block_ranges``: its head slice, remote block size dividing
   ours). Both descriptor lists are prepared here, once: the source's runs of
   every block, and the runs' places in every local block and sub-block (that
   local list is shared by peers with the same runs). Without ``ranges`` a
   peer's whole planes go 1:1 into ours (equal caches).
3. ``read_blocks(peer, local_block_ids, remote_block_ids, notify)`` posts ONE
   READ covering every run of every layer of those blocks, straight into the
   local cache, and returns a ``KVRead``. Its state machine is PENDING -> DONE
   | FAILED; a read still PENDING at its deadline becomes FAILED, so nothing
   waits forever.
4. When the READ completes NIXL hands ``notify`` to the source, which sees it
   in ``poll_notifications()`` and may free the blocks.

``block_ranges.read_indices`` picks a read's local and remote descriptor
indices so that they line up element by element.

Progress. NIXL's UCX backend completes a READ only while *both* agents make
progress (the reader's ``check_xfer_state``, and the source's own progress:
a source that never calls into NIXL leaves the READ pending for ever, even
with the bytes already copied). NIXL's progress thread provides the source's,
but NIXL's Python API builds every agent with ``pthrDelay = 0``: the thread's
``poll()`` then has a 0 ms timeout and spins a core for as long as the agent
lives (``nixlUcxSharedThread::run``: 98 % of a core for one idle
agent). ``progress="thread"`` (the default) keeps NIXL's thread, woken by
UCX's event fd, with a fallback wake-up every ``progress_wake_us`` instead of
never sleeping (0.3 % of a core idle at 10 ms; READs as fast as with the
spinning thread: ``scripts/bench_transport.py``). ``progress="caller"`` runs
no thread: the agent progresses only inside this transport's own calls (the
connector polls every engine step, and vLLM keeps stepping an engine that
holds blocks for a reader), the fallback when the thread cannot be tuned.

``nixl`` is imported only here, when a transport is built; torch only where
tensors are inspected.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.block_ranges import (
    KVRegions,
    PlaneRanges,
    local_descriptors,
    read_indices,
    remote_descriptors,
)
from connectors.errors import TransportError
from connectors.transport.base import ReadState, TransferState, cache_regions, checked_ranges

if TYPE_CHECKING:
    import torch

__all__ = ["KVRead", "KVRegions", "NixlKVTransport", "TransferState"]

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
# Upper bound on one prepared descriptor list. Token-major (NH2D) caches read
# by head slice need one run per token (or per row across layouts): this fails
# add_peer with a clear reason instead of preparing gigabytes of descriptors.
DEFAULT_MAX_DESCRIPTORS = 1 << 24
# How often NIXL's progress thread wakes when no UCX event woke it (NIXL rounds up to whole ms).
DEFAULT_PROGRESS_WAKE_US = 10_000
# "nixl": NIXL's own default (its thread, never sleeping): only a reference for benchmarks.
PROGRESS_MODES = ("thread", "caller", "nixl")


class KVRead(ReadState):
    """One posted READ of a request's blocks from one peer: a small state machine.

    ``poll()`` advances it, ``abort()`` ends it as FAILED, ``failure_exception()``
    says why it failed. The NIXL handle is released as soon as the read is final.
    ``drained`` only once NIXL accepted that release: NIXL releases a handle whose
    READ is over (done or failed), or one it could cancel; a READ it can neither
    finish nor cancel keeps its handle, may still land, and is not drained. An
    aborted READ's handle is offered again at each ``poll``.
    """

    def __init__(self, transport: NixlKVTransport, peer: str, num_bytes: int, deadline: float):
        super().__init__(peer, num_bytes, deadline)
        self._transport = transport
        self._xfer: Any = None

    @property
    def drained(self) -> bool:
        return self._state is not TransferState.PENDING and self._xfer is None

    def poll(self) -> TransferState:
        """Check NIXL once (no blocking) and return the state, failing the read past its deadline."""
        if self._state is not TransferState.PENDING:
            if self._xfer is not None:
                self._release()
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
        """End a pending read as FAILED and ask NIXL to cancel it (``drained`` says whether it could); a final
        read is left as it is."""
        if self._state is TransferState.PENDING:
            self._finish(TransferState.FAILED, reason)

    def failure_exception(self) -> TransportError | None:
        """The error to raise for a FAILED read; None otherwise."""
        if self._state is not TransferState.FAILED:
            return None
        return TransportError(self._reason or f"READ from {self.peer} failed")

    def _finish(self, state: TransferState, reason: str | None) -> None:
        super()._finish(state, reason)
        self._release()

    def _release(self) -> None:
        if self._transport._release_xfer(self._xfer):
            self._xfer = None
            self._transport._undrained.discard(self)
        else:
            self._transport._undrained.add(self)


@dataclass(slots=True)
class _LocalList:
    """A prepared local descriptor list, shared by the peers whose runs land in the same places."""

    prepped: Any  # nixl_prepped_dlist_handle
    users: int


@dataclass(slots=True)
class _Peer:
    agent_name: str
    regions: KVRegions
    ranges: PlaneRanges
    prepped: Any  # nixl_prepped_dlist_handle of the peer's runs
    local_key: tuple[object, ...]


def _import_nixl(api: Any = None) -> tuple[Any, tuple[type[Exception], ...]]:
    """nixl's ``_api`` module (or ``api``, a stand-in of it), and the exception classes its bindings raise (they
    share no base)."""
    if api is not None:
        _api = api
    else:
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
    return _api, errors


_AGENT_LOCK = threading.Lock()


class WakeEvery:
    """Stands in for ``nixl._api.nixlBind`` while one agent is built: the agent's progress thread gets a
    wake-up interval instead of the API's hard-coded 0 (a spinning thread); everything else is the module."""

    def __init__(self, bindings: Any, wake_us: int):
        self._bindings, self._wake_us = bindings, max(1000, wake_us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - the binding's name
        config.pthrDelay = self._wake_us
        return self._bindings.nixlAgent(name, config)


def wake_every_agent(wake_us: int = DEFAULT_PROGRESS_WAKE_US) -> bool:
    """Every NIXL agent this process builds from now on gets a progress thread that sleeps between UCX events,
    waking at least every ``wake_us``: vLLM's NixlConnector's too (``connectors.vllm_plugin``), which no
    setting of vLLM's reaches. False where NIXL is not installed or its API has no ``nixlBind``."""
    try:
        api, _ = _import_nixl()
    except TransportError:
        return False
    if not hasattr(api, "nixlBind"):
        return False
    with _AGENT_LOCK:
        if not isinstance(api.nixlBind, WakeEvery):
            api.nixlBind = WakeEvery(api.nixlBind, wake_us)
    return True


def make_agent(
    name: str,
    backends: Sequence[str],
    num_threads: int = 0,
    progress: str = "thread",
    wake_us: int = 0,
    nixl_api: Any = None,
) -> tuple[Any, str]:
    """A NIXL agent with the given progress mode; returns ``(agent, mode it got)``.

    ``"thread"`` needs the API's module-level ``nixlBind`` (where NIXL reads its
    binding); without it the agent falls back to ``"caller"``, never to a
    spinning thread.
    """
    if progress not in PROGRESS_MODES:
        raise TransportError(f"progress must be one of {PROGRESS_MODES}, got {progress!r}")
    api, _ = _import_nixl(nixl_api)
    if progress == "thread" and not hasattr(api, "nixlBind"):
        logger.warning("NIXL %s: cannot set its progress thread's wake-up; progressing from our calls", name)
        progress = "caller"
    config = api.nixl_agent_config(
        enable_prog_thread=progress != "caller", backends=list(backends), num_threads=num_threads
    )
    if progress != "thread":
        return api.nixl_agent(name, config), progress
    with _AGENT_LOCK:
        bindings = api.nixlBind
        api.nixlBind = WakeEvery(bindings, wake_us)
        try:
            return api.nixl_agent(name, config), progress
        finally:
            api.nixlBind = bindings


class NixlKVTransport:
    """One NIXL agent (UCX backend by default) moving KV blocks of registered caches between engines.

    Not thread-safe: one worker thread drives it, as vLLM's worker does.
    """

    name = "nixl"
    notifies_source = True

    def __init__(
        self,
        engine_id: str,
        *,
        backends: Sequence[str] = ("UCX",),
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        num_threads: int = 0,
        max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
        progress: str = "thread",
        progress_wake_us: int = DEFAULT_PROGRESS_WAKE_US,
        nixl_api: Any = None,
    ):
        """``nixl_api``: NIXL's Python API module (``nixl._api`` when None); tests give a stand-in of it."""
        if transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s}")
        self.max_descriptors = max_descriptors
        _, self._nixl_errors = _import_nixl(nixl_api)
        self.engine_id = engine_id
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        self.transfer_timeout_s = transfer_timeout_s
        self._backends = list(backends)
        try:
            self._agent, self.progress = make_agent(
                self.agent_name, self._backends, num_threads, progress, progress_wake_us, nixl_api
            )
        except (RuntimeError, *self._nixl_errors) as e:  # RuntimeError: no NIXL plugins found
            raise TransportError(f"cannot start NIXL agent {self.agent_name} with {self._backends}: {e}") from e
        missing = [b for b in self._backends if b not in self._agent.backends]
        if missing:
            raise TransportError(
                f"NIXL agent {self.agent_name} has no {missing} backend (plugins: {self._agent.plugin_list})"
            )
        self._regions: KVRegions | None = None
        self._reg_descs: Any = None
        self._local_lists: dict[tuple[object, ...], _LocalList] = {}
        self._peers: dict[str, _Peer] = {}
        self._undrained: set[KVRead] = set()  # aborted READs whose handle NIXL has not let go of
        self._closed = False
        logger.info(
            "NIXL transport for engine %s started as agent %s (progress: %s)", engine_id, self.agent_name, self.progress
        )

    # ------------------------------------------------------------ registration

    def register_kv_caches(
        self, caches: Mapping[str, torch.Tensor], block_len_bytes: int, *, planes_per_layer: int | None = None
    ) -> KVRegions:
        """Register every layer's cache; returns ``kv_regions()``.

        A cache is ``[num_blocks, ...]`` (one plane per block: every layout
        vLLM 0.32 hands over) or ``[2, num_blocks, ...]`` (two planes per
        block), dense in memory, on CPU or one CUDA device; every layer has the
        same shape. ``planes_per_layer`` (1 or 2) says which; by default a
        leading dim of 2 means two planes.
        """
        if self._regions is not None:
            raise TransportError(f"engine {self.engine_id}: KV caches are already registered")
        regions = cache_regions(caches, block_len_bytes, planes_per_layer, self.engine_id)
        whole = [(c.data_ptr(), c.numel() * c.element_size(), regions.device_id, "") for c in caches.values()]
        try:
            self._reg_descs = self._agent.register_memory(whole, regions.mem_type, backends=self._backends)
        except self._nixl_errors as e:
            raise TransportError(f"engine {self.engine_id}: registering KV caches with NIXL failed: {e}") from e
        self._regions = regions
        logger.info(
            "engine %s registered %d layers, %d block planes of %d bytes",
            self.engine_id,
            len(caches),
            len(regions.region_addrs) * regions.num_blocks,
            block_len_bytes,
        )
        return regions

    def kv_regions(self) -> KVRegions:
        return self._require_regions()

    def handshake_payload(self) -> bytes:
        """This agent's NIXL metadata, for a peer's ``add_peer`` (send it after ``register_kv_caches``)."""
        return self._agent.get_agent_metadata()

    # ------------------------------------------------------------ peers

    def cannot_read(self, payload: bytes) -> str | None:
        """NIXL reaches any peer whose agent metadata it gets (UCX picks the path when the READ is posted)."""
        return None if payload else "no NIXL agent metadata"

    def add_peer(self, peer: str, payload: bytes, regions: KVRegions, ranges: PlaneRanges | None = None) -> str:
        """Learn a source rank's agent, prepare the descriptors of reading ``ranges`` from it; returns its agent name.

        Without ``ranges`` the peer's caches must equal ours and whole planes go 1:1.
        """
        local = self._require_regions()
        if peer in self._peers:
            raise TransportError(f"peer {peer} is already added")
        ranges = checked_ranges(peer, local, regions, ranges)
        self._check_descriptor_counts(peer, regions, ranges)
        local_key = ranges.local_key()
        try:
            agent_name = self._agent.add_remote_agent(payload)
        except self._nixl_errors as e:
            raise TransportError(f"cannot load NIXL metadata of peer {peer}: {e}") from e
        try:
            prepped = self._agent.prep_xfer_dlist(
                agent_name, remote_descriptors(ranges, regions), regions.mem_type, backends=self._backends
            )
        except self._nixl_errors as e:
            self._agent.remove_remote_agent(agent_name)
            raise TransportError(f"cannot prepare block descriptors of peer {peer}: {e}") from e
        try:
            self._use_local_list(local_key, ranges, local)
        except TransportError:
            prepped.release()
            self._agent.remove_remote_agent(agent_name)
            raise
        self._peers[peer] = _Peer(agent_name, regions, ranges, prepped, local_key)
        logger.info(
            "engine %s added peer %s (agent %s): %d run(s) of %d bytes per block and layer, block size ratio %d",
            self.engine_id,
            peer,
            agent_name,
            ranges.num_runs,
            ranges.bytes_per_block,
            ranges.ratio,
        )
        return agent_name

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        try:
            entry.prepped.release()
            self._agent.remove_remote_agent(entry.agent_name)
        except self._nixl_errors as e:  # a dead peer may fail to disconnect cleanly; it is gone either way
            logger.warning("engine %s: removing peer %s: %s", self.engine_id, peer, e)
        self._drop_local_list(entry.local_key)

    def _check_descriptor_counts(self, peer: str, regions: KVRegions, ranges: PlaneRanges) -> None:
        """Refuse descriptor lists too large for NIXL to prepare."""
        local = self._require_regions()
        counts = {
            "remote": local.num_layers * regions.num_blocks * ranges.num_runs,
            "local": local.num_layers * local.num_blocks * ranges.ratio * ranges.num_runs,
        }
        problems = [
            f"{count} {side} descriptors exceed the limit of {self.max_descriptors} "
            f"({ranges.num_runs} runs per block and layer: a token-major NH2D cache read by head slice; "
            "prefer HN2D)"
            for side, count in counts.items()
            if count > self.max_descriptors
        ]
        if problems:
            raise TransportError(f"cannot read KV from peer {peer}: " + "; ".join(problems))

    def _use_local_list(self, key: tuple[object, ...], ranges: PlaneRanges, local: KVRegions) -> None:
        shared = self._local_lists.get(key)
        if shared is not None:
            shared.users += 1
            return
        try:
            prepped = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", local_descriptors(ranges, local), local.mem_type, backends=self._backends
            )
        except self._nixl_errors as e:
            raise TransportError(f"engine {self.engine_id}: cannot prepare local block descriptors: {e}") from e
        self._local_lists[key] = _LocalList(prepped, 1)

    def _drop_local_list(self, key: tuple[object, ...]) -> None:
        shared = self._local_lists.get(key)
        if shared is None:
            return
        shared.users -= 1
        if shared.users > 0:
            return
        del self._local_lists[key]
        try:
            shared.prepped.release()
        except self._nixl_errors as e:
            logger.warning("engine %s: releasing a local descriptor list: %s", self.engine_id, e)

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
        """Post one READ of the given blocks (every layer, every run) from ``peer`` into local blocks.

        Remote block q fills sub-block ``q % ratio`` of local block ``q // ratio``
        (``ratio`` of the peer's ranges; 1 pairs the lists position by
        position). ``notify`` reaches the peer's ``poll_notifications()`` when
        the READ is done. A READ NIXL refuses to post comes back FAILED, not
        raised; bad block ids or an unknown peer raise.
        """
        local = self._require_regions()
        if peer not in self._peers:
            raise TransportError(f"engine {self.engine_id}: unknown peer {peer}; call add_peer first")
        remote = self._peers[peer]
        local_idx, remote_idx = read_indices(
            remote.ranges,
            local_block_ids,
            remote_block_ids,
            num_layers=local.num_layers,
            local_num_blocks=local.num_blocks,
            remote_num_blocks=remote.regions.num_blocks,
        )
        timeout = self.transfer_timeout_s if timeout_s is None else timeout_s
        num_bytes = len(remote_block_ids) * local.num_layers * remote.ranges.bytes_per_block
        read = KVRead(self, peer, num_bytes, time.monotonic() + timeout)
        if len(local_idx) == 0:
            read._finish(TransferState.DONE, None)
            return read
        local_list = self._local_lists[remote.local_key].prepped
        try:
            read._xfer = self._agent.make_prepped_xfer(
                "READ", local_list, local_idx, remote.prepped, remote_idx, notif_msg=notify
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
        for peer in list(self._peers):
            self.remove_peer(peer)
        for read in list(self._undrained):
            self._release_xfer(read._xfer)
        try:
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

    def _release_xfer(self, xfer: Any) -> bool:
        """Give ``xfer``'s handle back to NIXL; whether NIXL took it (it refuses one whose READ is active and
        cannot be cancelled: that READ may still land)."""
        if xfer is None:
            return True
        try:
            self._agent.release_xfer_handle(xfer)
        except self._nixl_errors as e:
            logger.debug("engine %s: NIXL handle not released yet: %s", self.engine_id, e)
            return False
        return True
