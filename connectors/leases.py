"""The prefill side of KV ownership: a lease per request on the blocks kept for a remote decode engine.

When a prefill request finishes with ``do_remote_decode``, the scheduler-side
connector does not let vLLM free the request's KV blocks: it ``hold``s them in a
``LeaseTable`` until the decode side has read them (step 5 of "A request's
path" in DESIGN.md). A lease is one state machine (``docs/architecture.md``,
"Who owns a KV block"); the reader's half is ``connectors.reads.ReadRecord``::

                         hold()
                           |
                           v
       pin(r) -> OK   +--------+  release(), no pin           +----------+
     +--------------> |  HELD  | ---------------------------> | RELEASED |
     |                +--------+                              +----------+
     |                  |    |   expiry at expires_at         +----------+
     |                  |    +------------------------------> | EXPIRED  |
     |                  v pin(r)                              +----------+
     |           +------------+  the last expected READ       +----------+
     +---------- | BEING_READ | ---------------------------> |   READ   |
   read by r,    +------------+  notification, no pin left    +----------+
   readers left    |   |   release(by=r), no pin left         RELEASED
                   |   +----------------------------------->
                   |  expiry at expires_at + grace            EXPIRED
                   +---------------------------------------->

    READ, RELEASED, EXPIRED --take_finished()--> FREED: reported once to vLLM ("finished sending")

- ``pin(request, reader)``: a reader announces its READ over the sealed side
  channel before it posts it, and posts only on ``PinAnswer.OK``. From then on
  the blocks stay until that reader's READ notification or its own release
  (``release(request, by=reader)``: its READ was aborted and drained), or
  ``expires_at + grace`` if the reader is never heard of again. A release
  that names no reader (the proxy's, which travels in a plaintext HTTP answer)
  is refused while any reader holds a pin: nobody can free blocks under a READ
  in flight. A pin for a lease not held yet is answered ``WAIT`` (the hold
  comes with the prefill's next step); for one that ended, or from another
  start of this engine (``epoch``), ``GONE``: the reader then recomputes.
- A notification or release for a request not held is counted in
  ``stats().late_notifications`` and ignored; it must never fail the thread
  that delivers it.

Every method takes one lock: NIXL notifications, the side channel and the
scheduler run on different threads. Time comes from an injectable monotonic
``clock``.
"""

from __future__ import annotations

import collections
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
    "READ_NOTIFICATION_PREFIX",
    "BlockLease",
    "LeaseState",
    "LeaseStats",
    "LeaseTable",
    "PinAnswer",
    "parse_read_notification",
    "read_notification",
]

logger = logging.getLogger(__name__)

READ_NOTIFICATION_PREFIX = b"PDRD "
ENDED_KEPT = 65536
"""How many ended leases the table remembers (for a lease's life at most): a late pin is answered GONE, not WAIT."""


def read_notification(request_id: str, expected_reads: int, reader: str = "") -> bytes:
    """What a reader attaches to its READ of ``request_id``'s blocks: how many readers the source expects, who
    read (``reader``, the name it pinned with: no spaces), and the request id."""
    if expected_reads < 1:
        raise LeaseError(f"request {request_id!r}: expected_reads must be at least 1, got {expected_reads}")
    return READ_NOTIFICATION_PREFIX + f"{expected_reads} {reader or '-'} ".encode() + request_id.encode()


def parse_read_notification(message: bytes) -> tuple[str, int | None, str | None]:
    """``(request_id, expected_reads, reader)`` of a READ notification.

    A bare request id (a reader that does not say) gives None for both: the
    lease keeps the count it was held with, and the transport's name of the
    peer stands for the reader. Never raises: notifications come from peers.
    """
    if message.startswith(READ_NOTIFICATION_PREFIX):
        count, separator, rest = message[len(READ_NOTIFICATION_PREFIX) :].partition(b" ")
        reader, separator2, request_id = rest.partition(b" ")
        if separator and separator2 and count.isdigit() and int(count) >= 1 and request_id:
            name = reader.decode(errors="replace")
            return request_id.decode(errors="replace"), int(count), None if name == "-" else name
    return message.decode(errors="replace"), None, None


class LeaseState(enum.Enum):
    """Where a lease is in its life; HELD and BEING_READ keep the blocks, the others let them be freed."""

    HELD = "held"
    BEING_READ = "being_read"
    READ = "read"
    RELEASED = "released"
    EXPIRED = "expired"


class PinAnswer(enum.Enum):
    """A holder's answer to a reader's pin: post the READ, ask again next step, or recompute."""

    OK = "OK"
    WAIT = "WAIT"
    GONE = "GONE"


@dataclasses.dataclass(slots=True)
class BlockLease:
    """The KV blocks one prefill request keeps until ``expected_reads`` distinct readers have read them."""

    request_id: str
    block_ids: tuple[int, ...]
    created_at: float
    expires_at: float
    expected_reads: int = 1
    reads_done: set[Hashable] = dataclasses.field(default_factory=set)
    pins: set[Hashable] = dataclasses.field(default_factory=set)
    state: LeaseState = LeaseState.HELD


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseStats:
    """Counters since the table was made (monotonic, for Prometheus counters)."""

    held: int = 0
    read: int = 0
    released: int = 0
    expired: int = 0
    late_notifications: int = 0
    pinned: int = 0
    releases_refused: int = 0


class LeaseTable:
    """Leases on KV blocks, keyed by request id; thread-safe.

    ``default_ttl_s`` is how long a lease keeps its blocks unless ``hold`` says otherwise; ``grace_s``, how long
    past its end a lease under a pin waits for its reader (to drain an aborted READ);
    ``epoch`` names this start of the engine (a pin from parameters of another start is answered GONE);
    ``engine_id`` only labels log messages.
    """

    def __init__(
        self,
        default_ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        engine_id: str = "",
        grace_s: float = 2.0,
        epoch: str = "",
    ):
        self._default_ttl_s = _check_ttl(default_ttl_s)
        self._clock = clock
        self._engine_id = engine_id
        self.grace_s = grace_s
        self.epoch = epoch
        self._lock = threading.Lock()
        self._leases: dict[str, BlockLease] = {}
        # (deadline, sequence, lease): popped in deadline order; an entry whose lease already left the table is
        # skipped, and one whose lease is pinned is pushed again at expires_at + grace.
        self._deadlines: list[tuple[float, int, BlockLease]] = []
        self._sequence = 0
        self._finished: dict[str, LeaseState] = {}  # insertion-ordered: reported in finishing order
        self._ended: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> when it ended
        self._counts = collections.Counter[str]()

    def hold(
        self,
        request_id: str,
        block_ids: Iterable[int],
        expected_reads: int = 1,
        ttl_s: float | None = None,
    ) -> None:
        """Keep ``block_ids`` for ``request_id`` until read, released or expired.

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
            lease = BlockLease(request_id, blocks, now, now + ttl, expected_reads)
            self._leases[request_id] = lease
            self._ended.pop(request_id, None)
            self._push_deadline(lease.expires_at, lease)
            self._counts["held"] += 1
        logger.debug(
            "request %s on engine %s: holding %d blocks for %d reader(s), %.1f s",
            request_id,
            self._engine_id,
            len(blocks),
            expected_reads,
            ttl,
        )

    def pin(self, request_id: str, reader_id: Hashable, epoch: str | None = None) -> PinAnswer:
        """A reader is about to READ the request's blocks: OK (they stay until its READ or release), WAIT (not
        held yet: ask again) or GONE (ended, or the parameters are of another start of this engine)."""
        with self._lock:
            if epoch is not None and self.epoch and epoch != self.epoch:
                answer = PinAnswer.GONE
            elif (lease := self._leases.get(request_id)) is not None:
                if reader_id not in lease.pins:
                    self._counts["pinned"] += 1  # pins granted, one per reader
                lease.pins.add(reader_id)
                lease.state = LeaseState.BEING_READ
                answer = PinAnswer.OK
            else:
                self._forget_ended(self._clock())
                answer = PinAnswer.GONE if request_id in self._ended or request_id in self._finished else PinAnswer.WAIT
        if answer is PinAnswer.GONE:
            logger.info("request %s on engine %s: pin by %r refused (gone)", request_id, self._engine_id, reader_id)
        return answer

    def mark_read(self, request_id: str, reader_id: Hashable, expected_reads: int | None = None) -> bool:
        """Record that ``reader_id`` read the request's blocks; True when that ended the lease.

        ``expected_reads``, when given, replaces the lease's count: the readers
        say how many of them there are. The lease ends READ once that many
        distinct readers have read and no other reader holds a pin. A
        notification for a request not held is counted as late and ignored.
        """
        if expected_reads is not None and expected_reads < 1:
            raise LeaseError(f"request {request_id!r}: expected_reads must be at least 1, got {expected_reads}")
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                self._counts["late_notifications"] += 1
                done, late = False, True
            else:
                late = False
                if expected_reads is not None:
                    lease.expected_reads = expected_reads
                lease.reads_done.add(reader_id)
                lease.pins.discard(reader_id)
                done = len(lease.reads_done) >= lease.expected_reads and not lease.pins
                if done:
                    self._finish(lease, LeaseState.READ)
                elif not lease.pins:
                    lease.state = LeaseState.HELD
        if late:
            logger.info(
                "request %s on engine %s: read notification from %r for no held lease (late or unknown); ignored",
                request_id,
                self._engine_id,
                reader_id,
            )
        return done

    def release(self, request_id: str, by: Hashable | None = None) -> bool:
        """Nobody will read the request's blocks: free them (True), unless a READ may be in flight (False).

        ``by`` names a reader giving up its own pin (its READ was aborted and drained); the lease ends once no
        reader holds one. A release that names no reader (the proxy's) is refused while any reader does.
        """
        with self._lock:
            lease = self._leases.get(request_id)
            ended = False
            if lease is not None:
                if by is not None:
                    lease.pins.discard(by)
                if lease.pins:
                    if by is None:
                        self._counts["releases_refused"] += 1
                else:
                    self._finish(lease, LeaseState.RELEASED)
                    ended = True
        if lease is None:
            logger.debug("request %s on engine %s: release for no held lease; ignored", request_id, self._engine_id)
        elif not ended and by is None:
            logger.warning(
                "request %s on engine %s: release refused: a READ of its blocks may be in flight", request_id,
                self._engine_id,
            )  # fmt: skip
        return ended

    def expire(self) -> list[str]:
        """End every lease past its end (``expires_at``; under a pin, ``expires_at + grace_s``); returns their ids."""
        expired: list[BlockLease] = []
        with self._lock:
            now = self._clock()
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, _, lease = heapq.heappop(self._deadlines)
                if self._leases.get(lease.request_id) is not lease:
                    continue
                if lease.pins and deadline < lease.expires_at + self.grace_s:
                    self._push_deadline(lease.expires_at + self.grace_s, lease)
                    continue
                self._finish(lease, LeaseState.EXPIRED)
                expired.append(lease)
            self._forget_ended(now)
        for lease in expired:
            logger.warning(
                "request %s on engine %s: lease on %d blocks expired after %.1f s with %d of %d reads%s; freeing them",
                lease.request_id,
                self._engine_id,
                len(lease.block_ids),
                now - lease.created_at,
                len(lease.reads_done),
                lease.expected_reads,
                f" and {len(lease.pins)} reader(s) never heard of again" if lease.pins else "",
            )
        return [lease.request_id for lease in expired]

    def take_finished(self) -> dict[str, LeaseState]:
        """The requests whose blocks may now be freed, in finishing order, with how each lease ended (READ,
        RELEASED or EXPIRED); each is returned once."""
        with self._lock:
            finished, self._finished = self._finished, {}
        return finished

    def has_ended(self, request_id: str) -> bool:
        """Whether the table remembers the request's lease as ended (an event for it now is late)."""
        with self._lock:
            return request_id in self._ended

    def stats(self) -> LeaseStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return LeaseStats(**{field.name: self._counts[field.name] for field in dataclasses.fields(LeaseStats)})

    def _push_deadline(self, deadline: float, lease: BlockLease) -> None:
        self._sequence += 1
        heapq.heappush(self._deadlines, (deadline, self._sequence, lease))

    def _finish(self, lease: BlockLease, state: LeaseState) -> None:
        # Caller holds the lock. The deadline entry stays in the heap; expire() skips it.
        lease.state = state
        del self._leases[lease.request_id]
        self._finished[lease.request_id] = state
        self._ended[lease.request_id] = self._clock()
        self._counts[state.value] += 1
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def _forget_ended(self, now: float) -> None:
        # Caller holds the lock: an ended lease is remembered for a lease's life, long enough for any late pin.
        while self._ended and next(iter(self._ended.values())) < now - self._default_ttl_s:
            self._ended.popitem(last=False)


def _check_ttl(ttl_s: float) -> float:
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise LeaseError(f"a lease TTL must be a positive finite number of seconds, got {ttl_s!r}")
    return float(ttl_s)
