"""Worker side of the pdserve connector (pull mode): registers the KV caches, reads blocks, keeps leases.

- ``register_kv_caches``: one ``NixlKVTransport`` over the engine's KV cache
  tensors, and a ``SideChannelServer`` that answers handshakes with this
  agent's metadata and regions.
- Decode engine, ``start_load_kv``: for each request the scheduler side asks
  to receive, handshake once per prefill engine (``HandshakeCache``), then
  post ONE READ of the request's blocks whose notification is the prefill
  engine's request id. ``get_finished`` polls the reads: DONE ones are
  "finished receiving"; FAILED ones too, and their local block ids go to
  ``get_block_ids_with_load_errors`` so vLLM recomputes those tokens.
- Prefill engine: ``start_load_kv`` puts the blocks of finished requests
  under a ``LeaseTable`` lease; ``get_finished`` turns the READ
  notifications into ``mark_read``, expires leases, and reports the finished
  ones as "finished sending" so vLLM frees their blocks.

Pull mode moves nothing during the forward pass: the per-layer hooks are no-ops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from connectors.errors import ConnectorError
from connectors.handshake import HandshakeCache, HandshakeResponse, encode_response
from connectors.leases import DEFAULT_LEASE_TTL_S, LeaseTable
from connectors.metadata import PdserveConnectorMetadata, ReceiveSpec, side_channel_address
from connectors.nixl_transport import KVRead, KVRegions, NixlKVTransport, TransferState
from connectors.side_channel import SideChannelServer, request_handshake
from connectors.topology import KVTopology

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PdserveWorker"]

logger = logging.getLogger(__name__)


class PdserveWorker:
    """The worker-side half of ``PdserveConnector``; one per TP rank, driven by the model runner's thread."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._side_channel_host, self._side_channel_port = side_channel_address(extra, engine_id)
        self.lease_ttl_s = float(extra.get("lease_ttl_s", DEFAULT_LEASE_TTL_S))
        self.engine_id = engine_id
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._transport: NixlKVTransport | None = None
        self._server: SideChannelServer | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._handshakes = HandshakeCache()
        self._peers: set[str] = set()
        # decode side
        self._reads: dict[str, tuple[KVRead, tuple[int, ...]]] = {}
        self._failed_now: dict[str, tuple[int, ...]] = {}
        self._load_error_block_ids: set[int] = set()
        # prefill side
        self._leases = LeaseTable(self.lease_ttl_s, engine_id=engine_id)
        self._holding: set[str] = set()
        # A READ can complete before this worker learns of the lease (the hold
        # arrives with the next scheduler step): keep its notification until then.
        self._early_reads: dict[str, tuple[str, float]] = {}

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
        self._transport = NixlKVTransport(self.engine_id)
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
            self._side_channel_host,
            self._side_channel_port + tp_rank,
            self._topology,
            encode_response(response),
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
        early = self._early_reads.pop(request_id, None)
        if early is not None:
            self._leases.mark_read(request_id, early[0])

    def _receive(self, spec: ReceiveSpec) -> None:
        transport = self._require_transport()
        remote = spec.remote
        try:
            self._ensure_peer(remote.remote_engine_id, remote.remote_host, remote.remote_port)
            read = transport.read_blocks(
                remote.remote_engine_id,
                self._kernel_ids(spec.local_block_ids),
                self._kernel_ids(spec.remote_block_ids),
                notify=remote.remote_request_id.encode(),
            )
        except ConnectorError as e:
            logger.warning(
                "request %s on engine %s: cannot read KV from engine %s, the prompt will be recomputed: %s",
                spec.request_id,
                self.engine_id,
                remote.remote_engine_id,
                e,
            )
            self._failed_now[spec.request_id] = spec.local_block_ids
            return
        logger.debug(
            "request %s on engine %s: READ of %d blocks from engine %s posted",
            spec.request_id,
            self.engine_id,
            len(spec.local_block_ids),
            remote.remote_engine_id,
        )
        self._reads[spec.request_id] = (read, spec.local_block_ids)

    def _ensure_peer(self, engine_id: str, host: str, port: int) -> None:
        if engine_id in self._peers:
            return
        topology = self._require_topology()
        response = self._handshakes.get_or_handshake(
            engine_id, lambda: request_handshake(self.engine_id, topology, host, port)
        )
        local = self._require_transport().kv_regions()
        regions = KVRegions(
            layer_names=local.layer_names,  # the handshake checked both sides have the same layers
            region_addrs=response.kv_caches_base_addr,
            num_blocks=response.num_blocks,
            block_len_bytes=response.block_len,
            mem_type=local.mem_type,
            device_id=local.device_id,
        )
        try:
            self._require_transport().add_peer(engine_id, response.agent_metadata, regions)
        except ConnectorError:
            self._handshakes.invalidate(engine_id)
            raise
        self._peers.add(engine_id)

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
        failed = dict(self._failed_now)
        self._failed_now.clear()
        finished: set[str] = set(failed)
        for request_id, (read, local_block_ids) in list(self._reads.items()):
            state = read.poll()
            if state is TransferState.PENDING:
                continue
            del self._reads[request_id]
            finished.add(request_id)
            if state is TransferState.FAILED:
                failed[request_id] = local_block_ids
                logger.warning(
                    "request %s on engine %s: KV read failed, the prompt will be recomputed: %s",
                    request_id,
                    self.engine_id,
                    read.failure_reason,
                )
            else:
                logger.debug(
                    "request %s on engine %s: read %d bytes in %.1f ms",
                    request_id,
                    self.engine_id,
                    read.num_bytes,
                    read.elapsed_s * 1e3,
                )
        for block_ids in failed.values():
            self._load_error_block_ids.update(block_ids)
        return finished, set(failed)

    def _poll_leases(self) -> set[str]:
        transport = self._require_transport()
        now = time.monotonic()
        for reader, message in transport.poll_notifications():
            request_id = message.decode(errors="replace")
            if request_id in self._holding:
                self._leases.mark_read(request_id, reader)
            else:
                self._early_reads[request_id] = (reader, now)
        for request_id, (_, seen_at) in list(self._early_reads.items()):
            if now - seen_at > self.lease_ttl_s:
                del self._early_reads[request_id]
        self._leases.expire()
        finished = set(self._leases.take_finished())
        self._holding.difference_update(finished)
        return finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def shutdown(self) -> None:
        for read, _ in self._reads.values():
            read.abort("engine shutting down")
        self._reads.clear()
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
