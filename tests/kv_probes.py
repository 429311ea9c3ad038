"""What the KV tests read of the connector's state that the connector never reads itself: how many request ids
each side keeps (nothing keyed by a request id may outlive it), which blocks a lease table keeps and in which
state, and which ranks a handshake cache holds. Each reads the objects' own fields, under their locks where
they have one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connectors.handshake import HandshakeCache
    from connectors.holder import LeaseHolder
    from connectors.leases import LeaseState, LeaseTable
    from connectors.reader import KVReader
    from connectors.scheduler import PdserveScheduler


def reader_tracked(reader: KVReader) -> int:
    """How many requests a decode rank keeps anything of (records, pins asked, reports not yet taken, requests
    quarantined since the last report)."""
    return len(reader._records) + len(reader._pins) + len(reader._reports) + len(reader._quarantined)


def holder_tracked(holder: LeaseHolder) -> int:
    """How many request ids a prefill rank keeps anything of (leases it holds, events that came early)."""
    return len(holder._holding) + len(holder._early)


def scheduler_tracked(scheduler: PdserveScheduler) -> int:
    """How many request ids a scheduler side keeps anything of (records, work not yet handed to the workers)."""
    return len(scheduler._decode) + len(scheduler._to_receive) + len(scheduler._to_hold)


def held_leases(table: LeaseTable) -> int:
    """How many leases keep their blocks (HELD or BEING_READ)."""
    with table._lock:
        return len(table._leases)


def held_block_ids(table: LeaseTable) -> set[int]:
    """Every block id still under a HELD or BEING_READ lease."""
    with table._lock:
        return {block_id for lease in table._leases.values() for block_id in lease.block_ids}


def pinned_block_ids(table: LeaseTable) -> set[int]:
    """Every block id a reader holds a pin on (a READ from it may be in flight)."""
    with table._lock:
        return {block_id for lease in table._leases.values() if lease.pins for block_id in lease.block_ids}


def lease_state(table: LeaseTable, request_id: str) -> LeaseState | None:
    """The lease's state while it is in the table or waits to be reported; None otherwise."""
    with table._lock:
        lease = table._leases.get(request_id)
        return lease.state if lease is not None else table._finished.get(request_id)


def cached_ranks(cache: HandshakeCache) -> set[tuple[str, int]]:
    """The ``(engine id, TP rank)`` of every answer the cache holds."""
    with cache._lock:
        return set(cache._responses)
