"""Worker side of the pdserve connector (pull mode): one ``PdserveWorker`` per TP rank.

``register_kv_caches`` describes this rank's caches (``KVTopology``: layout
from the cache tensor, H2ND for vLLM's CPU cache), registers them with the
transports its settings name (``connectors.transport``: CUDA IPC where the
caches are on a GPU, NIXL), and opens a ``SideChannelServer`` on
``side_channel_port + tp_rank`` that answers handshakes with the transports'
payloads, regions, transports offered and node, takes releases and READ
notifications, and answers the proxy's report queries. Then each step the worker hands the
scheduler side's metadata to its two halves:

- the decode side (``connectors.reader.KVReader``): handshakes with the prefill
  ranks it reads, posts READs, reports each load, recomputes what failed;
- the prefill side (``connectors.holder.LeaseHolder``): keeps the blocks of
  finished requests under leases until their readers are done.

Every event lands in ``PdserveKVStats`` (``get_kv_connector_stats``). Pull mode
moves nothing during the forward pass: the per-layer hooks are no-ops.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from connectors.cache_layout import describe_kv_cache
from connectors.handshake import HandshakeResponse, encode_response
from connectors.holder import LeaseHolder
from connectors.identity import engine_epoch, model_identity
from connectors.log_limit import LogLimiter
from connectors.metadata import PdserveConnectorMetadata
from connectors.options import ConnectorSettings
from connectors.reader import KVReader
from connectors.side_channel import RecentReports, SideChannelServer
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from connectors.topology import KVTopology
from connectors.transport import make_transport, node_identity
from connectors.transport.group import TransportFactory, WorkerTransports
from contract.auth import KVAuth

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PdserveWorker", "check_servable", "engine_model_identity"]

logger = logging.getLogger(__name__)
_limited = LogLimiter(logger)


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


class PdserveWorker:
    """The worker-side half of ``PdserveConnector``; one per TP rank, driven by the model runner's thread."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        transport_factory: TransportFactory = make_transport,
    ):
        check_servable(kv_cache_config, engine_id)
        self.settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config, engine_id
        )
        self.lease_ttl_s = self.settings.lease_ttl_s
        self.engine_id = engine_id
        self._auth = KVAuth.from_env()
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._transport_factory = transport_factory
        self._transport: WorkerTransports | None = None
        self._server: SideChannelServer | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._answered = RecentReports()  # read by the side-channel thread
        self._reader = KVReader(engine_id, self.settings, self._auth, self._answered)
        self.epoch = engine_epoch()
        self._holder = LeaseHolder(engine_id, self.lease_ttl_s, grace_s=self.settings.read_margin_s, epoch=self.epoch)
        self._stats = PdserveKVStats()

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], tp_rank: int | None = None) -> None:
        """Register this rank's caches and open its side channel; ``tp_rank`` defaults to vLLM's."""
        if tp_rank is None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        first = next(iter(kv_caches.values()))
        model_config = self._vllm_config.model_config
        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        # MLA keeps one latent per token, the same on every rank: one "head", as vLLM's NIXL connector counts it.
        use_mla = bool(getattr(model_config, "use_mla", False))
        total_heads = 1 if use_mla else model_config.get_total_num_kv_heads()
        head_dim = model_config.get_head_size()
        layout, block_size = describe_kv_cache(first, max(1, total_heads // tp_size), head_dim, use_mla=use_mla)
        tensor_blocks = first.shape[0]  # blocks outermost, as describe_kv_cache checked
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
        self._transport = WorkerTransports(
            self.engine_id, self.settings.transports, self.settings.transfer_timeout_s, self._transport_factory
        )
        regions = self._transport.register_kv_caches(
            kv_caches, self._topology.block_plane_bytes, planes_per_layer=self._topology.planes_per_layer
        )
        response = HandshakeResponse(
            engine_id=self.engine_id,
            topology=self._topology,
            kv_caches_base_addr=regions.region_addrs,
            block_len=regions.block_len_bytes,
            num_blocks=regions.num_blocks,
            transports=self._transport.names,
            payloads=self._transport.payloads(),
            node=node_identity(),
            epoch=self.epoch,
        )
        self._reader.attach(self._transport, self._topology, self._kernel_blocks_per_block)
        self._server = SideChannelServer(
            self.engine_id,
            self.settings.side_channel_host,
            self.settings.side_channel_port + tp_rank,
            self._topology,
            encode_response(response),
            self._auth,
            on_release=self._holder.releases_in.put,
            on_pin=self._holder.pin,
            on_read=self._holder.add_notification,
            on_report=self._answered.encoded,
            answer_delay_s=self.settings.fault_injection.handshake_delay_s,
        )
        logger.info(
            "engine %s rank %d/%d: KV caches %s (%s) x %d layers, %d kernel block(s) per block, transports %s, "
            "side channel %s",
            self.engine_id,
            tp_rank,
            tp_size,
            tuple(first.shape),
            layout,
            len(kv_caches),
            self._kernel_blocks_per_block,
            ", ".join(self._transport.names),
            self._server.endpoint,
        )

    # ------------------------------------------------------------ each step

    def start_load_kv(self, metadata: PdserveConnectorMetadata) -> None:
        for key, report in metadata.reports.items():
            self._answered.add(key, report)
        for request_id, block_ids in metadata.reqs_to_hold.items():
            self._holder.hold(request_id, block_ids)
        for spec in metadata.reqs_to_receive:
            try:
                self._reader.receive(spec)
            except Exception as e:  # noqa: BLE001 - one request's bad luck must not stop the engine
                logger.exception("request %s on engine %s: cannot start its KV read", spec.request_id, self.engine_id)
                self._reader.fail(spec, "internal", f"{type(e).__name__}: {e}")

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        A failed read is also in ``finished_recving``, as vLLM expects.
        """
        if self._transport is None:
            return set(), set(), set()
        finished_sending = self._holder.poll(self._transport)  # first: nothing on the reader's side withholds it
        try:
            finished_recving, failed_recving = self._reader.poll()
        except Exception:  # noqa: BLE001 - the leases' ends must reach vLLM whatever the reader does
            self._stats.record_failure("internal")
            _limited.error("reader", "engine %s: the KV reader's poll raised; contained", self.engine_id, exc_info=True)
            return finished_sending, set(), set()
        return finished_sending, finished_recving, failed_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._reader.take_load_errors()

    def take_stats(self) -> PdserveKVStats | None:
        """This interval's stats (None if nothing happened); the next interval starts empty."""
        stats, self._stats = self._stats, PdserveKVStats()
        if self._server is not None:
            for kind, count in self._server.refused.take().items():
                stats.record_refused(kind, count)
        stats.aggregate(self._reader.take_stats())
        stats.aggregate(self._holder.take_stats())
        return None if stats.is_empty() else stats

    def take_reports(self) -> PdserveWorkerMeta | None:
        return self._reader.take_reports()

    def shutdown(self) -> None:
        self._reader.shutdown()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
