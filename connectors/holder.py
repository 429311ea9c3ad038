"""Prefill side of the pdserve connector's worker: the blocks of finished requests, held for their readers.

``hold`` puts a request's blocks under a ``LeaseTable`` lease (the scheduler
side asks, one step after the request finished). The side channel's thread
answers readers' pins at once (``pin``: the lease table decides, under its
lock), and queues releases and READ notifications that came over it
(``releases_in``, ``notifications_in``: CUDA IPC readers send theirs there).
``poll`` turns those and the transports' READ notifications into lease ends,
expires leases, and returns the ended ones: vLLM frees their blocks
("finished sending"). A READ notification or a release can arrive before the
hold (the hold comes with the next scheduler step): it waits, up to a lease's
life, for its lease; a pin that comes first is answered WAIT and asked again.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from connectors.leases import LeaseState, LeaseTable, parse_read_notification
from connectors.stats import PdserveKVStats
from connectors.transport.group import WorkerTransports

__all__ = ["LeaseHolder", "parse_release"]

_LEASE_OUTCOMES = {LeaseState.READ: "read", LeaseState.RELEASED: "released", LeaseState.EXPIRED: "expired"}


def parse_release(body: str) -> tuple[str, str | None]:
    """``(request_id, reader)`` of a release's body: ``request_id``, or ``request_id reader`` for a reader's own."""
    request_id, _, reader = body.partition(" ")
    return request_id, reader or None


@dataclass(slots=True)
class _LeaseEvent:
    """A READ notification or release that came before this worker held the lease."""

    what: str  # "read" or "release"
    reader: str | None
    expected_reads: int | None
    seen_at: float


class LeaseHolder:
    """The prefill side of one TP rank; ``releases_in`` and ``notifications_in`` are fed by the side-channel
    thread, which also calls ``pin``."""

    def __init__(
        self,
        engine_id: str,
        lease_ttl_s: float,
        *,
        grace_s: float = 2.0,
        epoch: str = "",
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: monotonic seconds (``time.monotonic`` by default)."""
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock = clock or time.monotonic
        self._leases = LeaseTable(lease_ttl_s, clock=clock, engine_id=engine_id, grace_s=grace_s, epoch=epoch)
        self._holding: set[str] = set()
        self._early: dict[str, list[_LeaseEvent]] = {}
        self._stats = PdserveKVStats()
        self._counted = self._leases.stats()
        self.releases_in: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.notifications_in: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()

    def hold(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._leases.hold(request_id, block_ids)
        self._holding.add(request_id)
        for event in self._early.pop(request_id, ()):
            self._apply_lease_event(request_id, event)

    def pin(self, body: str) -> bytes:
        """A reader's pin (``reader request_id epoch``), from the side-channel thread: ``OK``, ``WAIT`` or ``GONE``."""
        reader, _, rest = body.partition(" ")
        request_id, _, epoch = rest.partition(" ")
        if not reader or not request_id:
            return b"ERR malformed pin"
        return self._leases.pin(request_id, reader, epoch or None).value.encode()

    def add_notification(self, reader: str, message: bytes) -> None:
        """A READ notification that came over the side channel (from the side-channel thread)."""
        self.notifications_in.put((reader, message))

    def poll(self, transports: WorkerTransports) -> set[str]:
        """The requests whose lease ended since the last call (read, released or expired)."""
        now = self._clock()
        # Leases past their end expire before this step's events: a release or READ notification that came
        # after a lease's end is late (counted so), not the lease's outcome.
        self._leases.expire()
        for sender, message in transports.poll_notifications() + _drain(self.notifications_in):
            request_id, expected_reads, reader = parse_read_notification(message)
            self._lease_event(request_id, _LeaseEvent("read", reader or sender, expected_reads, now))
        for body in _drain(self.releases_in):
            request_id, reader = parse_release(body)
            self._lease_event(request_id, _LeaseEvent("release", reader, None, now))
        for request_id, events in list(self._early.items()):
            if now - events[0].seen_at > self.lease_ttl_s:
                del self._early[request_id]
        finished = self._leases.take_finished()
        for state in finished.values():
            self._stats.record_lease(_LEASE_OUTCOMES[state])
        counts = self._leases.stats()
        self._stats.record_lease("pinned", counts.pinned - self._counted.pinned)
        self._stats.record_lease("release_refused", counts.releases_refused - self._counted.releases_refused)
        self._counted = counts
        self._holding.difference_update(finished)
        return set(finished)

    def _lease_event(self, request_id: str, event: _LeaseEvent) -> None:
        if request_id not in self._holding and not self._leases.has_ended(request_id):
            self._early.setdefault(request_id, []).append(event)
        else:
            self._apply_lease_event(request_id, event)

    def _apply_lease_event(self, request_id: str, event: _LeaseEvent) -> None:
        if event.what == "read":
            self._leases.mark_read(request_id, event.reader or "", event.expected_reads)
        else:
            self._leases.release(request_id, by=event.reader)

    def take_stats(self) -> PdserveKVStats:
        stats, self._stats = self._stats, PdserveKVStats()
        return stats


def _drain(items: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out
