"""Worker side of the pdserve connector (pull mode): registers the KV caches, reads blocks, keeps leases.

- ``register_kv_caches``: one ``NixlKVTransport`` over the engine's KV cache
  tensors, and a ``SideChannelServer`` that answers handshakes with this
  agent's metadata and regions, and takes releases.
- Decode engine, ``start_load_kv``: for each request the scheduler side asks
  to receive, make sure the prefill engine is a known peer (the handshake
  runs on a background thread, once per peer; the request waits for it
  without holding up the engine's step), then post ONE READ of the request's
  blocks whose notification is the prefill engine's request id.
  ``transfer_results`` polls the reads: DONE ones are "finished receiving";
  FAILED ones too, their local block ids go to
  ``get_block_ids_with_load_errors`` so vLLM recomputes those tokens, and
  the prefill engine is told to release its blocks at once.
- Prefill engine: ``start_load_kv`` puts the blocks of finished requests
  under a ``LeaseTable`` lease; ``transfer_results`` turns READ
  notifications and releases into lease ends, expires leases, and reports
  the ended ones as "finished sending" so vLLM frees their blocks.

Every load ends in a per-request report (``build_connector_worker_meta``)
and every event in ``PdserveKVStats`` (``get_kv_connector_stats``).
Pull mode moves nothing during the forward pass: the per-layer hooks are no-ops.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.errors import ConnectorError, HandshakeRejected
from connectors.handshake import HandshakeCache, HandshakeResponse, encode_response
from connectors.leases import LeaseState, LeaseTable
from connectors.metadata import ConnectorSettings, PdserveConnectorMetadata, ReceiveSpec
from connectors.nixl_transport import KVRead, KVRegions, NixlKVTransport, TransferState
from connectors.side_channel import ReleaseSender, SideChannelServer, request_handshake
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from connectors.topology import KVTopology

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PdserveWorker"]

logger = logging.getLogger(__name__)

_LEASE_OUTCOMES = {LeaseState.READ: "read", LeaseState.RELEASED: "released", LeaseState.EXPIRED: "expired"}


@dataclass(slots=True)
class _Failure:
    spec: ReceiveSpec
    kind: str  # one of connectors.stats.FAILURE_KINDS
    reason: str


class PdserveWorker:
    """The worker-side half of ``PdserveConnector``; one per TP rank, driven by the model runner's thread."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        self.settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config, engine_id
        )
        self.lease_ttl_s = self.settings.lease_ttl_s
        self.engine_id = engine_id
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._transport: NixlKVTransport | None = None
        self._server: SideChannelServer | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._stats = PdserveKVStats()
        self._reports: dict[str, dict[str, Any]] = {}
        self._releases_out = ReleaseSender(engine_id)
        # decode side
        self._handshakes = HandshakeCache()
        self._handshake_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-handshake")
        self._handshaking: dict[str, Future[HandshakeResponse]] = {}
        self._peers: set[str] = set()
        self._peer_failures: dict[str, tuple[str, str]] = {}  # this step's failed handshakes: (kind, reason)
        self._waiting_for_peer: dict[str, ReceiveSpec] = {}
        self._reads: dict[str, tuple[KVRead, ReceiveSpec]] = {}
        self._failed_now: list[_Failure] = []
        self._load_error_block_ids: set[int] = set()
        self._faults = random.Random(self.settings.fault_seed)
        # prefill side
        self._leases = LeaseTable(self.lease_ttl_s, engine_id=engine_id)
        self._holding: set[str] = set()
        # A READ notification or a release can arrive before this worker learns of
        # the lease (the hold comes with the next scheduler step): keep it until then.
        self._early: dict[str, tuple[str, str, float]] = {}  # request id -> (what, reader, seen at)
        self._releases_in: queue.SimpleQueue[str] = queue.SimpleQueue()  # from the side-channel thread

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        first = next(iter(kv_caches.values()))
        num_regions = 2 if first.dim() >= 2 and first.shape[0] == 2 else 1
        tensor_blocks = first.shape[1] if num_regions == 2 else first.shape[0]
        block_len = first.numel() * first.element_size() // (num_regions * tensor_blocks)
        # vLLM's block ids are logical; a kernel may cut each into several physical blocks.
        logical_blocks = self._kv_cache_config.num_blocks
        if logical_blocks and tensor_blocks % logical_blocks == 0:
            self._kernel_blocks_per_block = tensor_blocks // logical_blocks
        model_config = self._vllm_config.model_config
        parallel_config = self._vllm_config.parallel_config
        tp_rank = get_tensor_model_parallel_rank()
        self._topology = KVTopology(
            tp_size=parallel_config.tensor_parallel_size,
            tp_rank=tp_rank,
            total_num_kv_heads=model_config.get_total_num_kv_heads(),
            block_size=self._vllm_config.cache_config.block_size,
            layout="HND",
            head_dim=model_config.get_head_size(),
            dtype=str(first.dtype),
            num_layers=len(kv_caches),
        )
        self._transport = NixlKVTransport(self.engine_id, transfer_timeout_s=self.settings.transfer_timeout_s)
        regions = self._transport.register_kv_caches(kv_caches, block_len)
        response = HandshakeResponse(
            engine_id=self.engine_id,
            topology=self._topology,
            agent_metadata=self._transport.agent_metadata(),
            kv_caches_base_addr=regions.region_addrs,
            block_len=regions.block_len_bytes,
            num_blocks=regions.num_blocks,
        )
        self._server = SideChannelServer(
            self.engine_id,
            self.settings.side_channel_host,
            self.settings.side_channel_port + tp_rank,
            self._topology,
            encode_response(response),
            on_release=self._releases_in.put,
            answer_delay_s=self.settings.handshake_delay_s,
        )
        logger.info(
            "engine %s: KV caches %s x %d layers, %d kernel block(s) per block, side channel %s",
            self.engine_id,
            tuple(first.shape),
            len(kv_caches),
            self._kernel_blocks_per_block,
            self._server.endpoint,
        )

    # ------------------------------------------------------------ each step

    def start_load_kv(self, metadata: PdserveConnectorMetadata) -> None:
        for request_id, block_ids in metadata.reqs_to_hold.items():
            self._hold(request_id, block_ids)
        for spec in metadata.reqs_to_receive:
            self._receive(spec)

    def _hold(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._leases.hold(request_id, block_ids)
        self._holding.add(request_id)
        early = self._early.pop(request_id, None)
        if early is None:
            return
        what, reader, _ = early
        if what == "read":
            self._leases.mark_read(request_id, reader)
        else:
            self._leases.release(request_id)

    def _receive(self, spec: ReceiveSpec) -> None:
        self._require_transport()
        remote = spec.remote
        if self.settings.read_failure_rate and self._faults.random() < self.settings.read_failure_rate:
            self._fail(spec, "injected", f"fault injection (read_failure_rate={self.settings.read_failure_rate})")
            return
        engine_id = remote.remote_engine_id
        if engine_id not in self._peers and engine_id not in self._handshaking:
            topology = self._require_topology()
            timeout_s = self.settings.handshake_timeout_s
            self._handshaking[engine_id] = self._handshake_pool.submit(
                self._handshakes.get_or_handshake,
                engine_id,
                lambda: request_handshake(self.engine_id, topology, remote.remote_host, remote.remote_port, timeout_s),
            )
        self._waiting_for_peer[spec.request_id] = spec
        self._post_reads()

    def _post_reads(self) -> None:
        """Connect finished handshakes, then post the READ of every request whose peer is ready."""
        for engine_id, future in list(self._handshaking.items()):
            if future.done():
                del self._handshaking[engine_id]
                self._connect_peer(engine_id, future)
        for request_id, spec in list(self._waiting_for_peer.items()):
            engine_id = spec.remote.remote_engine_id
            if engine_id in self._handshaking:
                continue
            del self._waiting_for_peer[request_id]
            if engine_id not in self._peers:
                failure = self._peer_failures.get(engine_id, ("unreachable", "no handshake with the engine"))
                self._fail(spec, *failure)
                continue
            self._post_read(spec)
        self._peer_failures.clear()

    def _connect_peer(self, engine_id: str, future: Future[HandshakeResponse]) -> None:
        try:
            response = future.result()
            local = self._require_transport().kv_regions()
            regions = KVRegions(
                layer_names=local.layer_names,  # the handshake checked both sides have the same layers
                region_addrs=response.kv_caches_base_addr,
                num_blocks=response.num_blocks,
                block_len_bytes=response.block_len,
                mem_type=local.mem_type,
                device_id=local.device_id,
            )
            self._require_transport().add_peer(engine_id, response.agent_metadata, regions)
        except HandshakeRejected as e:
            self._peer_failed(engine_id, e.kind, f"handshake refused: {e}")
            return
        except ConnectorError as e:
            self._peer_failed(engine_id, "unreachable" if future.exception() else "incompatible", str(e))
            return
        self._peers.add(engine_id)

    def _peer_failed(self, engine_id: str, kind: str, reason: str) -> None:
        self._handshakes.invalidate(engine_id)
        self._peer_failures[engine_id] = (kind, reason)
        log = logger.error if kind in ("incompatible", "version") else logger.warning
        log("engine %s: cannot exchange KV with engine %s (%s): %s", self.engine_id, engine_id, kind, reason)

    def _post_read(self, spec: ReceiveSpec) -> None:
        remote = spec.remote
        try:
            read = self._require_transport().read_blocks(
                remote.remote_engine_id,
                self._kernel_ids(spec.local_block_ids),
                self._kernel_ids(spec.remote_block_ids),
                notify=remote.remote_request_id.encode(),
            )
        except ConnectorError as e:
            self._fail(spec, "transport", str(e))
            return
        logger.debug(
            "request %s on engine %s: READ of %d blocks from engine %s posted",
            spec.request_id,
            self.engine_id,
            len(spec.local_block_ids),
            remote.remote_engine_id,
        )
        self._reads[spec.request_id] = (read, spec)

    def _fail(self, spec: ReceiveSpec, kind: str, reason: str) -> None:
        self._failed_now.append(_Failure(spec, kind, reason))

    def _kernel_ids(self, block_ids: Sequence[int]) -> list[int]:
        ratio = self._kernel_blocks_per_block
        if ratio == 1:
            return list(block_ids)
        return [block * ratio + i for block in block_ids for i in range(ratio)]

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
        for request_id, (read, spec) in list(self._reads.items()):
            state = read.poll()
            if state is TransferState.PENDING:
                continue
            del self._reads[request_id]
            if state is TransferState.FAILED:
                self._fail(spec, "transport", f"KV read failed: {read.failure_reason}")
                self._forget_peer(spec.remote.remote_engine_id)
                continue
            finished.add(request_id)
            self._stats.record_transfer(read.num_bytes, read.elapsed_s)
            self._reports[request_id] = {
                "source": "transfer",
                "bytes": read.num_bytes,
                "transfer_ms": round(read.elapsed_s * 1e3, 3),
                "remote_engine_id": spec.remote.remote_engine_id,
            }
            logger.debug(
                "request %s on engine %s: read %d bytes in %.1f ms",
                request_id,
                self.engine_id,
                read.num_bytes,
                read.elapsed_s * 1e3,
            )
        failed: set[str] = set()
        for failure in self._failed_now:
            spec = failure.spec
            failed.add(spec.request_id)
            self._load_error_block_ids.update(spec.local_block_ids)
            self._stats.record_failure(failure.kind)
            self._reports[spec.request_id] = {
                "source": "recomputed",
                "reason": failure.kind,
                "detail": failure.reason[:200],
                "remote_engine_id": spec.remote.remote_engine_id,
            }
            # Nobody will read those blocks now: the prefill engine may free them at once.
            self._releases_out.release(spec.remote.remote_host, spec.remote.remote_port, spec.remote.remote_request_id)
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

    def _forget_peer(self, engine_id: str) -> None:
        """A read from ``engine_id`` failed: it may have restarted, so handshake again next time."""
        still_reading = any(spec.remote.remote_engine_id == engine_id for _, spec in self._reads.values())
        if engine_id in self._peers and not still_reading:
            self._peers.discard(engine_id)
            self._handshakes.invalidate(engine_id)
            self._require_transport().remove_peer(engine_id)

    def _poll_leases(self) -> set[str]:
        transport = self._require_transport()
        now = time.monotonic()
        for reader, message in transport.poll_notifications():
            self._lease_event(message.decode(errors="replace"), "read", reader, now)
        while True:
            try:
                request_id = self._releases_in.get_nowait()
            except queue.Empty:
                break
            self._lease_event(request_id, "release", "", now)
        for request_id, (_, _, seen_at) in list(self._early.items()):
            if now - seen_at > self.lease_ttl_s:
                del self._early[request_id]
        self._leases.expire()
        finished = self._leases.take_finished_with_state()
        for state in finished.values():
            self._stats.record_lease(_LEASE_OUTCOMES[state])
        self._holding.difference_update(finished)
        return set(finished)

    def _lease_event(self, request_id: str, what: str, reader: str, now: float) -> None:
        if request_id not in self._holding:
            self._early[request_id] = (what, reader, now)
        elif what == "read":
            self._leases.mark_read(request_id, reader)
        else:
            self._leases.release(request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def take_stats(self) -> PdserveKVStats | None:
        """This interval's stats (None if nothing happened); the next interval starts empty."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, PdserveKVStats()
        return stats

    def take_reports(self) -> PdserveWorkerMeta | None:
        if not self._reports:
            return None
        reports, self._reports = self._reports, {}
        return PdserveWorkerMeta(reports=reports)

    def shutdown(self) -> None:
        for read, _ in self._reads.values():
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
