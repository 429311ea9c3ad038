"""``PdserveConnector``: our pull-mode KV connector, as vLLM loads it through ``kv_connector_module_path``.

vLLM builds one instance per role: the scheduler's (``KVConnectorRole.SCHEDULER``)
and each worker's (``KVConnectorRole.WORKER``). This class only dispatches:
scheduler methods go to ``connectors.scheduler.PdserveScheduler``, worker
methods to ``connectors.worker.PdserveWorker``; calling a method of the other
role is a programming error and raises ``RuntimeError``.

Selected by ``--kv-transfer-config`` (see ``orchestrator.launch``)::

    {"kv_connector": "PdserveConnector", "kv_connector_module_path": "connectors.vllm_connector",
     "kv_role": "kv_both", "kv_connector_extra_config": {"side_channel_host": ..., "side_channel_port": ...}}

What vLLM 0.32 does around a connector (learnt while building this one):

- The factory imports ``kv_connector_module_path`` and takes ``kv_connector`` from it;
  the scheduler instance lives in the EngineCore process, the worker instance in
  the Worker process (also on CPU). ``kv_transfer_config.engine_id`` is shared.
- With the hybrid KV cache manager on, a connector must subclass ``SupportsHMA``.
- For ``do_remote_prefill`` the matched tokens are ``len(prompt) - num_computed``
  loaded asynchronously; after the load the scheduler itself recomputes the last
  token for logits, which is not counted as ``local_compute``.
- ``update_state_after_alloc`` can run twice for a request: clear
  ``do_remote_prefill`` after the first call.
- ``request_finished`` keeps blocks (``True``) only for length-capped or stopped
  requests; they stay allocated until the id appears in ``finished_sending``.
- The model runner calls ``get_transfer_results()`` (not ``get_finished()``),
  also on steps without a forward pass; failed loads must appear both in
  ``failed_recving`` and ``finished_recving``, and their block ids in
  ``get_block_ids_with_load_errors()`` (then ``kv_load_failure_policy:
  recompute`` recomputes them).
- The CPU backend's KV cache per layer is ``[num_blocks, kv_heads, block_size,
  2 * head_dim]``: K and V share one plane per block (block size 128 here).
- vLLM configures only the ``vllm`` logger in its subprocesses: our loggers get
  its handlers attached here, or nothing they log reaches the engine log.
- vLLM's engine core treats an exception from a scheduler-side method as fatal
  (the engine dies). Every method vLLM calls once the engine runs is
  ``@contained``: whatever our code raises is logged (rate-limited), counted
  (``kv_transfer_failures_total{kind="internal"}``) and answered with the
  harmless default (no load, nothing held, no results); the sides refuse a
  single request where they can (``scheduler.update_state_after_alloc``,
  ``worker.start_load_kv``). Bad input (``kv_transfer_params``) is refused
  before it is used (``contract.wire.parse_remote_prefill``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.log_limit import LogLimiter
from connectors.metadata import PdserveConnectorMetadata
from connectors.scheduler import PdserveScheduler
from connectors.stats import PdserveKVStats, PdservePromMetrics
from connectors.worker import PdserveWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdserveConnector", "PdserveConnectorMetadata", "contained"]

logger = logging.getLogger(__name__)
_limited = LogLimiter(logger)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def contained(default: Callable[[], Any]) -> Callable[[_Method], _Method]:
    """A connector method vLLM calls while the engine runs: an exception from it is logged, counted, and
    answered with ``default()`` instead of reaching vLLM (whose engine core dies of it)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def guarded(self: PdserveConnector, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - the engine must outlive any bug or input of ours
                self._internal_errors.record_failure("internal")
                _limited.error(
                    method.__name__,
                    "engine %s: the connector's %s raised; contained, the engine goes on",
                    self.engine_id,
                    method.__name__,
                    exc_info=True,
                )
                return default()

        return guarded  # type: ignore[return-value]

    return wrap


def _none() -> None:
    return None


class PdserveConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-mode P/D connector over NIXL; one KV cache group (full attention) only."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_log_handlers()
        engine_id = vllm_config.kv_transfer_config.engine_id
        if not engine_id:
            raise ValueError("kv_transfer_config.engine_id is not set")
        self.engine_id: str = engine_id
        self._internal_errors = PdserveKVStats()  # what @contained caught, for the next stats
        self._scheduler: PdserveScheduler | None = None
        self._worker: PdserveWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PdserveScheduler(vllm_config, engine_id)
        elif role == KVConnectorRole.WORKER:
            self._worker = PdserveWorker(vllm_config, engine_id, kv_cache_config)
        else:
            raise ValueError(f"unknown connector role {role!r}")

    def _sched(self) -> PdserveScheduler:
        if self._scheduler is None:
            raise RuntimeError(f"engine {self.engine_id}: scheduler-side method called on the {self.role.name} side")
        return self._scheduler

    def _work(self) -> PdserveWorker:
        if self._worker is None:
            raise RuntimeError(f"engine {self.engine_id}: worker-side method called on the {self.role.name} side")
        return self._worker

    # ------------------------------------------------------------ scheduler side

    @contained(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    @contained(_none)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    @contained(PdserveConnectorMetadata)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta()

    @contained(_none)
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # We transfer the request's own blocks, so every transfer group is restored.
        return self._kv_cache_config.transfer_group_ids

    @contained(lambda: (False, None))
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    @contained(lambda: (False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        groups = [group for group in block_ids if group]
        if len(groups) > 1:
            raise ValueError(f"request {request.request_id}: {len(groups)} KV cache groups; only 1 is supported")
        return self._sched().request_finished(request, groups[0] if groups else [])

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._begin_step(connector_metadata)

    @contained(_none)
    def _begin_step(self, metadata: KVConnectorMetadata) -> None:
        """A step's work begins as its metadata is bound, before its forward, not in ``start_load_kv``: vLLM
        calls that after the forward for async loads, and a whole step then passes (a prefill pass: up to
        seconds) before a prefill engine holds the blocks of the requests it finished (until then a decode
        engine's pin of them is answered ``WAIT``), and before a decode engine asks for its pins."""
        if not isinstance(metadata, PdserveConnectorMetadata):
            raise TypeError(f"expected PdserveConnectorMetadata, got {type(metadata).__name__}")
        self._work().start_load_kv(metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # begun as the step's metadata was bound (``_begin_step``)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # pull mode: the whole prompt is loaded before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # pull mode: the decode engine reads; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    @contained(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._work().transfer_results()
        return sending or None, recving or None

    @contained(KVConnectorTransferResults)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    @contained(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    @contained(_none)
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().take_reports()

    # ------------------------------------------------------------ both sides

    @contained(_none)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        stats = side.take_stats() if side is not None else None
        if self._internal_errors.is_empty():
            return stats
        caught, self._internal_errors = self._internal_errors, PdserveKVStats()
        if stats is not None:
            caught.aggregate(stats)
        return caught

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdserveKVStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PdservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()


def _share_vllm_log_handlers() -> None:
    """Send the ``connectors`` package's logs where vLLM sends its own (the engine's log).

    vLLM configures only its ``vllm`` logger in the engine-core and worker
    processes; without this our messages (with request and engine ids) vanish.
    """
    ours = logging.getLogger("connectors")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = not theirs.handlers
