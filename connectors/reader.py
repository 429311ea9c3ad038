"""Decode side of the pdserve connector's worker: pins prefill blocks, posts READs, reports loads.

For each request the scheduler side asks to receive (``receive``):

1. ``source_ranks`` says which prefill ranks this rank reads (from the prefill
   TP size in ``kv_transfer_params``): one when prefill TP <= decode TP, several
   when it is larger, one holder per head when heads are replicated.
2. Each of those ranks must be a known peer (``connectors.sources.SourceRanks``:
   a handshake with each rank and start on a background thread, the transport
   that reaches it, the runs this rank reads from it). The request waits for
   its ranks without holding up the engine's step.
3. Each source rank is asked for a pin over its side channel (``ask_pin``):
   the holder keeps the blocks for this reader until its READ notification or
   its release, and refuses a release that names no reader meanwhile. Parameters
   of another start of the prefill engine (``pdserve_epoch``) are answered GONE
   and never read through an older mapping: a mapping belongs to one start.
4. One READ per remote rank, straight into the local cache, each notifying
   ``read_notification(prefill request id, readers of that rank, this reader)``
   -- through the transport (NIXL), or over the side channel once the read is
   done (a transport that cannot, CUDA IPC). Decode rank 0 also releases the
   prefill ranks nobody reads (replicas), so they free their blocks at once.

A READ must end while the prefill's lease on its blocks holds. The parameters
say when the lease ends (``pdserve_expires``, MAC'd); a READ is posted only
before ``expires - read_margin_s`` (the margin covers the two hosts' clocks),
one still pending then is aborted, and one seen done only after it is not
trusted: all three fail as ``expired`` and the prompt is recomputed.

Each request is one ``connectors.reads.ReadRecord`` (CHECKED, PINNING,
READING, then DONE, or ABORTED and DRAINED): a failed or aborted load is
reported to vLLM (its blocks recomputed) only once none of its READs can still
land, and then every prefill rank is released in this reader's name. A READ
its transport never confirms drained by the record's end (lease + margin at
most) is quarantined: the load is reported failed, the request id goes to the
scheduler side in ``PdserveWorkerMeta.quarantined`` (which keeps its blocks
out of vLLM's pool for good), and the READ is kept here until it drains, so
its transport can let go of it.

A mapping of a source rank is dropped (after a failed READ from it, or once
another start of it is known) only when no record that has not ended names it
(``_mapping_in_use``): a record waiting for its pins posts through the mapping
it was checked with. Every load ends in a per-request report
(``take_reports``), also kept for the proxy's report queries on the side
channel (a stream's ``X-PDServe-KV``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_any

from connectors.errors import ConnectorError, TopologyError, registered
from connectors.identity import mapping_name, peer_name
from connectors.leases import PinAnswer, read_notification
from connectors.metadata import KVTransferParams, ReceiveSpec
from connectors.options import ConnectorSettings
from connectors.reads import ReadPhase, ReadRecord, drained
from connectors.side_channel import RecentReports
from connectors.side_client import PeerClient
from connectors.side_messages import report_key
from connectors.sources import SourceRanks
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from connectors.topology import KVTopology, reader_ranks, source_ranks
from connectors.transport.base import Transfer
from connectors.transport.group import WorkerTransports
from contract.auth import KVAuth
from contract.kv_report import KVReport

__all__ = ["KVReader"]

logger = logging.getLogger(__name__)


def _rank_of(name: str) -> int:
    return int(name.rpartition("/rank")[2].partition("@")[0])


LOAD_POLL_S = 0.0002  # how often ``_await_begun`` looks at READs in flight


class KVReader:
    """The decode side of one TP rank; driven by the model runner's thread (``attach`` once caches exist).

    Each request is one ``connectors.reads.ReadRecord`` in ``_records`` from ``receive`` until it ends (DONE or
    DRAINED) and is reported by ``poll``; nothing else is kept by request id.
    """

    def __init__(
        self,
        engine_id: str,
        settings: ConnectorSettings,
        auth: KVAuth,
        answered: RecentReports,
        *,
        peers: PeerClient | None = None,
        executor: Executor | None = None,
    ) -> None:
        """``peers`` asks the prefill ranks' side channels (handshakes, pins, releases); ``executor`` runs its
        handshakes and pins off the engine's thread (a pool of 4 threads by default)."""
        self.engine_id = engine_id
        self.settings = settings
        self._answered = answered  # read by the side-channel thread (the proxy's report queries)
        self._transport: WorkerTransports | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._stats = PdserveKVStats()
        self._reports: dict[str, KVReport] = {}
        self._side = peers or PeerClient(engine_id, auth)
        self._releases_out = self._side.releases
        self._handshake_pool = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-handshake")
        # remote ranks are keyed by mapping_name(engine_id, rank, epoch)
        self._sources = SourceRanks(engine_id, self._side, self._handshake_pool, self._mapping_in_use)
        self._records: dict[str, ReadRecord] = {}
        self._quarantine: list[Transfer] = []  # READs never confirmed drained, kept until they drain
        self._quarantined: set[str] = set()  # requests quarantined since the last ``take_reports``
        self._begun: set[str] = set()  # requests whose load began since the last poll (``_await_begun``)
        self._pins: dict[tuple[str, str], Future[PinAnswer]] = {}  # (request id, source) -> its pin, asked
        self._load_error_block_ids: set[int] = set()
        self._faults = random.Random(settings.fault_injection.seed)
        self._clock = time.time  # wall clock: the prefill host's lease end is a unix time

    def attach(self, transport: WorkerTransports, topology: KVTopology, kernel_blocks_per_block: int) -> None:
        """This rank's transports and topology, once its caches are registered."""
        self._transport, self._topology = transport, topology
        self._kernel_blocks_per_block = kernel_blocks_per_block
        self._sources.attach(transport, topology)

    @property
    def name(self) -> str:
        """This rank's name in pins, releases and READ notifications."""
        return peer_name(self.engine_id, self._require_topology().tp_rank)

    def receive(self, spec: ReceiveSpec) -> None:
        """Start loading ``spec``'s KV: handshakes as needed, then pins, then its READs (``poll`` follows them)."""
        self._require_transport()
        topology = self._require_topology()
        remote = spec.remote
        epoch = remote.pdserve_epoch or ""
        try:
            ranks = source_ranks(topology, remote.tp_size)
        except TopologyError as e:
            ranks, failure = (), ("incompatible", f"cannot read from prefill TP {remote.tp_size}: {e}")
        else:
            failure = None
        record = ReadRecord(
            spec,
            tuple(mapping_name(remote.remote_engine_id, rank, epoch) for rank in ranks),
            self._read_deadline(spec),
            drain_timeout_s=self.settings.transfer_timeout_s,
            ends_by=self._end_by(spec),
            hold_s=self.settings.fault_injection.read_hold_s,
        )
        self._records[spec.request_id] = record
        self._begun.add(spec.request_id)
        failure_rate = self.settings.fault_injection.read_failure_rate
        if spec.failure:
            failure = ("internal", f"the scheduler side could not plan the read: {spec.failure}")
        elif failure is None and self._clock() >= record.deadline:
            failure = ("expired", f"the READ could not be posted {self.settings.read_margin_s:g} s before the end "
                       "of the prefill's lease: its blocks may be another request's by then")  # fmt: skip
        elif failure is None and failure_rate and self._faults.random() < failure_rate:
            failure = ("injected", f"fault injection (read_failure_rate={failure_rate})")
        if failure is not None:
            record.fail(*failure, now=self._clock())
            return
        timeout_s = self.settings.handshake_timeout_s
        for rank, key in zip(ranks, record.sources, strict=True):
            endpoint = remote.side_channel(rank)
            self._sources.want(key, remote.remote_engine_id, rank, remote.tp_size, epoch, endpoint, timeout_s)
        self._advance()

    def _advance(self) -> None:
        """Move every record as far as it can go now: handshakes, pins, posts, polls."""
        self._sources.drop_stale()
        self._quarantine = [read for read in self._quarantine if not drained(read)]
        self._sources.connect_answered()
        for (request_id, source), future in list(self._pins.items()):
            if not future.done():
                continue
            del self._pins[(request_id, source)]
            error = future.exception()
            answer = None if error is not None else future.result()
            record = self._records.get(request_id)
            if record is None or record.ended:
                if answer is PinAnswer.OK and record is not None:  # granted after the load ended: give it back
                    self._release_rank(record.spec.remote, int(_rank_of(source)))
                continue
            record.pin_answered(source, answer, str(error or ""))
        now = self._clock()
        for record in self._records.values():
            if record.phase is ReadPhase.CHECKED:
                if any(self._sources.asking(key) for key in record.sources):
                    continue
                missing = [key for key in record.sources if self._sources.get(key) is None]
                if missing:
                    record.fail(*self._sources.failure(missing[0]), now=now)
                    continue
                record.sources_known()
            if record.phase is ReadPhase.PINNING:
                for source in record.pins_to_ask():
                    self._ask_pin(record, source)
                if record.ready_to_post(now):
                    self._post_read(record)
            record.poll(now)

    def _ask_pin(self, record: ReadRecord, source: str) -> None:
        params = record.spec.remote
        endpoint = params.side_channel(int(_rank_of(source)))
        self._pins[(record.request_id, source)] = self._handshake_pool.submit(
            self._side.pin, endpoint, self.name, params.remote_request_id, params.pdserve_epoch or "",
            self.settings.handshake_timeout_s,
        )  # fmt: skip

    def _post_read(self, record: ReadRecord) -> None:
        spec, names = record.spec, record.sources
        remote = spec.remote
        transports = self._require_transport()
        reads: list[Transfer] = []
        try:
            for name in names:
                source = self._sources.get(name)
                if source is None:  # never so while the record names it (``_mapping_in_use``)
                    raise ConnectorError(f"no mapping of {name} to read through")
                transport = transports.get(source.transport)
                local_ids, remote_ids = self._kernel_block_ids(spec, source.topology)
                notify = read_notification(remote.remote_request_id, source.expected_reads, self.name)
                reads.append(transport.read_blocks(name, local_ids, remote_ids, notify=notify))
        except ConnectorError as e:
            record.posted(reads)
            record.fail("transport", str(e), self._clock())
            return
        record.posted(reads)
        logger.debug(
            "request %s on engine %s: READs of %d blocks from %s posted",
            spec.request_id,
            self.engine_id,
            len(spec.local_block_ids),
            ", ".join(names),
        )
        if self._require_topology().tp_rank == 0:
            self._release_unread_ranks(spec, self._sources.get(names[0]).topology)

    def _release_unread_ranks(self, spec: ReceiveSpec, remote: KVTopology) -> None:
        """Free at once the blocks of prefill ranks no decode rank reads (replicas of heads read elsewhere)."""
        local = self._require_topology()
        params = spec.remote
        for rank in range(remote.tp_size):
            if not reader_ranks(rank, local, remote):
                self._release_rank(params, rank)

    def _kernel_block_ids(self, spec: ReceiveSpec, remote: KVTopology) -> tuple[list[int], list[int]]:
        """The request's local and remote blocks as the cache tensors count them, local ones trimmed to the read.

        ``remote.block_size`` is the source's tensor block size; the prefill's
        logical block size comes in the params (ours when they do not say).
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

    def fail(self, spec: ReceiveSpec, kind: str, reason: str) -> None:
        """Fail ``spec``'s load (reported by a later ``poll`` once no READ of it can land; vLLM recomputes)."""
        record = self._records.get(spec.request_id)
        if record is None:
            record = self._records[spec.request_id] = ReadRecord(spec, (), self._read_deadline(spec))
        record.fail(kind, reason, self._clock())

    def _read_deadline(self, spec: ReceiveSpec) -> float:
        """The wall-clock time by which ``spec``'s READs must be over (its lease's end less the margin)."""
        expires = spec.remote.pdserve_expires
        return float("inf") if expires is None else expires - self.settings.read_margin_s

    def _end_by(self, spec: ReceiveSpec) -> float:
        """The wall-clock time by which ``spec``'s record ends whatever its READs do (the lease's end plus the
        margin: a holder keeps pinned blocks that long for a reader it no longer hears from)."""
        expires = spec.remote.pdserve_expires
        return float("inf") if expires is None else expires + self.settings.read_margin_s

    def poll(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` since the last call; a failed load is in both.

        A request is reported only when its record ended: DONE, or DRAINED (no READ of it can land any more).
        """
        if self._transport is None:
            return set(), set()
        self._advance()
        self._await_begun()
        finished: set[str] = set()
        failed: set[str] = set()
        for request_id, record in list(self._records.items()):
            if not record.ended or any(key[0] == request_id for key in self._pins):
                continue  # a pin still being asked: its answer decides whether a release is owed
            del self._records[request_id]
            finished.add(request_id)
            if record.phase is ReadPhase.DONE:
                self._loaded(record)
            else:
                failed.add(request_id)
                self._failed(record)
        return finished, failed

    def _await_begun(self) -> None:
        """Give the loads begun since the last poll up to ``load_wait_s`` to land before ``poll`` reports.

        vLLM asks for a step's load results right after its forward (the connector begins the loads when the
        step's metadata is bound, before it): a load whose pin was answered during the forward posts its READ
        only now, and one still waiting for that READ or for its pin's answer (a round trip to the prefill
        engine) would show only at the end of the next step, its request joining the batch a step later than
        it could (a whole step of its TTFT, for a wait of a few ms here). Waiting only ever ends sooner than
        the budget; every phase moves as ``_advance`` moves it anyway (deadlines, holds and aborts included).
        """
        begun, self._begun = self._begun, set()
        deadline = time.monotonic() + self.settings.load_wait_s
        while True:
            loading = [
                record
                for request_id in begun
                if (record := self._records.get(request_id)) is not None
                and record.phase in (ReadPhase.CHECKED, ReadPhase.PINNING, ReadPhase.READING)
            ]
            left = deadline - time.monotonic()
            if not loading or left <= 0:
                return
            asked = [future for (request_id, _), future in self._pins.items() if request_id in begun]
            asked += self._sources.answers()
            if asked:  # an answer is what they wait for: sleep until one comes (the GIL is free meanwhile)
                wait_for_any(asked, timeout=min(left, LOAD_POLL_S * 10), return_when=FIRST_COMPLETED)
            else:  # READs in flight
                time.sleep(min(left, LOAD_POLL_S))
            self._advance()

    def _loaded(self, record: ReadRecord) -> None:
        spec = record.spec
        transports = self._require_transport()
        sources = [self._sources.get(read.peer) for read in record.reads]
        for source in sources:
            if source is not None and not transports.get(source.transport).notifies_source:
                notify = read_notification(spec.remote.remote_request_id, source.expected_reads, self.name)
                self._releases_out.read_done(spec.remote.side_channel(source.topology.tp_rank), self.name, notify)
        num_bytes = sum(read.num_bytes for read in record.reads)
        elapsed_s = max((read.elapsed_s for read in record.reads), default=0.0)
        transport = next((source.transport for source in sources if source is not None), "")
        self._stats.record_transfer(num_bytes, elapsed_s)
        ranks = [_rank_of(read.peer) for read in record.reads]
        self._report(spec, KVReport.transfer(num_bytes, round(elapsed_s * 1e3, 3), transport,
                                             spec.remote.remote_engine_id, ranks))  # fmt: skip
        logger.debug(
            "request %s on engine %s: read %d bytes from %d rank(s) in %.1f ms",
            spec.request_id,
            self.engine_id,
            num_bytes,
            len(record.reads),
            elapsed_s * 1e3,
        )

    def _failed(self, record: ReadRecord) -> None:
        spec = record.spec
        kind, reason = record.failure or ("internal", "the load ended without a result")
        self._load_error_block_ids.update(spec.local_block_ids)
        self._stats.record_failure(kind)
        self._report(spec, KVReport.recomputed(kind, reason, spec.remote.remote_engine_id))
        # Nobody here will read those blocks now: every prefill rank may free them (ours: our pin ends).
        for rank in range(max(1, spec.remote.tp_size)):
            self._release_rank(spec.remote, rank)
        if record.quarantined:
            undrained = [read for read in record.reads if not drained(read)]
            self._quarantine.extend(undrained)
            self._quarantined.add(spec.request_id)
            logger.error(
                "request %s on engine %s: %d aborted READ(s) from %s never confirmed drained; its %d blocks are "
                "quarantined (never reused) and the prompt is recomputed in others",
                spec.request_id,
                self.engine_id,
                len(undrained),
                ", ".join(read.peer for read in undrained),
                len(spec.local_block_ids),
            )
        logger.warning(
            "request %s on engine %s: KV load from engine %s failed (%s), the prompt will be recomputed: %s",
            spec.request_id,
            self.engine_id,
            spec.remote.remote_engine_id,
            kind,
            reason,
        )
        if record.failed_peer is not None:
            self._sources.forget(record.failed_peer)

    def _release_rank(self, params: KVTransferParams, rank: int) -> None:
        """Release, in this reader's name, prefill rank ``rank``'s blocks of ``params`` (ends only our pin there)."""
        self._releases_out.release(params.side_channel(rank), params.remote_request_id, self.name)

    def _mapping_in_use(self, name: str) -> bool:
        """Whether a record that has not ended names ``name``'s mapping, or a READ that can still land uses it."""
        in_use = any(name in record.sources and not record.ended for record in self._records.values())
        return in_use or any(read.peer == name for read in self._quarantine)

    def take_load_errors(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def _report(self, spec: ReceiveSpec, report: KVReport) -> None:
        """How ``spec``'s KV got here: for the scheduler side (the request's ``kv_transfer_params``) and for
        the proxy, which asks the side channel for it when a stream starts (a stream has no ``kv_transfer_params``)."""
        self._reports[spec.request_id] = report
        self._answered.add(report_key(spec.remote.remote_engine_id, spec.remote.remote_request_id), report)

    def take_reports(self) -> PdserveWorkerMeta | None:
        if not self._reports and not self._quarantined:
            return None
        reports, self._reports = self._reports, {}
        quarantined, self._quarantined = self._quarantined, set()
        return PdserveWorkerMeta(reports=reports, quarantined=quarantined)

    def take_stats(self) -> PdserveKVStats:
        stats, self._stats = self._stats, PdserveKVStats()
        return stats

    def shutdown(self) -> None:
        for record in self._records.values():
            record.fail("internal", "engine shutting down", self._clock())
        self._records.clear()
        self._handshake_pool.shutdown(wait=False, cancel_futures=True)
        self._side.close()

    def _require_transport(self) -> WorkerTransports:
        return registered(self._transport, self.engine_id)

    def _require_topology(self) -> KVTopology:
        return registered(self._topology, self.engine_id)


def _expand(block_ids: Sequence[int], per_block: int) -> list[int]:
    """Block ids in units ``per_block`` times smaller: block b becomes [b*per_block, (b+1)*per_block)."""
    if per_block == 1:
        return list(block_ids)
    return [block * per_block + i for block in block_ids for i in range(per_block)]
