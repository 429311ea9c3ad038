"""Decode side of the pdserve connector's worker: handshakes with prefill ranks, posts READs, reports loads.

For each request the scheduler side asks to receive (``receive``):

1. ``source_ranks`` says which prefill ranks this rank reads (from the prefill
   TP size in ``kv_transfer_params``): one when prefill TP <= decode TP, several
   when it is larger, one holder per head when heads are replicated.
2. Each of those ranks must be a known peer: a handshake with
   ``remote_port + rank`` runs on a background thread, once per remote rank
   (``HandshakeCache``); the answer says which transports the rank offers and
   on which node it is, and the first of ``connectors.transport.common_transports``
   that can reach it takes it (CUDA IPC when this process sees the source's GPU,
   NIXL otherwise); its ``add_peer`` prepares the runs this rank reads from it
   (``block_ranges.plan_peer_ranges``: its head slice, several remote blocks per
   local block when the remote block size is smaller). The request waits for
   its ranks without holding up the engine's step.
3. One READ per remote rank, straight into the local cache, each notifying
   ``read_notification(prefill request id, readers of that rank)`` -- through
   the transport (NIXL), or over the side channel once the read is done (a
   transport that cannot, CUDA IPC). Decode rank
   0 also releases the prefill ranks nobody reads (replicas), so they free
   their blocks at once.

A READ must end while the prefill's lease on its blocks holds: after that the
prefill engine may have given them to another request, and a READ of them
would serve someone else's KV. The parameters say when the lease ends
(``pdserve_expires``, MAC'd); a READ is posted only before ``expires -
read_margin_s`` (the margin covers the two hosts' clocks), one still pending
then is aborted, and one seen done only after it is not trusted: all three
fail as ``expired`` and the prompt is recomputed. (The lease itself starts when
the prefill's worker takes it, after the parameters were signed, so it ends
no earlier than ``pdserve_expires``.)

``poll`` polls the reads: a request whose READs are all DONE is finished; if
one FAILED the others are aborted, the request is finished too, its local
block ids go to ``take_load_errors`` so vLLM recomputes those tokens, and every
prefill rank is told to release its blocks at once. Every load ends in a
per-request report (``take_reports``), also kept for the proxy's report
queries on the side channel (a stream's ``X-PDServe-KV``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from connectors.auth import KVAuth, Unauthenticated
from connectors.block_ranges import KVRegions, PlaneRanges, plan_peer_ranges
from connectors.errors import ConnectorError, HandshakeRejected, TopologyError, TransportError
from connectors.handshake import HandshakeCache, HandshakeResponse
from connectors.leases import read_notification
from connectors.metadata import ReceiveSpec
from connectors.options import ConnectorSettings
from connectors.side_channel import RecentReports, ReleaseSender, report_key, request_handshake
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from connectors.topology import KVTopology, reader_ranks, source_ranks
from connectors.transport import common_transports, node_identity, where
from connectors.transport.base import Transfer, TransferState
from connectors.transport.group import WorkerTransports

__all__ = ["KVReader", "peer_name"]

logger = logging.getLogger(__name__)


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
    """One request's READs, one per remote rank it reads, and the notifications owed to sources over their
    side channels (``(endpoint, notification)``, for READs whose transport does not send them)."""

    spec: ReceiveSpec
    reads: list[Transfer]
    notifications: list[tuple[str, bytes]]


def peer_name(engine_id: str, tp_rank: int) -> str:
    """The transport's name of a remote engine's rank."""
    return f"{engine_id}/rank{tp_rank}"


class KVReader:
    """The decode side of one TP rank; driven by the model runner's thread (``attach`` once caches exist)."""

    def __init__(self, engine_id: str, settings: ConnectorSettings, auth: KVAuth, answered: RecentReports) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self._auth = auth
        self._answered = answered  # read by the side-channel thread (the proxy's report queries)
        self._transport: WorkerTransports | None = None
        self._topology: KVTopology | None = None
        self._kernel_blocks_per_block = 1
        self._stats = PdserveKVStats()
        self._reports: dict[str, dict[str, Any]] = {}
        self._releases_out = ReleaseSender(engine_id, auth)
        # remote ranks are keyed by peer_name(engine_id, rank)
        self._handshakes = HandshakeCache()
        self._handshake_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-handshake")
        self._handshaking: dict[str, _Handshake] = {}
        self._peers: dict[str, _SourceRank] = {}
        self._peer_failures: dict[str, tuple[str, str]] = {}  # failed handshakes: (kind, reason)
        self._waiting_for_peer: dict[str, tuple[ReceiveSpec, tuple[int, ...]]] = {}
        self._reads: dict[str, _RequestReads] = {}
        self._failed_now: list[_Failure] = []
        self._load_error_block_ids: set[int] = set()
        self._faults = random.Random(settings.fault_injection.seed)
        self._clock = time.time  # wall clock: the prefill host's lease end is a unix time

    def attach(self, transport: WorkerTransports, topology: KVTopology, kernel_blocks_per_block: int) -> None:
        """This rank's transports and topology, once its caches are registered."""
        self._transport, self._topology = transport, topology
        self._kernel_blocks_per_block = kernel_blocks_per_block

    def receive(self, spec: ReceiveSpec) -> None:
        """Start loading ``spec``'s KV: handshakes as needed, then its READs (``poll`` follows them)."""
        self._require_transport()
        topology = self._require_topology()
        remote = spec.remote
        if spec.failure:
            self.fail(spec, "internal", f"the scheduler side could not plan the read: {spec.failure}")
            return
        if self._past_read_window(spec):
            return
        failure_rate = self.settings.fault_injection.read_failure_rate
        if failure_rate and self._faults.random() < failure_rate:
            self.fail(spec, "injected", f"fault injection (read_failure_rate={failure_rate})")
            return
        try:
            ranks = source_ranks(topology, remote.tp_size)
        except TopologyError as e:
            self.fail(spec, "incompatible", f"cannot read from prefill TP {remote.tp_size}: {e}")
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
            if self._past_read_window(spec):
                continue
            missing = [name for name in names if name not in self._peers]
            if missing:
                failure = self._peer_failures.get(missing[0], ("unreachable", f"no handshake with {missing[0]}"))
                self.fail(spec, *failure)
                continue
            self._post_read(spec, names)

    def _connect_peer(self, name: str, handshake: _Handshake) -> None:
        future = handshake.future
        try:
            response = future.result()
            remote = response.topology
            if remote.tp_size != handshake.tp_size:
                raise HandshakeRejected(
                    "incompatible",
                    [f"{name} has TP size {remote.tp_size}, its kv_transfer_params said {handshake.tp_size}"],
                )
            local_topology = self._require_topology()
            ranges = plan_peer_ranges(local_topology, remote)
            chosen = self._add_peer(name, response, ranges)
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

    def _add_peer(self, name: str, response: HandshakeResponse, ranges: PlaneRanges) -> str:
        """Add the peer to the best transport both sides have that can reach it; returns that transport's name."""
        transports = self._require_transport()
        local = transports.kv_regions()
        regions = KVRegions(
            layer_names=local.layer_names,  # the handshake checked both sides have the same layers
            region_addrs=response.kv_caches_base_addr,
            num_blocks=response.num_blocks,
            block_len_bytes=response.block_len,
            mem_type=local.mem_type,
            device_id=local.device_id,
        )
        place = where(node_identity(), response.node)
        reasons = []
        for chosen in common_transports(transports.names, response.transports, place):
            transport, payload = transports.get(chosen), response.payload_for(chosen)
            reason = transport.cannot_read(payload)
            if reason is None:
                try:
                    transport.add_peer(name, payload, regions, ranges)
                    return chosen
                except TransportError as e:
                    reason = str(e)
            reasons.append(f"{chosen}: {reason}")
            logger.info("engine %s: %s not over %s: %s", self.engine_id, name, chosen, reason)
        raise TransportError(
            f"no KV transport reaches {name} ({place}): we have {', '.join(transports.names)}, it offers "
            f"{', '.join(response.transports)}" + (f" ({'; '.join(reasons)})" if reasons else "")
        )

    def _peer_failed(self, name: str, handshake: _Handshake, kind: str, reason: str) -> None:
        self._handshakes.invalidate(handshake.engine_id, handshake.tp_rank)
        self._peer_failures[name] = (kind, reason)
        log = logger.error if kind in ("incompatible", "version") else logger.warning
        log("engine %s: cannot exchange KV with %s (%s): %s", self.engine_id, name, kind, reason)

    def _post_read(self, spec: ReceiveSpec, names: list[str]) -> None:
        remote = spec.remote
        transports = self._require_transport()
        reads: list[Transfer] = []
        notifications: list[tuple[str, bytes]] = []
        try:
            for name in names:
                source = self._peers[name]
                transport = transports.get(source.transport)
                local_ids, remote_ids = self._kernel_block_ids(spec, source.topology)
                notify = read_notification(remote.remote_request_id, source.expected_reads)
                reads.append(transport.read_blocks(name, local_ids, remote_ids, notify=notify))
                if not transport.notifies_source:
                    notifications.append((remote.side_channel(source.topology.tp_rank), notify))
        except ConnectorError as e:
            for read in reads:
                read.abort("another READ of the request could not be posted")
            self.fail(spec, "transport", str(e))
            return
        logger.debug(
            "request %s on engine %s: READs of %d blocks from %s posted",
            spec.request_id,
            self.engine_id,
            len(spec.local_block_ids),
            ", ".join(names),
        )
        self._reads[spec.request_id] = _RequestReads(spec, reads, notifications)
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

    def fail(self, spec: ReceiveSpec, kind: str, reason: str) -> None:
        """Fail ``spec``'s load (reported by the next ``poll``; vLLM recomputes its prompt)."""
        self._failed_now.append(_Failure(spec, kind, reason))

    def _read_deadline(self, spec: ReceiveSpec) -> float:
        """The wall-clock time by which ``spec``'s READs must be over (its lease's end less the margin)."""
        expires = spec.remote.pdserve_expires
        return float("inf") if expires is None else expires - self.settings.read_margin_s

    def _past_read_window(self, spec: ReceiveSpec, what: str = "posted") -> bool:
        """Fail ``spec`` as expired (True) if its READs can no longer end inside the prefill's lease."""
        late_s = self._clock() - self._read_deadline(spec)
        if late_s < 0:
            return False
        self.fail(
            spec,
            "expired",
            f"the READ would be {what} {late_s:.1f} s past the end of the prefill's lease less "
            f"{self.settings.read_margin_s:g} s: its blocks may be another request's by then",
        )
        return True

    def poll(self) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` since the last call; a failed load is in both."""
        if self._transport is None:
            return set(), set()
        self._post_reads()
        finished: set[str] = set()
        for request_id, group in list(self._reads.items()):
            states = [read.poll() for read in group.reads]
            failed_read = next((read for read in group.reads if read.state is TransferState.FAILED), None)
            spec = group.spec
            if failed_read is None and TransferState.PENDING in states:
                if self._past_read_window(spec, "pending"):
                    del self._reads[request_id]
                    for read in group.reads:
                        read.abort("the prefill's lease on its blocks is ending")
                continue
            del self._reads[request_id]
            if failed_read is None and self._past_read_window(spec, "seen done"):
                continue  # done, but maybe after the blocks were freed: not trusted
            if failed_read is not None:
                for read in group.reads:
                    read.abort(f"the READ from {failed_read.peer} failed")
                self.fail(spec, "transport", f"KV read failed: {failed_read.failure_reason}")
                self._forget_peer(failed_read.peer)
                continue
            finished.add(request_id)
            self._notify_sources(group)
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

    def _notify_sources(self, group: _RequestReads) -> None:
        """Send the READ notifications the transports could not (over each source's side channel)."""
        reader = peer_name(self.engine_id, self._require_topology().tp_rank)
        for endpoint, notification in group.notifications:
            self._releases_out.read_done(endpoint, reader, notification)

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
            self._require_transport().get(source.transport).remove_peer(name)

    def take_load_errors(self) -> set[int]:
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

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

    def take_stats(self) -> PdserveKVStats:
        stats, self._stats = self._stats, PdserveKVStats()
        return stats

    def shutdown(self) -> None:
        for group in self._reads.values():
            for read in group.reads:
                read.abort("engine shutting down")
        self._reads.clear()
        self._handshake_pool.shutdown(wait=False, cancel_futures=True)
        self._releases_out.close()

    def _require_transport(self) -> WorkerTransports:
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
