"""Worker side of the pdserve connector (pull mode): registers the KV caches, reads blocks, keeps leases.

One ``PdserveWorker`` per TP rank. On both sides:

- ``register_kv_caches``: this rank's ``KVTopology`` (layout from the cache
  tensor: H2ND for vLLM's CPU cache), one ``NixlKVTransport`` over the cache
  tensors, and a ``SideChannelServer`` on ``side_channel_port + tp_rank`` that
  answers handshakes with this agent's metadata and regions, and takes releases.

Decode engine, ``start_load_kv``, for each request the scheduler side asks to receive:

1. ``source_ranks`` says which prefill ranks this rank reads (from the prefill
   TP size in ``kv_transfer_params``): one when prefill TP <= decode TP, several
   when it is larger, one holder per head when heads are replicated.
2. Each of those ranks must be a known peer: a handshake with
   ``remote_port + rank`` runs on a background thread, once per remote rank
   (``HandshakeCache``); ``add_peer`` then prepares the runs this rank reads
   from it (``block_ranges.plan_peer_ranges``: its head slice, several remote
   blocks per local block when the remote block size is smaller). The request
   waits for its ranks without holding up the engine's step.
3. One READ per remote rank, straight into the local cache, each notifying
   ``read_notification(prefill request id, readers of that rank)``. Decode rank
   0 also releases the prefill ranks nobody reads (replicas), so they free
   their blocks at once.

``transfer_results`` polls the reads: a request whose READs are all DONE is
"finished receiving"; if one FAILED the others are aborted, the request is
"finished receiving" too, its local block ids go to
``get_block_ids_with_load_errors`` so vLLM recomputes those tokens, and every
prefill rank is told to release its blocks at once.

Prefill engine: ``start_load_kv`` puts the blocks of finished requests under a
``LeaseTable`` lease; ``transfer_results`` turns READ notifications (which say
how many decode ranks will read this rank) and releases into lease ends,
expires leases, and reports the ended ones as "finished sending" so vLLM
frees their blocks.

Every load ends in a per-request report (``build_connector_worker_meta``),
also kept for the proxy's report queries on the side channel (a stream's
``X-PDServe-KV``), and every event in ``PdserveKVStats`` (``get_kv_connector_stats``).
Pull mode moves nothing during the forward pass: the per-layer hooks are no-ops.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.auth import KVAuth, Unauthenticated
from connectors.block_ranges import KVRegions, plan_peer_ranges
from connectors.errors import ConnectorError, HandshakeRejected, TopologyError
from connectors.handshake import HandshakeCache, HandshakeResponse, encode_response
from connectors.identity import model_identity
from connectors.leases import LeaseState, LeaseTable, parse_read_notification, read_notification
from connectors.metadata import ConnectorSettings, PdserveConnectorMetadata, ReceiveSpec
from connectors.side_channel import RecentReports, ReleaseSender, SideChannelServer, report_key, request_handshake
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from connectors.topology import KVLayout, KVTopology, reader_ranks, source_ranks
from connectors.transport import choose_transport, node_identity, where
from connectors.transport.base import TransferState
from connectors.transport.nixl import KVRead, NixlKVTransport

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PdserveWorker", "describe_kv_cache"]

logger = logging.getLogger(__name__)

_LEASE_OUTCOMES = {LeaseState.READ: "read", LeaseState.RELEASED: "released", LeaseState.EXPIRED: "expired"}


@dataclass(slots=True)
class _Failure:
    spec: ReceiveSpec
    kind: str  # one of connectors.stats.FAILURE_KINDS
    reason: str


@dataclass(slots=True)
class _Handshake:
    """A handshake with one remote rank, running on the handshake pool."""

    engine_id: str
    tp_rank: int
    tp_size: int
    future: Future[HandshakeResponse]


@dataclass(slots=True)
class _SourceRank:
    """A remote rank added to the transport: its topology, and how many local ranks read it."""

    topology: KVTopology
    expected_reads: int
    transport: str


@dataclass(slots=True)
class _RequestReads:
    """One request's READs, one per remote rank it reads."""

    spec: ReceiveSpec
    reads: list[KVRead]


@dataclass(slots=True)
class _LeaseEvent:
    """A READ notification or release that came before this worker held the lease."""

    what: str  # "read" or "release"
    reader: str
    expected_reads: int | None
    seen_at: float


def peer_name(engine_id: str, tp_rank: int) -> str:
    """The transport's name of a remote engine's rank."""
    return f"{engine_id}/rank{tp_rank}"


def check_servable(kv_cache_config: KVCacheConfig, engine_id: str) -> None:
    """Refuse, when the engine starts, a model whose KV this connector cannot move: more than one KV
    cache group (hybrid models: sliding-window or Mamba layers beside full attention)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise ValueError(
            f"engine {engine_id}: the pdserve connector moves one KV cache group, and this model has "
            f"{len(groups)} ({kinds}: a hybrid model); serve it with connector 'vllm-nixl' or without P/D"
        )


def engine_model_identity(model_config: Any) -> str:
    """``connectors.identity.model_identity`` of the engine's model: its configuration (without fields that
    name where it was loaded from) and its weights."""
    config = {
        k: v
        for k, v in model_config.hf_config.to_dict().items()
        if not k.startswith("_") and k != "transformers_version"
    }
    return model_identity(model_config.model, json.dumps(config, sort_keys=True, default=str), model_config.revision)


def describe_kv_cache(cache: torch.Tensor, num_heads: int, head_dim: int) -> tuple[KVLayout, int, int]:
    """``(layout, block_size, planes_per_layer)`` of one layer's vLLM KV cache tensor on this rank.

    vLLM's CPU cache is ``[num_blocks, heads, block_size, 2 * head_dim]`` (K then
    V per head: H2ND, one plane); GPU backends hand ``[2, num_blocks,
    block_size, heads, head_dim]`` whose strides say whether memory is NHD or
    HND (K and V planes apart).
    """
    shape = tuple(cache.shape)
    if len(shape) == 4 and shape[1] == num_heads and shape[3] == 2 * head_dim:
        return KVLayout.H2ND, shape[2], 1
    if len(shape) == 5 and shape[0] == 2 and shape[4] == head_dim:
        if shape[3] == num_heads:
            layout = KVLayout.HND if cache.stride(3) > cache.stride(2) else KVLayout.NHD
            return layout, shape[2], 2
        if shape[2] == num_heads:
            layout = KVLayout.NHD if cache.stride(2) < cache.stride(3) else KVLayout.HND
            return layout, shape[3], 2
    raise ConnectorError(
        f"unsupported KV cache shape {shape} for {num_heads} KV heads of size {head_dim} on this rank; expected "
        "[num_blocks, heads, block_size, 2*head_dim] (CPU) or [2, num_blocks, block_size, heads, head_dim]"
    )


class PdserveWorker:
    """The worker-side half of ``PdserveConnector``; one per TP rank, driven by the model runner's thread."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        check_servable(kv_cache_config, engine_id)
        self.settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config, engine_id
        )
        self.lease_ttl_s = self.settings.lease_ttl_s
        self.engine_id = engine_id
        self._auth = KVAuth.from_env()
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._transport: NixlKVTransport | None = None
        self._server: SideChannelServer | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._stats = PdserveKVStats()
        self._reports: dict[str, dict[str, Any]] = {}
        self._answered = RecentReports()  # read by the side-channel thread
        self._releases_out = ReleaseSender(engine_id, self._auth)
        # decode side; remote ranks are keyed by peer_name(engine_id, rank)
        self._handshakes = HandshakeCache()
        self._handshake_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-handshake")
        self._handshaking: dict[str, _Handshake] = {}
        self._peers: dict[str, _SourceRank] = {}
        self._peer_failures: dict[str, tuple[str, str]] = {}  # failed handshakes: (kind, reason)
        self._waiting_for_peer: dict[str, tuple[ReceiveSpec, tuple[int, ...]]] = {}
        self._reads: dict[str, _RequestReads] = {}
        self._failed_now: list[_Failure] = []
        self._load_error_block_ids: set[int] = set()
        self._faults = random.Random(self.settings.fault_seed)
        # prefill side
        self._leases = LeaseTable(self.lease_ttl_s, engine_id=engine_id)
        self._holding: set[str] = set()
        # A READ notification or a release can arrive before this worker learns of
        # the lease (the hold comes with the next scheduler step): keep them until then.
        self._early: dict[str, list[_LeaseEvent]] = {}
        self._releases_in: queue.SimpleQueue[str] = queue.SimpleQueue()  # from the side-channel thread

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], tp_rank: int | None = None) -> None:
        """Register this rank's caches and open its side channel; ``tp_rank`` defaults to vLLM's."""
        if tp_rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        first = next(iter(kv_caches.values()))
        model_config = self._vllm_config.model_config
        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        total_heads = model_config.get_total_num_kv_heads()
        head_dim = model_config.get_head_size()
        layout, block_size, planes = describe_kv_cache(first, max(1, total_heads // tp_size), head_dim)
        tensor_blocks = first.shape[1] if planes == 2 else first.shape[0]
        # vLLM's block ids are logical; a kernel may cut each into several physical blocks.
        logical_blocks = self._kv_cache_config.num_blocks
        if logical_blocks and tensor_blocks % logical_blocks == 0:
            self._kernel_blocks_per_block = tensor_blocks // logical_blocks
        self._topology = KVTopology(
            tp_size=tp_size,
            tp_rank=tp_rank,
            total_num_kv_heads=total_heads,
            block_size=block_size,
            layout=layout,
            head_dim=head_dim,
            dtype=str(first.dtype),
            num_layers=len(kv_caches),
            model_identity=engine_model_identity(model_config),
        )
        self._transport = NixlKVTransport(self.engine_id, transfer_timeout_s=self.settings.transfer_timeout_s)
        regions = self._transport.register_kv_caches(
            kv_caches, self._topology.block_plane_bytes, planes_per_layer=planes
        )
        response = HandshakeResponse(
            engine_id=self.engine_id,
            topology=self._topology,
            agent_metadata=self._transport.handshake_payload(),
            kv_caches_base_addr=regions.region_addrs,
            block_len=regions.block_len_bytes,
            num_blocks=regions.num_blocks,
            transports=(self._transport.name,),
            node=node_identity(),
        )
        self._server = SideChannelServer(
            self.engine_id,
            self.settings.side_channel_host,
            self.settings.side_channel_port + tp_rank,
            self._topology,
            encode_response(response),
            self._auth,
            on_release=self._releases_in.put,
            on_report=self._answered.encoded,
            answer_delay_s=self.settings.handshake_delay_s,
        )
        logger.info(
            "engine %s rank %d/%d: KV caches %s (%s) x %d layers, %d kernel block(s) per block, side channel %s",
            self.engine_id,
            tp_rank,
            tp_size,
            tuple(first.shape),
            layout,
            len(kv_caches),
            self._kernel_blocks_per_block,
            self._server.endpoint,
        )

    # ------------------------------------------------------------ each step

    def start_load_kv(self, metadata: PdserveConnectorMetadata) -> None:
        for key, report in metadata.reports.items():
            self._answered.add(key, report)
        for request_id, block_ids in metadata.reqs_to_hold.items():
            self._hold(request_id, block_ids)
        for spec in metadata.reqs_to_receive:
            self._receive(spec)

    def _hold(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._leases.hold(request_id, block_ids)
        self._holding.add(request_id)
        for event in self._early.pop(request_id, ()):
            self._apply_lease_event(request_id, event)

    def _receive(self, spec: ReceiveSpec) -> None:
        self._require_transport()
        topology = self._require_topology()
        remote = spec.remote
        if self.settings.read_failure_rate and self._faults.random() < self.settings.read_failure_rate:
            self._fail(spec, "injected", f"fault injection (read_failure_rate={self.settings.read_failure_rate})")
            return
        try:
            ranks = source_ranks(topology, remote.tp_size)
        except TopologyError as e:
            self._fail(spec, "incompatible", f"cannot read from prefill TP {remote.tp_size}: {e}")
            return
        timeout_s = self.settings.handshake_timeout_s
        for rank in ranks:
            name = peer_name(remote.remote_engine_id, rank)
            if name in self._peers or name in self._handshaking:
                continue
            self._peer_failures.pop(name, None)
            endpoint = remote.side_channel(rank)
            future = self._handshake_pool.submit(
                self._handshakes.get_or_handshake,
                remote.remote_engine_id,
                lambda endpoint=endpoint: request_handshake(self.engine_id, topology, endpoint, self._auth, timeout_s),
                rank,
            )
            self._handshaking[name] = _Handshake(remote.remote_engine_id, rank, remote.tp_size, future)
        self._waiting_for_peer[spec.request_id] = (spec, ranks)
        self._post_reads()

    def _post_reads(self) -> None:
        """Connect finished handshakes, then post the READs of every request whose remote ranks are ready."""
        for name, handshake in list(self._handshaking.items()):
            if handshake.future.done():
                del self._handshaking[name]
                self._connect_peer(name, handshake)
        for request_id, (spec, ranks) in list(self._waiting_for_peer.items()):
            names = [peer_name(spec.remote.remote_engine_id, rank) for rank in ranks]
            if any(name in self._handshaking for name in names):
                continue
            del self._waiting_for_peer[request_id]
            missing = [name for name in names if name not in self._peers]
            if missing:
                failure = self._peer_failures.get(missing[0], ("unreachable", f"no handshake with {missing[0]}"))
                self._fail(spec, *failure)
                continue
            self._post_read(spec, names)

    def _connect_peer(self, name: str, handshake: _Handshake) -> None:
        future = handshake.future
        try:
            response = future.result()
            remote = response.topology
            transport = self._require_transport()
            chosen = choose_transport((transport.name,), response.transports, where(node_identity(), response.node))
            if remote.tp_size != handshake.tp_size:
                raise HandshakeRejected(
                    "incompatible",
                    [f"{name} has TP size {remote.tp_size}, its kv_transfer_params said {handshake.tp_size}"],
                )
            local_topology = self._require_topology()
            ranges = plan_peer_ranges(local_topology, remote)
            local = self._require_transport().kv_regions()
            regions = KVRegions(
                layer_names=local.layer_names,  # the handshake checked both sides have the same layers
                region_addrs=response.kv_caches_base_addr,
                num_blocks=response.num_blocks,
                block_len_bytes=response.block_len,
                mem_type=local.mem_type,
                device_id=local.device_id,
            )
            self._require_transport().add_peer(name, response.agent_metadata, regions, ranges)
        except HandshakeRejected as e:
            self._peer_failed(name, handshake, e.kind, f"handshake refused: {e}")
            return
        except Unauthenticated as e:
            self._peer_failed(name, handshake, "unauthenticated", str(e))
            return
        except ConnectorError as e:
            self._peer_failed(name, handshake, "unreachable" if future.exception() else "incompatible", str(e))
            return
        readers = len(reader_ranks(remote.tp_rank, local_topology, remote))
        self._peers[name] = _SourceRank(remote, readers, chosen)

    def _peer_failed(self, name: str, handshake: _Handshake, kind: str, reason: str) -> None:
        self._handshakes.invalidate(handshake.engine_id, handshake.tp_rank)
        self._peer_failures[name] = (kind, reason)
        log = logger.error if kind in ("incompatible", "version") else logger.warning
        log("engine %s: cannot exchange KV with %s (%s): %s", self.engine_id, name, kind, reason)

    def _post_read(self, spec: ReceiveSpec, names: list[str]) -> None:
        remote = spec.remote
        transport = self._require_transport()
        reads: list[KVRead] = []
        try:
            for name in names:
                source = self._peers[name]
                local_ids, remote_ids = self._kernel_block_ids(spec, source.topology)
                notify = read_notification(remote.remote_request_id, source.expected_reads)
                reads.append(transport.read_blocks(name, local_ids, remote_ids, notify=notify))
        except ConnectorError as e:
            for read in reads:
                read.abort("another READ of the request could not be posted")
            self._fail(spec, "transport", str(e))
            return
        logger.debug(
            "request %s on engine %s: READs of %d blocks from %s posted",
            spec.request_id,
            self.engine_id,
            len(spec.local_block_ids),
            ", ".join(names),
        )
        self._reads[spec.request_id] = _RequestReads(spec, reads)
        if self._require_topology().tp_rank == 0:
            self._release_unread_ranks(spec, self._peers[names[0]].topology)

    def _release_unread_ranks(self, spec: ReceiveSpec, remote: KVTopology) -> None:
        """Free at once the blocks of prefill ranks no decode rank reads (replicas of heads read elsewhere)."""
        local = self._require_topology()
        params = spec.remote
        for rank in range(remote.tp_size):
            if not reader_ranks(rank, local, remote):
                self._releases_out.release(params.side_channel(rank), params.remote_request_id)

    def _kernel_block_ids(self, spec: ReceiveSpec, remote: KVTopology) -> tuple[list[int], list[int]]:
        """The request's local and remote blocks as the cache tensors count them, local ones trimmed to the read.

        ``remote.block_size`` is the source's tensor block size; the prefill's
        logical block size comes in the params (ours when absent, as before
        prefill engines sent it).
        """
        local = self._require_topology()
        remote_logical = spec.remote.block_size or local.block_size * self._kernel_blocks_per_block
        if remote_logical % remote.block_size:
            raise TopologyError(
                f"prefill logical block size {remote_logical} is not a multiple of its cache block size "
                f"{remote.block_size}"
            )
        remote_ids = _expand(spec.remote_block_ids, remote_logical // remote.block_size)
        local_ids = _expand(spec.local_block_ids, self._kernel_blocks_per_block)
        ratio = local.block_size // remote.block_size
        return local_ids[: -(-len(remote_ids) // ratio)], remote_ids

    def _fail(self, spec: ReceiveSpec, kind: str, reason: str) -> None:
        self._failed_now.append(_Failure(spec, kind, reason))

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        A failed read is also in ``finished_recving``, as vLLM expects.
        """
        if self._transport is None:
            return set(), set(), set()
        finished_recving, failed_recving = self._poll_reads()
        return self._poll_leases(), finished_recving, failed_recving

    def _poll_reads(self) -> tuple[set[str], set[str]]:
        self._post_reads()
        finished: set[str] = set()
        for request_id, group in list(self._reads.items()):
            states = [read.poll() for read in group.reads]
            failed_read = next((read for read in group.reads if read.state is TransferState.FAILED), None)
            if failed_read is None and TransferState.PENDING in states:
                continue
            del self._reads[request_id]
            spec = group.spec
            if failed_read is not None:
                for read in group.reads:
                    read.abort(f"the READ from {failed_read.peer} failed")
                self._fail(spec, "transport", f"KV read failed: {failed_read.failure_reason}")
                self._forget_peer(failed_read.peer)
                continue
            finished.add(request_id)
            num_bytes = sum(read.num_bytes for read in group.reads)
            elapsed_s = max((read.elapsed_s for read in group.reads), default=0.0)
            transport = next((self._peers[read.peer].transport for read in group.reads if read.peer in self._peers), "")
            self._stats.record_transfer(num_bytes, elapsed_s)
            self._report(spec, {
                "source": "transfer",
                "bytes": num_bytes,
                "transfer_ms": round(elapsed_s * 1e3, 3),
                "remote_engine_id": spec.remote.remote_engine_id,
                "remote_ranks": [read.peer.rpartition("/rank")[2] for read in group.reads],
                "transport": transport,
            })  # fmt: skip
            logger.debug(
                "request %s on engine %s: read %d bytes from %d rank(s) in %.1f ms",
                request_id,
                self.engine_id,
                num_bytes,
                len(group.reads),
                elapsed_s * 1e3,
            )
        failed: set[str] = set()
        for failure in self._failed_now:
            spec = failure.spec
            failed.add(spec.request_id)
            self._load_error_block_ids.update(spec.local_block_ids)
            self._stats.record_failure(failure.kind)
            self._report(spec, {
                "source": "recomputed",
                "reason": failure.kind,
                "detail": failure.reason[:200],
                "remote_engine_id": spec.remote.remote_engine_id,
            })  # fmt: skip
            # Nobody will read those blocks now: every prefill rank may free them at once.
            params = spec.remote
            for rank in range(max(1, params.tp_size)):
                self._releases_out.release(params.side_channel(rank), params.remote_request_id)
            logger.warning(
                "request %s on engine %s: KV load from engine %s failed (%s), the prompt will be recomputed: %s",
                spec.request_id,
                self.engine_id,
                spec.remote.remote_engine_id,
                failure.kind,
                failure.reason,
            )
        self._failed_now.clear()
        return finished | failed, failed

    def _forget_peer(self, name: str) -> None:
        """A read from ``name`` failed: that rank may have restarted, so handshake again next time."""
        still_reading = any(
            read.peer == name and read.state is TransferState.PENDING
            for group in self._reads.values()
            for read in group.reads
        )
        source = self._peers.get(name)
        if source is not None and not still_reading:
            del self._peers[name]
            engine_id = name.rpartition("/rank")[0]
            self._handshakes.invalidate(engine_id, source.topology.tp_rank)
            self._require_transport().remove_peer(name)

    def _poll_leases(self) -> set[str]:
        transport = self._require_transport()
        now = time.monotonic()
        for reader, message in transport.poll_notifications():
            request_id, expected_reads = parse_read_notification(message)
            self._lease_event(request_id, _LeaseEvent("read", reader, expected_reads, now))
        while True:
            try:
                request_id = self._releases_in.get_nowait()
            except queue.Empty:
                break
            self._lease_event(request_id, _LeaseEvent("release", "", None, now))
        for request_id, events in list(self._early.items()):
            if now - events[0].seen_at > self.lease_ttl_s:
                del self._early[request_id]
        self._leases.expire()
        finished = self._leases.take_finished_with_state()
        for state in finished.values():
            self._stats.record_lease(_LEASE_OUTCOMES[state])
        self._holding.difference_update(finished)
        return set(finished)

    def _lease_event(self, request_id: str, event: _LeaseEvent) -> None:
        if request_id not in self._holding:
            self._early.setdefault(request_id, []).append(event)
        else:
            self._apply_lease_event(request_id, event)

    def _apply_lease_event(self, request_id: str, event: _LeaseEvent) -> None:
        if event.what == "read":
            self._leases.mark_read(request_id, event.reader, event.expected_reads)
        else:
            self._leases.release(request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def take_stats(self) -> PdserveKVStats | None:
        """This interval's stats (None if nothing happened); the next interval starts empty."""
        if self._server is not None:
            for kind, count in self._server.refused.take().items():
                self._stats.record_refused(kind, count)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, PdserveKVStats()
        return stats

    def _report(self, spec: ReceiveSpec, report: dict[str, Any]) -> None:
        """How ``spec``'s KV got here: for the scheduler side (the request's ``kv_transfer_params``) and for
        the proxy, which asks the side channel for it when a stream starts (a stream has no ``kv_transfer_params``)."""
        self._reports[spec.request_id] = report
        self._answered.add(report_key(spec.remote.remote_engine_id, spec.remote.remote_request_id), report)

    def take_reports(self) -> PdserveWorkerMeta | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return PdserveWorkerMeta(reports=reports)

    def shutdown(self) -> None:
        for group in self._reads.values():
            for read in group.reads:
                read.abort("engine shutting down")
        self._reads.clear()
        self._handshake_pool.shutdown(wait=False, cancel_futures=True)
        self._releases_out.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # ------------------------------------------------------------ internals

    def _require_transport(self) -> NixlKVTransport:
        if self._transport is None:
            raise ConnectorError(f"engine {self.engine_id}: register_kv_caches has not run")
        return self._transport

    def _require_topology(self) -> KVTopology:
        if self._topology is None:
            raise ConnectorError(f"engine {self.engine_id}: register_kv_caches has not run")
        return self._topology


def _expand(block_ids: Sequence[int], per_block: int) -> list[int]:
    """Block ids in units ``per_block`` times smaller: block b becomes [b*per_block, (b+1)*per_block)."""
    if per_block == 1:
        return list(block_ids)
    return [block * per_block + i for block in block_ids for i in range(per_block)]
