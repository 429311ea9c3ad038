"""What the scheduler-side connector tells the worker-side connector each step.

``PdserveConnectorMetadata`` is built by ``connectors.scheduler`` in
``build_connector_meta`` and bound to the worker before the model runs:

- ``reqs_to_receive``: decode side. Requests whose prompt KV lives on a
  prefill engine; the worker handshakes with the prefill ranks it reads (once
  each) and posts one READ per rank of ``remote_block_ids`` into
  ``local_block_ids`` (local block i takes remote blocks [i*ratio, (i+1)*ratio)
  when the prefill's block size is ``ratio`` times smaller).
- ``reqs_to_hold``: prefill side. Requests that finished with
  ``do_remote_decode``; the worker keeps their blocks under a lease until the
  decode engine's READ notification arrives (or the lease expires).
- ``reports``: decode side. Loads the scheduler side decided without a READ
  (a local prefix-cache hit, a block size that does not pair), by
  ``side_messages.report_key``: the worker keeps them for the proxy's report
  queries, as it keeps the reports of its own READs.

``KVTransferParams`` (``contract.wire``, re-exported here) is the checked
``kv_transfer_params`` a decode request carries (the ones our prefill side
returned, passed on by the proxy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from contract.kv_report import KVReport
from contract.wire import KVTransferParams

__all__ = ["KVTransferParams", "PdserveConnectorMetadata", "ReceiveSpec"]


@dataclass(frozen=True, slots=True)
class ReceiveSpec:
    """One decode request's READ: remote blocks into local blocks, ``ratio`` remote blocks per local block."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote: KVTransferParams
    remote_block_ids: tuple[int, ...]
    failure: str = ""
    """Set when the scheduler side could not plan the read: the worker fails the load (vLLM recomputes)."""


@dataclass(slots=True)
class PdserveConnectorMetadata(KVConnectorMetadata):
    """One scheduler step's work for the worker-side connector."""

    reqs_to_receive: list[ReceiveSpec] = field(default_factory=list)
    reqs_to_hold: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reports: dict[str, KVReport] = field(default_factory=dict)
