"""The prefill ranks one decode rank reads from: their handshakes, the transport that reaches each, their mappings.

A source rank is known by its mapping name (``connectors.identity.mapping_name``: engine id, TP rank and the
start of the engine, ``pdserve_epoch``). For each the reader (``connectors.reader.KVReader``) needs:

1. ``want`` starts a handshake with ``remote_port + rank`` on the reader's pool, unless the rank is known or
   being asked (``HandshakeCache``: one handshake per remote rank and start; a cached answer of another start
   is dropped and asked again);
2. ``connect_answered`` takes each answer: it must be of the TP size the parameters said and of the start they
   named (else the rank fails ``gone``: that start is over), and the first of
   ``connectors.transport.common_transports`` that can reach the rank takes it (CUDA IPC when this process sees
   the source's GPU, NIXL otherwise); its ``add_peer`` prepares the runs this rank reads from it
   (``block_ranges.plan_peer_ranges``: its head slice, several remote blocks per local block when the remote
   block size is smaller). A rank that cannot be reached keeps its failure (``failure``) until it is wanted
   again.
3. A mapping is dropped (``forget``: after a failed READ from it; or once another start of the rank connects)
   only when the reader says nothing uses it (``in_use``: no record that has not ended names it, no READ that
   can still land reads through it); until then it stays, and ``drop_stale`` tries again at every step. A
   forgotten rank is asked for a fresh handshake the next time it is wanted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from connectors.block_ranges import KVRegions, PlaneRanges, plan_peer_ranges
from connectors.errors import ConnectorError, HandshakeRejected, TransportError, registered
from connectors.handshake import HandshakeCache, HandshakeResponse
from connectors.side_client import PeerClient
from connectors.topology import KVTopology, reader_ranks
from connectors.transport import common_transports, node_identity, where
from connectors.transport.group import WorkerTransports
from contract.auth import Unauthenticated

__all__ = ["SourceRank", "SourceRanks"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Handshake:
    """A handshake with one remote rank for one start of it (``epoch``), running on the handshake pool."""

    engine_id: str
    tp_rank: int
    tp_size: int
    epoch: str
    future: Future[HandshakeResponse]


@dataclass(slots=True)
class SourceRank:
    """A remote rank added to a transport: its topology, how many local ranks read it, and the transport."""

    topology: KVTopology
    expected_reads: int
    transport: str


class SourceRanks:
    """The source ranks of one decode rank, by mapping name; driven by the reader on the model runner's thread.

    ``in_use(name)`` says whether the reader still posts, or may still land, a READ through ``name``'s mapping.
    """

    def __init__(self, engine_id: str, side: PeerClient, executor: Executor, in_use: Callable[[str], bool]) -> None:
        self.engine_id = engine_id
        self._side = side
        self._handshake_pool = executor
        self._in_use = in_use
        self._transport: WorkerTransports | None = None
        self._topology: KVTopology | None = None
        self._handshakes = HandshakeCache()
        self._handshaking: dict[str, _Handshake] = {}
        self._peers: dict[str, SourceRank] = {}
        self._peer_failures: dict[str, tuple[str, str]] = {}  # failed handshakes: (kind, reason)
        self._stale: set[str] = set()  # mappings to drop (and handshake again) once nothing uses them

    def attach(self, transport: WorkerTransports, topology: KVTopology) -> None:
        """This rank's transports and topology, once its caches are registered."""
        self._transport, self._topology = transport, topology

    def get(self, name: str) -> SourceRank | None:
        return self._peers.get(name)

    def asking(self, name: str) -> bool:
        """Whether a handshake with ``name`` is under way."""
        return name in self._handshaking

    def failure(self, name: str) -> tuple[str, str]:
        """Why ``name`` is not known: ``(kind, reason)`` of its failed handshake."""
        return self._peer_failures.get(name, ("unreachable", f"no handshake with {name}"))

    def answers(self) -> list[Future[HandshakeResponse]]:
        """The handshakes under way, to wait on."""
        return [handshake.future for handshake in self._handshaking.values()]

    def want(
        self, name: str, engine_id: str, rank: int, tp_size: int, epoch: str, endpoint: str, timeout_s: float
    ) -> None:
        """Start a handshake with ``engine_id``'s rank ``rank`` at ``endpoint``, unless ``name`` is known or asked."""
        if name in self._peers or name in self._handshaking:
            return
        self._peer_failures.pop(name, None)
        future = self._handshake_pool.submit(self._handshake_with, engine_id, rank, epoch, endpoint, timeout_s)
        self._handshaking[name] = _Handshake(engine_id, rank, tp_size, epoch, future)

    def _handshake_with(
        self, engine_id: str, rank: int, epoch: str, endpoint: str, timeout_s: float
    ) -> HandshakeResponse:
        """The handshake of ``engine_id``'s rank: the cached one if of start ``epoch``, else a fresh one."""
        topology = self._require_topology()

        def handshake() -> HandshakeResponse:
            return self._side.handshake(topology, endpoint, timeout_s)

        response = self._handshakes.get_or_handshake(engine_id, handshake, rank)
        if epoch and response.epoch != epoch:  # the rank restarted since we cached it (or the params are old)
            self._handshakes.invalidate(engine_id, rank)
            response = self._handshakes.get_or_handshake(engine_id, handshake, rank)
        return response

    def connect_answered(self) -> None:
        """Add every rank whose handshake has an answer (or note why it cannot be read)."""
        for name, handshake in list(self._handshaking.items()):
            if handshake.future.done():
                del self._handshaking[name]
                self._connect_peer(name, handshake)

    def _connect_peer(self, key: str, handshake: _Handshake) -> None:
        future = handshake.future
        try:
            response = future.result()
            remote = response.topology
            if remote.tp_size != handshake.tp_size:
                raise HandshakeRejected(
                    "incompatible",
                    [f"{key} has TP size {remote.tp_size}, its kv_transfer_params said {handshake.tp_size}"],
                )
            if handshake.epoch and response.epoch != handshake.epoch:
                self._peer_failures[key] = (
                    "gone",
                    f"{key}: that start of the engine is over (it answers as start {response.epoch or '?'})",
                )
                return
            local_topology = self._require_topology()
            ranges = plan_peer_ranges(local_topology, remote)
            chosen = self._add_peer(key, response, ranges)
        except HandshakeRejected as e:
            self._peer_failed(key, handshake, e.kind, f"handshake refused: {e}")
            return
        except Unauthenticated as e:
            self._peer_failed(key, handshake, "unauthenticated", str(e))
            return
        except ConnectorError as e:
            self._peer_failed(key, handshake, "unreachable" if future.exception() else "incompatible", str(e))
            return
        readers = len(reader_ranks(remote.tp_rank, local_topology, remote))
        self._peers[key] = SourceRank(remote, readers, chosen)
        self._drop_other_starts(key)

    def _drop_other_starts(self, key: str) -> None:
        """Remove the mappings of other starts of ``key``'s rank that no READ uses any more: never read again."""
        rank = key.partition("@")[0]
        for other in [name for name in self._peers if name != key and name.partition("@")[0] == rank]:
            self._remove_peer_if_unused(other)

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

    def drop_stale(self) -> None:
        """Drop the mappings waiting to be dropped that nothing uses any more."""
        for name in list(self._stale):
            self.forget(name)

    def forget(self, name: str) -> None:
        """A read from ``name`` failed: that rank may have restarted, so handshake again once nothing uses its
        mapping (until then the records that name it go on through it)."""
        source = self._peers.get(name)
        if source is None:
            self._stale.discard(name)
        elif self._remove_peer_if_unused(name):
            self._stale.discard(name)
            self._handshakes.invalidate(name.rpartition("/rank")[0], source.topology.tp_rank)
        else:
            self._stale.add(name)

    def _remove_peer_if_unused(self, name: str) -> bool:
        """Drop ``name``'s mapping unless the reader still uses it; True if dropped."""
        source = self._peers.get(name)
        if source is None or self._in_use(name):
            return False
        del self._peers[name]
        self._require_transport().get(source.transport).remove_peer(name)
        return True

    def _require_transport(self) -> WorkerTransports:
        return registered(self._transport, self.engine_id)

    def _require_topology(self) -> KVTopology:
        return registered(self._topology, self.engine_id)
