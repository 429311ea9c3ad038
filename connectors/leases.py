"""The prefill engine's bookkeeping of KV blocks it keeps for a remote decode engine.

When a prefill request finishes with ``do_remote_decode``, the scheduler-side
connector does not let vLLM free the request's KV blocks: it ``hold``s them in a
``LeaseTable`` until the decode side has read them (step 5 of "A request's
path" in DESIGN.md). Three things end a lease:

- every expected reader (each decode TP rank that reads this prefill rank)
  reports its read, through a NIXL notification on the worker side
  (``mark_read``). The notification (``read_notification``) carries how many
  readers to expect: only the decode side knows its TP size, and the lease is
  taken before any reader is known;
- the proxy sends an explicit release for an abandoned request (``release``);
- nobody comes before the lease's TTL runs out (``expire``), e.g. the client
  left or the decode engine died.

A lease's life cycle::

                     hold()
                       |
                       v
                   +--------+   mark_read() by the last expected reader   +----------+
                   |  HELD  | ------------------------------------------> |   READ   |
                   +--------+                                             +----------+
                    |      |    release()                                 +----------+
                    |      +--------------------------------------------> | RELEASED |
                    |                                                     +----------+
                    |           expire() at or after expires_at           +----------+
                    +---------------------------------------------------> | EXPIRED  |
                                                                          +----------+

    READ, RELEASED, EXPIRED --take_finished()--> reported once to vLLM as "finished sending", then forgotten

A lease that has left HELD is out of the table at once (``len``,
``held_block_ids``) and waits only to be reported by ``take_finished``, which
the connector's ``get_finished`` calls each step, after ``expire()``. A
notification for a request no longer held (a read after expiry or release) is
counted in ``stats().late_notifications`` and ignored: it must never fail the
NIXL notification thread.

Every method takes one lock, because NIXL notifications and the scheduler run
on different threads. Time comes from an injectable monotonic ``clock``.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable

from connectors.errors import LeaseError

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "READ_NOTIFICATION_PREFIX",
    "BlockLease",
    "LeaseState",
    "LeaseStats",
    "LeaseTable",
    "parse_read_notification",
    "read_notification",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 120.0
READ_NOTIFICATION_PREFIX = b"PDRD "


def read_notification(request_id: str, expected_reads: int) -> bytes:
    """What a reader attaches to its READ of ``request_id``'s blocks: the id and how many readers the source expects."""
    if expected_reads < 1:
        raise LeaseError(f"request {request_id!r}: expected_reads must be at least 1, got {expected_reads}")
    return READ_NOTIFICATION_PREFIX + f"{expected_reads} ".encode() + request_id.encode()


def parse_read_notification(message: bytes) -> tuple[str, int | None]:
    """``(request_id, expected_reads)`` of a READ notification.

    A bare request id (a reader that does not say) gives None: the lease keeps
    the count it was held with. Never raises: notifications come from peers.
    """
    if message.startswith(READ_NOTIFICATION_PREFIX):
        count, separator, request_id = message[len(READ_NOTIFICATION_PREFIX) :].partition(b" ")
        if separator and count.isdigit() and int(count) >= 1:
            return request_id.decode(errors="replace"), int(count)
    return message.decode(errors="replace"), None


class LeaseState(enum.Enum):
    """Where a lease is in its life cycle; every state but HELD means the blocks may be freed."""

    HELD = "held"
    READ = "read"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclasses.dataclass(slots=True)
class BlockLease:
    """The KV blocks one prefill request keeps until ``expected_reads`` distinct readers have read them."""

    request_id: str
    block_ids: tuple[int, ...]
    created_at: float
    expires_at: float
    expected_reads: int = 1
    reads_done: set[Hashable] = dataclasses.field(default_factory=set)
    state: LeaseState = LeaseState.HELD


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseStats:
    """Counters since the table was made (monotonic, for Prometheus counters)."""

    held: int = 0
    read: int = 0
    released: int = 0
    expired: int = 0
    late_notifications: int = 0


class LeaseTable:
    """Leases on KV blocks, keyed by request id; thread-safe.

    ``engine_id`` only labels log messages.
    """

    def __init__(
        self,
        default_ttl_s: float = DEFAULT_LEASE_TTL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        engine_id: str = "",
    ):
        self._default_ttl_s = _check_ttl(default_ttl_s)
        self._clock = clock
        self._engine_id = engine_id
        self._lock = threading.Lock()
        self._leases: dict[str, BlockLease] = {}
        # (expires_at, sequence, lease): popped in expiry order; an entry whose
        # lease already left the table is skipped, so nothing is removed eagerly.
        self._deadlines: list[tuple[float, int, BlockLease]] = []
        self._sequence = 0
        self._finished: dict[str, LeaseState] = {}  # insertion-ordered: reported in finishing order
        self._held = self._read = self._released = self._expired = self._late = 0

    def hold(
        self,
        request_id: str,
        block_ids: Iterable[int],
        expected_reads: int = 1,
        ttl_s: float | None = None,
    ) -> BlockLease:
        """Keep ``block_ids`` for ``request_id`` until read, released or expired; returns a copy of the new lease.

        Raises ``LeaseError`` if ``request_id`` is already held or finished but
        not yet reported by ``take_finished``, or if ``expected_reads < 1`` or
        the TTL is not a positive finite number of seconds.
        """
        if expected_reads < 1:
            raise LeaseError(f"request {request_id!r}: expected_reads must be at least 1, got {expected_reads}")
        ttl = self._default_ttl_s if ttl_s is None else _check_ttl(ttl_s)
        blocks = tuple(block_ids)
        with self._lock:
            if request_id in self._leases:
                raise LeaseError(
                    f"request {request_id!r} already holds a lease on {len(self._leases[request_id].block_ids)} "
                    f"blocks (engine {self._engine_id!r}); release it before holding it again"
                )
            if request_id in self._finished:
                raise LeaseError(
                    f"request {request_id!r} finished its lease ({self._finished[request_id].name}) but was not "
                    f"yet reported by take_finished (engine {self._engine_id!r}); it cannot be held again until then"
                )
            now = self._clock()
            lease = BlockLease(
                request_id=request_id,
                block_ids=blocks,
                created_at=now,
                expires_at=now + ttl,
                expected_reads=expected_reads,
            )
            self._leases[request_id] = lease
            self._sequence += 1
            heapq.heappush(self._deadlines, (lease.expires_at, self._sequence, lease))
            self._held += 1
            # A copy: the table's own lease changes under the lock, the caller's must not.
            snapshot = dataclasses.replace(lease, reads_done=set())
        logger.debug(
            "request %s on engine %s: holding %d blocks for %d reader(s), %.1f s",
            request_id,
            self._engine_id,
            len(blocks),
            expected_reads,
            ttl,
        )
        return snapshot

    def mark_read(self, request_id: str, reader_id: Hashable, expected_reads: int | None = None) -> bool:
        """Record that ``reader_id`` read the request's blocks; True when it was the last expected reader.

        ``expected_reads``, when given, replaces the lease's count: the readers
        say how many of them there are. A second notification from the same
        reader changes nothing. A notification for a request not held
        (unknown, expired, released, already read) is counted as late and ignored.
        """
        if expected_reads is not None and expected_reads < 1:
            raise LeaseError(f"request {request_id!r}: expected_reads must be at least 1, got {expected_reads}")
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                self._late += 1
                late = True
            else:
                late = False
                if expected_reads is not None:
                    lease.expected_reads = expected_reads
                lease.reads_done.add(reader_id)
                done = len(lease.reads_done) >= lease.expected_reads
                if done:
                    self._finish(lease, LeaseState.READ)
                    self._read += 1
        if late:
            logger.info(
                "request %s on engine %s: read notification from %r for no held lease (late or unknown); ignored",
                request_id,
                self._engine_id,
                reader_id,
            )
            return False
        if done:
            logger.debug(
                "request %s on engine %s: read by every reader, blocks may be freed", request_id, self._engine_id
            )
        return done

    def release(self, request_id: str) -> bool:
        """Free the request's blocks now (the proxy abandoned it); False if it holds no lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                self._finish(lease, LeaseState.RELEASED)
                self._released += 1
        if lease is None:
            logger.debug("request %s on engine %s: release for no held lease; ignored", request_id, self._engine_id)
            return False
        logger.debug("request %s on engine %s: released, blocks may be freed", request_id, self._engine_id)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """End every lease whose ``expires_at`` is at or before ``now`` (default: the clock); returns their ids."""
        expired: list[BlockLease] = []
        with self._lock:
            if now is None:
                now = self._clock()
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, lease = heapq.heappop(self._deadlines)
                if self._leases.get(lease.request_id) is lease:
                    self._finish(lease, LeaseState.EXPIRED)
                    self._expired += 1
                    expired.append(lease)
        for lease in expired:
            logger.warning(
                "request %s on engine %s: lease on %d blocks expired after %.1f s with %d of %d reads; freeing them",
                lease.request_id,
                self._engine_id,
                len(lease.block_ids),
                lease.expires_at - lease.created_at,
                len(lease.reads_done),
                lease.expected_reads,
            )
        return [lease.request_id for lease in expired]

    def take_finished(self) -> list[str]:
        """Request ids whose blocks may now be freed, in finishing order; each id is returned once."""
        return list(self.take_finished_with_state())

    def take_finished_with_state(self) -> dict[str, LeaseState]:
        """Like ``take_finished``, with how each lease ended (READ, RELEASED or EXPIRED)."""
        with self._lock:
            finished, self._finished = self._finished, {}
        return finished

    def held_block_ids(self) -> set[int]:
        """Every block id still under a HELD lease."""
        with self._lock:
            return {block_id for lease in self._leases.values() for block_id in lease.block_ids}

    def stats(self) -> LeaseStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return LeaseStats(
                held=self._held,
                read=self._read,
                released=self._released,
                expired=self._expired,
                late_notifications=self._late,
            )

    def __len__(self) -> int:
        """How many leases are HELD."""
        with self._lock:
            return len(self._leases)

    def _finish(self, lease: BlockLease, state: LeaseState) -> None:
        # Caller holds the lock. The deadline entry stays in the heap; expire() skips it.
        lease.state = state
        del self._leases[lease.request_id]
        self._finished[lease.request_id] = state


def _check_ttl(ttl_s: float) -> float:
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise LeaseError(f"a lease TTL must be a positive finite number of seconds, got {ttl_s!r}")
    return float(ttl_s)
