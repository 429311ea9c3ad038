"""What the pdserve connector counts, and how it reaches the engine's ``/metrics`` and each response.

Two paths, both vLLM's own:

- **Interval stats** (``PdserveKVStats``): the worker (and the scheduler side)
  fill one each step; vLLM aggregates them across ranks, ships them to the
  API server and calls ``PdservePromMetrics.observe`` there, which feeds the
  Prometheus metrics below (all prefixed ``pdserve:``).
- **Per-request reports** (``PdserveWorkerMeta``): the decode worker records,
  for every request it loaded, whether the KV came over the wire or must be
  recomputed, how many bytes, how long. vLLM hands them to the scheduler side
  (``update_connector_output``), which returns them in the finished request's
  ``kv_transfer_params["pdserve_kv"]``; the proxy turns that into the
  ``X-PDServe-KV`` response header.

Metrics (label ``kind`` / ``outcome`` as listed):

- ``pdserve:kv_transfer_bytes_total`` — bytes read by decode engines
- ``pdserve:kv_transfers_total`` — KV reads that completed
- ``pdserve:kv_transfer_seconds`` — histogram of one request's read time
- ``pdserve:kv_transfer_gbps`` — histogram of one read's achieved GB/s (1e9 bytes/s)
- ``pdserve:kv_transfer_failures_total{kind}`` — injected, unreachable, incompatible,
  version, malformed, transport, unauthenticated, expired (the READ could not end before the
  prefill's lease: the blocks may be another request's by then), internal (our connector raised;
  the request is recomputed, the engine lives on)
- ``pdserve:kv_leases_total{outcome}`` — prefill leases that ended read, released or expired; and two events
  on the way: ``pinned`` (a reader announced its READ: one per reader), ``release_refused`` (a release under
  a pin)
- ``pdserve:kv_recomputed_tokens_total`` — prompt tokens a decode engine recomputed after a failed load
- ``pdserve:kv_quarantined_blocks_total`` — decode blocks an aborted READ never confirmed drained: kept out
  of vLLM's pool for the engine's life (a READ may still land in them), never reused
- ``pdserve:kv_refused_total{kind}`` — what failed the cluster's authentication: side-channel messages
  (handshake, handshake-reply, release, report, message: not framed as ours) and transfer parameters
  (params: forged, altered, expired, replayed or for another decode engine; malformed_params: a
  field of the wrong type or out of range); counted at the engine's next step
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from contract.kv_report import KVReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "FAILURE_KINDS",
    "LEASE_OUTCOMES",
    "REFUSED_KINDS",
    "PdserveKVStats",
    "PdservePromMetrics",
    "PdserveWorkerMeta",
]

FAILURE_KINDS = (
    "injected",
    "unreachable",
    "incompatible",
    "version",
    "malformed",
    "transport",
    "unauthenticated",
    "expired",
    "gone",
    "internal",
)
REFUSED_KINDS = (
    "handshake",
    "handshake-reply",
    "release",
    "report",
    "ping",
    "read",
    "pin",
    "message",
    "params",
    "malformed_params",
)
LEASE_OUTCOMES = ("read", "released", "expired", "pinned", "release_refused")
"""How leases ended (read, released, expired), and two events on the way: a reader pinned one, a release that
named no reader was refused under a pin."""

# Buckets: a few KiB over shared memory takes well under a millisecond; a 4k-token
# prompt of a big model over TCP can take seconds.
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def _empty() -> dict[str, Any]:
    return {
        "transfers": [],
        "failures": {},
        "leases": {},
        "refused": {},
        "recomputed_tokens": 0,
        "quarantined_blocks": 0,
    }


@dataclasses.dataclass
class PdserveKVStats(KVConnectorStats):
    """One interval's connector stats; ``data`` stays plain lists and dicts (it crosses processes)."""

    def __post_init__(self) -> None:
        for key, value in _empty().items():
            self.data.setdefault(key, value)

    # -- recording (worker / scheduler side)

    def record_transfer(self, num_bytes: int, seconds: float) -> None:
        self.data["transfers"].append([int(num_bytes), float(seconds)])

    def record_failure(self, kind: str) -> None:
        failures = self.data["failures"]
        failures[kind] = failures.get(kind, 0) + 1

    def record_lease(self, outcome: str, count: int = 1) -> None:
        if count:
            leases = self.data["leases"]
            leases[outcome] = leases.get(outcome, 0) + count

    def record_refused(self, kind: str, count: int = 1) -> None:
        refused = self.data["refused"]
        refused[kind] = refused.get(kind, 0) + count

    def record_recomputed(self, tokens: int) -> None:
        self.data["recomputed_tokens"] += int(tokens)

    def record_quarantined(self, blocks: int) -> None:
        self.data["quarantined_blocks"] += int(blocks)

    # -- vLLM's KVConnectorStats interface

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> PdserveKVStats:
        theirs = other.data
        self.data["transfers"].extend(theirs.get("transfers", ()))
        for key in ("failures", "leases", "refused"):
            for name, count in theirs.get(key, {}).items():
                self.data[key][name] = self.data[key].get(name, 0) + count
        self.data["recomputed_tokens"] += theirs.get("recomputed_tokens", 0)
        self.data["quarantined_blocks"] += theirs.get("quarantined_blocks", 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        transfers = self.data["transfers"]
        total_bytes = sum(b for b, _ in transfers)
        total_s = sum(s for _, s in transfers)
        summary: dict[str, int | float] = {
            "transfers": len(transfers),
            "bytes": total_bytes,
            "avg_ms": round(1e3 * total_s / len(transfers), 3) if transfers else 0.0,
            "gbps": round(total_bytes / total_s / 1e9, 3) if total_s > 0 else 0.0,
            "recomputed_tokens": self.data["recomputed_tokens"],
            "quarantined_blocks": self.data["quarantined_blocks"],
        }
        summary.update({f"failed_{k}": v for k, v in sorted(self.data["failures"].items())})
        summary.update({f"lease_{k}": v for k, v in sorted(self.data["leases"].items())})
        summary.update({f"refused_{k}": v for k, v in sorted(self.data["refused"].items())})
        return summary

    def is_empty(self) -> bool:
        return not (
            self.data["transfers"]
            or self.data["failures"]
            or self.data["leases"]
            or self.data["refused"]
            or self.data["recomputed_tokens"]
            or self.data["quarantined_blocks"]
        )


class PdservePromMetrics(KVConnectorPromMetrics):
    """The ``pdserve:kv_*`` metrics of one API server; ``observe`` is called with each interval's ``data``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: type, name: str, doc: str, **kwargs: Any) -> dict[int, Any]:
            metric = cls(name=name, documentation=doc, labelnames=labelnames, **kwargs)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        def per_engine_and(label: str, values: tuple[str, ...], name: str, doc: str) -> dict[int, dict[str, Any]]:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            return {
                idx: {value: metric.labels(*labelvalues, value) for value in values}
                for idx, labelvalues in per_engine_labelvalues.items()
            }

        self.bytes = per_engine(self._counter_cls, "pdserve:kv_transfer_bytes", "KV bytes read from prefill engines.")
        self.transfers = per_engine(self._counter_cls, "pdserve:kv_transfers", "KV reads that completed.")
        self.seconds = per_engine(
            self._histogram_cls,
            "pdserve:kv_transfer_seconds",
            "Time of one request's KV read, posted to done.",
            buckets=_SECONDS_BUCKETS,
        )
        self.gbps = per_engine(
            self._histogram_cls,
            "pdserve:kv_transfer_gbps",
            "Achieved throughput of one request's KV read, in GB/s (1e9 bytes/s).",
            buckets=_GBPS_BUCKETS,
        )
        self.failures = per_engine_and(
            "kind", FAILURE_KINDS, "pdserve:kv_transfer_failures", "KV loads that failed, by kind (then recomputed)."
        )
        self.leases = per_engine_and(
            "outcome",
            LEASE_OUTCOMES,
            "pdserve:kv_leases",
            "Prefill KV leases that ended, by outcome; pins and refused releases.",
        )
        self.refused = per_engine_and(
            "kind",
            REFUSED_KINDS,
            "pdserve:kv_refused",
            "Side-channel messages and transfer parameters that failed the cluster's authentication.",
        )
        self.recomputed = per_engine(
            self._counter_cls, "pdserve:kv_recomputed_tokens", "Prompt tokens recomputed after a failed KV load."
        )
        self.quarantined = per_engine(
            self._counter_cls,
            "pdserve:kv_quarantined_blocks",
            "Decode KV blocks kept out of use for good: an aborted READ into them never confirmed it was over.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for num_bytes, seconds in transfer_stats_data.get("transfers", ()):
            self.bytes[engine_idx].inc(num_bytes)
            self.transfers[engine_idx].inc()
            self.seconds[engine_idx].observe(seconds)
            if seconds > 0:
                self.gbps[engine_idx].observe(num_bytes / seconds / 1e9)
        for kind, count in transfer_stats_data.get("failures", {}).items():
            if kind in self.failures[engine_idx]:
                self.failures[engine_idx][kind].inc(count)
        for outcome, count in transfer_stats_data.get("leases", {}).items():
            if outcome in self.leases[engine_idx]:
                self.leases[engine_idx][outcome].inc(count)
        for kind, count in transfer_stats_data.get("refused", {}).items():
            if kind in self.refused[engine_idx]:
                self.refused[engine_idx][kind].inc(count)
        if tokens := transfer_stats_data.get("recomputed_tokens", 0):
            self.recomputed[engine_idx].inc(tokens)
        if blocks := transfer_stats_data.get("quarantined_blocks", 0):
            self.quarantined[engine_idx].inc(blocks)


@dataclasses.dataclass
class PdserveWorkerMeta(KVConnectorWorkerMetadata):
    """Per-request load reports of one step, worker -> scheduler side (keyed by request id)."""

    reports: dict[str, KVReport] = dataclasses.field(default_factory=dict)
    quarantined: set[str] = dataclasses.field(default_factory=set)
    """Requests a READ into whose blocks may still land (never confirmed drained): their blocks are never reused."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PdserveWorkerMeta:
        if not isinstance(other, PdserveWorkerMeta):
            raise TypeError(f"cannot aggregate PdserveWorkerMeta with {type(other).__name__}")
        self.quarantined |= other.quarantined
        for request_id, report in other.reports.items():
            mine = self.reports.get(request_id)
            self.reports[request_id] = report if mine is None else mine.merge(report)
        return self
