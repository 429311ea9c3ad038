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
  ``side_channel.report_key``: the worker keeps them for the proxy's report
  queries, as it keeps the reports of its own READs.

``KVTransferParams`` (``connectors.wire``, re-exported here) is the checked
``kv_transfer_params`` a decode request carries (the ones our prefill side
returned, passed on by the proxy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connectors.transport import DEFAULT_TRANSPORTS, FACTORIES
from connectors.wire import KVTransferParams

__all__ = ["ConnectorSettings", "KVTransferParams", "PdserveConnectorMetadata", "ReceiveSpec"]


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
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's settings, from ``kv_transfer_config.kv_connector_extra_config``.

    The orchestrator writes them from the spec's ``connector_options``;
    ``fault_injection`` exists so tests can prove recovery on real engines.
    """

    side_channel_host: str
    side_channel_port: int
    lease_ttl_s: float = 120.0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    read_margin_s: float = 2.0
    read_failure_rate: float = 0.0
    handshake_delay_s: float = 0.0
    fault_seed: int | None = None
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """The KV transports to serve and read over, best first (``connectors.transport``)."""

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None, engine_id: str) -> ConnectorSettings:
        extra = dict(extra_config or {})
        faults = extra.get("fault_injection") or {}
        defaults = {f.name: f.default for f in fields(cls)}
        try:
            settings = cls(
                side_channel_host=str(extra["side_channel_host"]),
                side_channel_port=int(extra["side_channel_port"]),
                lease_ttl_s=float(extra.get("lease_ttl_s", defaults["lease_ttl_s"])),
                handshake_timeout_s=float(extra.get("handshake_timeout_s", defaults["handshake_timeout_s"])),
                transfer_timeout_s=float(extra.get("transfer_timeout_s", defaults["transfer_timeout_s"])),
                read_margin_s=float(extra.get("read_margin_s", defaults["read_margin_s"])),
                read_failure_rate=float(faults.get("read_failure_rate", 0.0)),
                handshake_delay_s=float(faults.get("handshake_delay_s", 0.0)),
                fault_seed=None if faults.get("seed") is None else int(faults["seed"]),
                transports=tuple(str(name) for name in extra.get("transports", DEFAULT_TRANSPORTS)),
            )
        except KeyError as e:
            raise ValueError(f"kv_connector_extra_config lacks {e.args[0]!r} (engine {engine_id})") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_connector_extra_config of engine {engine_id}: {e}") from e
        unknown = [name for name in settings.transports if name not in FACTORIES]
        if unknown or not settings.transports:
            raise ValueError(
                f"kv_connector_extra_config of engine {engine_id}: transports must name one or more of "
                f"{', '.join(FACTORIES)}, got {list(settings.transports)}"
            )
        if not 0.0 <= settings.read_failure_rate <= 1.0:
            raise ValueError(f"fault_injection.read_failure_rate must be in [0, 1], got {settings.read_failure_rate}")
        return settings
