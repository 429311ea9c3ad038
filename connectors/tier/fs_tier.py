"""``PdserveFsTier``: vLLM's filesystem tier with checked entries, a byte budget and its own metrics.

vLLM 0.32's ``FileSystemTierManager`` does the scheduling (an I/O thread pool,
batched existence lookups, partial-failure bookkeeping, the model/layout
namespace of ``FileMapper``); this subclass keeps all of that and changes what
an entry is (``connectors.tier.store``): MAC'd, fsynced before it is renamed
into place, private (0600 in 0700 directories), bounded by ``max_bytes`` with LRU
eviction. What vLLM's tier lacks and this one adds: refusal of torn, corrupt or
foreign entries (deleted and recomputed), eviction, and the metrics below.

**The tier outlives its cluster and trusts only its owner.** The MAC key is the
tier's own (``connectors.tier.key``): random, made by the first engine that opens
the directory, kept there in ``pdserve-kv-tier.key`` (0600 in the 0700 root), read
by every engine that opens it. A cluster started again, with a new cluster secret,
loads what the one before it stored; an entry written or altered by anyone who
cannot read the key file (anyone but the directory's owner) is refused and its
blocks are computed again. Namespaces of older entry formats and keys are removed
when the tier opens (``connectors.tier.cleanup``), and logged.

**A directory the tier cannot trust fails the engine's start.** ``root_dir`` (and
the namespace directory in it) must be this user's own and writable by no one
else; one that is not raises ``UnsafeDirectory`` naming the path and the reason,
and vLLM's engine start fails with it (the engine's log says why). Not a tier
quietly left off: the user asked for it, a cluster without it only looks slow
(every prompt computed), and a directory others can write is a setting to fix,
not to serve around. A directory the tier creates is 0700; one that exists and is
ours but readable by others is narrowed to 0700. A key file that is not a regular
file of this user's that only it may read (0600) fails the start the same way.

Configured as a secondary tier of ``PdserveTierSpec``::

    {"type": "PdserveFsTier", "module_path": "connectors.tier.fs_tier",
     "root_dir": "/shared/kv", "max_bytes": 8589934592}

``root_dir`` gets one directory per entry format, key and engine layout
(``pdserve-v3-<key id>-cpu-<bytes per chunk>``), inside which ``FileMapper`` adds the
model, dtype, block size and layer names: a key is the chained hash of the
prompt's token blocks under that namespace, so the same tokens of another
model, dtype or layout never meet.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobId, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager, FsAsyncLookupManager
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

from connectors.tier.cleanup import remove_stale
from connectors.tier.held import write_layout
from connectors.tier.key import load_tier_key
from connectors.tier.store import VERSION, EntryStore
from contract.private_files import private_dir

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["TIER_METRICS", "PdserveFsTier", "namespace"]

logger = logging.getLogger(__name__)


class TIER_METRICS:  # noqa: N801 - a namespace of metric names, like vLLM's *Metrics classes
    """Prometheus names of what this tier adds (all labelled by ``tier``, the tier's configured name)."""

    HITS = "pdserve:kv_tier_hits"
    MISSES = "pdserve:kv_tier_misses"
    LOAD_BYTES = "pdserve:kv_tier_load_bytes"
    STORE_BYTES = "pdserve:kv_tier_store_bytes"
    LOAD_SECONDS = "pdserve:kv_tier_load_seconds"
    EVICTIONS = "pdserve:kv_tier_evictions"
    EVICTED_BYTES = "pdserve:kv_tier_evicted_bytes"
    CORRUPT = "pdserve:kv_tier_corrupt_entries"
    USED_BYTES = "pdserve:kv_tier_used_bytes"
    ENTRIES = "pdserve:kv_tier_entries"


def namespace(block_bytes: int, key_id: str) -> str:
    """The directory of one entry format, key and engine layout: ``pdserve-v3-<key id>-cpu-<bytes per chunk>``."""
    return f"pdserve-v{VERSION}-{key_id}-{current_platform.device_type or 'unknown'}-{block_bytes}"


class _CountingLookup(FsAsyncLookupManager):
    """Whether a key has an entry, counting each answer as a hit or a miss.

    ``async_lookup``: vLLM's batched lookup on a thread, which answers "not yet" (the
    scheduler's RETRY: the request waits an engine step) before it knows. Without it, the
    entry's file is looked up at once: one ``stat`` per key, a few microseconds on a local
    disk or tmpfs. The first key a request misses is a lookup on every turn of a conversation
    (the blocks it has not stored yet), so the wait it saves is paid on every turn.
    """

    def __init__(self, tier: PdserveFsTier, tier_type: str, async_lookup: bool) -> None:
        super().__init__(tier=tier, tier_type=tier_type)
        self.async_lookup = async_lookup
        self.hits = 0
        self.misses = 0

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if self.async_lookup:
            result = super().lookup(key, req_context)
        else:
            result = os.path.exists(self._tier.file_mapper.get_file_name(key))
        if result is True:
            self.hits += 1
        elif result is False:
            self.misses += 1
        return result


class PdserveFsTier(FileSystemTierManager):
    """A filesystem tier of checked entries under a byte budget (see the module's docstring)."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        max_bytes: int,
        fsync: bool = True,
        n_read_threads: int = 2,
        n_write_threads: int = 2,
        rescan_s: float = 30.0,
        async_lookup: bool = False,
        name: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
        **_: Any,
    ) -> None:
        # FileSystemTierManager.__init__ is not called: it writes vLLM's entry format
        # (O_DIRECT, unchecked). The state its methods use is set here.
        super(FileSystemTierManager, self).__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.name = name or tier_type
        self.locality = None
        self.events = None
        self._store_job_keys: dict[JobId, list[OffloadKey]] = {}
        self._load_job_keys: dict[JobId, list[OffloadKey]] = {}
        self._job_block_counts: dict[JobId, int] = {}
        self._load_progress: dict[JobId, int] = {}
        self._block_size = self.block_size_bytes
        self._use_o_direct = False
        # Before any entry is opened or named: a directory or key file it cannot trust fails the start (docstring).
        what = f"KV tier {self.name!r}"
        base = private_dir(Path(root_dir), f"{what} directory")
        key = load_tier_key(base, what)
        root = base / namespace(self._block_size, key.key_id)
        remove_stale(base, key.key_id, what)
        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=str(root),
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        self.entries = EntryStore(root, int(max_bytes), key=key.entry_key, fsync=bool(fsync), rescan_s=float(rescan_s))
        # for the engine's HTTP server, which answers the proxy what this tier holds (connectors.tier.held)
        write_layout(self.name, self.file_mapper.base_path, self.file_mapper.rank, offloading_spec)
        self._pool = DualQueueThreadPool(
            int(n_read_threads), int(n_write_threads), thread_name_prefix="pdserve_kv_tier"
        )
        self._lookup_manager = _CountingLookup(self, self.tier_type, bool(async_lookup))
        self._reported = {"hits": 0, "misses": 0}
        self._load_seconds: list[float] = []
        entries, used = self.entries.usage()
        logger.info(
            "KV tier %r at %s: up to %d bytes, %d entries (%d bytes) there; its key: %s",
            self.name, root, int(max_bytes), entries, used, key.path,
        )  # fmt: skip

    # --- transfers (run on the pool's threads) ------------------------------------------------

    def _chunk(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self._block_size
        return self._primary_kv_view.cast("B")[start : start + self._block_size]

    def _store(self, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        for key, chunk in zip(keys, chunk_ids, strict=True):
            self.entries.write(Path(self.file_mapper.get_file_name(key)), self._chunk(chunk))

    def _load(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        start = time.perf_counter()
        failed: OSError | None = None
        for i, (key, chunk) in enumerate(zip(keys, chunk_ids, strict=True)):
            try:
                self.entries.read(Path(self.file_mapper.get_file_name(key)), self._chunk(chunk))
            except OSError as exc:
                if failed is None:
                    failed = exc
                    self._load_progress[job_id] = i  # the blocks before it loaded (see the parent's get_finished_jobs)
                    logger.warning("KV tier %r: %s; the blocks from here on are recomputed", self.name, exc)
                # The rest are recomputed anyway; reading them on drops the corrupt ones too, so the
                # recomputed blocks are stored again (a store skips a key whose entry exists).
        if failed is not None:
            raise failed
        self._load_seconds.append(time.perf_counter() - start)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._job_block_counts[job_metadata.job_id] = len(keys)
        task = functools.partial(self._store, keys, [int(c) for c in job_metadata.chunk_ids])
        self._pool.enqueue_store(job_metadata.job_id, 1, [task])

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        task = functools.partial(self._load, job_id, keys, [int(c) for c in job_metadata.chunk_ids])
        self._pool.enqueue_load(job_id, 1, [task])

    # --- metrics ------------------------------------------------------------------------------

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        def counter(doc: str) -> OffloadingCounterMetadata:
            return OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))

        def gauge(doc: str) -> OffloadingGaugeMetadata:
            return OffloadingGaugeMetadata(documentation=doc, labelnames=("tier",))

        m = TIER_METRICS
        return {
            m.HITS: counter("Chunks found in the pdserve KV tier by a lookup."),
            m.MISSES: counter("Chunks looked up in the pdserve KV tier and not found."),
            m.LOAD_BYTES: counter("Bytes read from the pdserve KV tier (checked entries)."),
            m.STORE_BYTES: counter("Bytes written to the pdserve KV tier (new entries, headers included)."),
            m.LOAD_SECONDS: OffloadingHistogramMetadata(
                documentation="Seconds to read one load job's entries from the pdserve KV tier.",
                labelnames=("tier",),
                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            ),
            m.EVICTIONS: counter("Entries evicted (least recently used) to keep the tier within max_bytes."),
            m.EVICTED_BYTES: counter("Bytes of the entries evicted from the pdserve KV tier."),
            m.CORRUPT: counter("Torn, corrupt or foreign entries (wrong length, header or MAC): deleted, recomputed."),
            m.USED_BYTES: gauge("Bytes of the entries this engine knows in the pdserve KV tier."),
            m.ENTRIES: gauge("Entries this engine knows in the pdserve KV tier."),
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        label = (self.name,)
        m = TIER_METRICS
        hits, misses = self._lookup_manager.hits, self._lookup_manager.misses
        counters = self.entries.take_counters()
        for name, value in (
            (m.HITS, hits - self._reported["hits"]),
            (m.MISSES, misses - self._reported["misses"]),
            (m.LOAD_BYTES, counters.loaded_bytes),
            (m.STORE_BYTES, counters.stored_bytes),
            (m.EVICTIONS, counters.evictions),
            (m.EVICTED_BYTES, counters.evicted_bytes),
            (m.CORRUPT, counters.corrupt),
        ):
            if value:
                stats.increase_counter(name, value, label)
        self._reported = {"hits": hits, "misses": misses}
        seconds, self._load_seconds = self._load_seconds, []
        for s in seconds:
            stats.observe_histogram(m.LOAD_SECONDS, s, label)
        entries, used = self.entries.usage()
        stats.set_gauge(m.USED_BYTES, used, label)
        stats.set_gauge(m.ENTRIES, entries, label)
        return stats

    @override
    def shutdown(self) -> None:
        super().shutdown()
        logger.info("KV tier %r closed (%d entries, %d bytes)", self.name, *self.entries.usage())
