"""The decode side of KV ownership: one ``ReadRecord`` per request, the reader's state machine.

The holder's half is ``connectors.leases.LeaseTable``; together they are the
protocol of "Who owns a KV block" (``docs/architecture.md``)::

      CHECKED --every source rank known (handshake of the parameters' epoch)--> PINNING
      PINNING --every source answered pin OK--> (READs posted) READING
      READING --every READ landed, before the deadline--> DONE
      CHECKED, PINNING --failure, GONE, deadline--> DRAINED (nothing was posted)
      READING --a READ failed, the deadline passed, landed late, shutdown--> ABORTED
      ABORTED --every READ drained (none can land any more)--> DRAINED
      ABORTED --drain_timeout_s after the abort, or ends_by, a READ still undrained--> DRAINED, quarantined

DONE and DRAINED are the ends: the request is reported to vLLM (finished, or
failed: its blocks are recomputed) only then, so vLLM never reuses a block a
READ can still land in. A READ is drained only when its transport says no byte
of it can land (``Transfer.drained``: for NIXL, a release of its handle NIXL
accepted); one that never says so by the record's end leaves the record
``quarantined``: the request is reported failed, and its blocks are kept out of
vLLM's pool for good (``connectors.scheduler``), never reused. A READ is posted only under a pin (the holder keeps its
blocks until this reader's notification or release), only before ``deadline``
(the lease's end less the read margin), and its result is trusted only if it
landed before that: a READ seen done later is DRAINED, not DONE. At DRAINED the
reader owes each source a release that names it (``LeaseTable.release(request,
by=reader)``), which ends its pin there.

A record is pure bookkeeping: no I/O, time passed in, transfers given. The
reader (``connectors.reader.KVReader``, its source ranks in ``connectors.sources``)
does the handshakes, pins and posts; ``tests/unit/connectors/test_ownership_model.py``
explores every interleaving of the events on both machines.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from connectors.leases import PinAnswer
from connectors.metadata import ReceiveSpec
from connectors.transport.base import Transfer, TransferState

__all__ = ["ReadPhase", "ReadRecord", "drained"]


class ReadPhase(enum.Enum):
    CHECKED = "checked"
    PINNING = "pinning"
    READING = "reading"
    DONE = "done"
    ABORTED = "aborted"
    DRAINED = "drained"


_MOVES = {
    ReadPhase.CHECKED: {ReadPhase.PINNING, ReadPhase.DRAINED},
    ReadPhase.PINNING: {ReadPhase.READING, ReadPhase.DRAINED},
    ReadPhase.READING: {ReadPhase.DONE, ReadPhase.ABORTED},
    ReadPhase.ABORTED: {ReadPhase.DRAINED},
    ReadPhase.DONE: set(),
    ReadPhase.DRAINED: set(),
}


def drained(read: Transfer) -> bool:
    """Polls ``read`` (a transport moves an aborted READ on as it is polled); whether no byte of it can land any
    more: only its transport can say."""
    read.poll()
    return read.drained is True


@dataclass(slots=True)
class ReadRecord:
    """One decode request's load on one TP rank: its sources, pins, READs and end (see the module's docstring).

    ``deadline`` is the wall-clock time by which the READs must have landed; ``ends_by``, the time by which the
    record ends whatever happens (the lease's end plus the margin: the holder keeps a pinned lease that long).
    """

    spec: ReceiveSpec
    sources: tuple[str, ...]
    deadline: float
    drain_timeout_s: float = 30.0
    ends_by: float = float("inf")
    phase: ReadPhase = ReadPhase.CHECKED
    granted: set[str] = field(default_factory=set)
    asking: set[str] = field(default_factory=set)
    reads: list[Transfer] = field(default_factory=list)
    failure: tuple[str, str] | None = None
    """``(kind, reason)`` once the load failed (``connectors.stats.FAILURE_KINDS``)."""
    aborted_at: float | None = None
    hold_s: float = 0.0
    """Fault injection (``read_hold_s``): how long the READs wait, pinned, before they are posted."""
    hold_until: float | None = None
    failed_peer: str | None = None
    """The source whose READ failed (it may have restarted: handshake with it again)."""
    quarantined: bool = False
    """Ended DRAINED with a READ its transport never confirmed drained: its blocks must never be reused."""

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def ended(self) -> bool:
        return self.phase in (ReadPhase.DONE, ReadPhase.DRAINED)

    def _move(self, phase: ReadPhase) -> None:
        if phase not in _MOVES[self.phase]:
            raise AssertionError(f"request {self.request_id}: read {self.phase.name} cannot become {phase.name}")
        self.phase = phase

    # ------------------------------------------------------------ events

    def sources_known(self) -> None:
        """Every source rank has a handshake of the parameters' start: ask each for a pin."""
        if self.phase is ReadPhase.CHECKED:
            self._move(ReadPhase.PINNING)

    def pins_to_ask(self) -> list[str]:
        """The sources to ask for a pin now (neither granted nor being asked); marks them asked."""
        if self.phase is not ReadPhase.PINNING:
            return []
        wanted = [source for source in self.sources if source not in self.granted and source not in self.asking]
        self.asking.update(wanted)
        return wanted

    def pin_answered(self, source: str, answer: PinAnswer | None, reason: str = "") -> None:
        """A source's answer to our pin (None: no answer, ``reason`` says why)."""
        self.asking.discard(source)
        if self.phase is not ReadPhase.PINNING:
            return  # the load already ended: the caller gives a late OK back
        if answer is PinAnswer.OK:
            self.granted.add(source)
        elif answer is PinAnswer.GONE:
            self.fail("gone", f"{source} no longer holds these blocks (released, expired, or restarted)")
        elif answer is None:
            self.fail("unreachable", f"no pin answer from {source}: {reason}")

    def ready_to_post(self, now: float) -> bool:
        """Whether every source pinned its blocks for us and the READs can still land in time."""
        if self.phase is not ReadPhase.PINNING:
            return False
        if now >= self.deadline:
            self.fail("expired", "the READ could not be posted before the end of the prefill's lease less the margin")
            return False
        if not self.granted.issuperset(self.sources):
            return False
        if self.hold_until is None:
            self.hold_until = now + self.hold_s
        return now >= self.hold_until

    def posted(self, reads: Sequence[Transfer]) -> None:
        self.reads = list(reads)
        self._move(ReadPhase.READING)

    def fail(self, kind: str, reason: str, now: float = 0.0) -> None:
        """The load failed: nothing posted ends DRAINED at once; posted READs are aborted and must drain."""
        if self.ended or self.phase is ReadPhase.ABORTED:
            return
        self.failure = (kind, reason)
        if self.phase is ReadPhase.READING:
            for read in self.reads:
                read.abort(reason)
            self.aborted_at = now
            self._move(ReadPhase.ABORTED)
            self.poll(now)
        else:
            self._move(ReadPhase.DRAINED)

    def poll(self, now: float) -> ReadPhase:
        """Advance READING (landed, failed, past the deadline) and ABORTED (drained, or given up); the phase."""
        if self.phase is ReadPhase.READING:
            states = [read.poll() for read in self.reads]
            failed = next((read for read in self.reads if read.state is TransferState.FAILED), None)
            if failed is not None:
                self.failed_peer = failed.peer
                self.fail("transport", f"KV read failed: {failed.failure_reason}", now)
            elif TransferState.PENDING not in states:
                if now < self.deadline:
                    self._move(ReadPhase.DONE)
                else:  # landed, but maybe after the source's blocks were freed: not trusted
                    self.fail("expired", "the READ was seen done past the end of the prefill's lease less the margin",
                              now)  # fmt: skip
            elif now >= self.deadline:
                self.fail("expired", "the READ was still pending at the end of the prefill's lease less the margin",
                          now)  # fmt: skip
        elif self.phase is ReadPhase.ABORTED:
            if all([drained(read) for read in self.reads]):  # a list: every READ polled
                self._move(ReadPhase.DRAINED)
            elif now >= min((self.aborted_at or now) + self.drain_timeout_s, self.ends_by):
                self.quarantined = True
                self._move(ReadPhase.DRAINED)
        return self.phase
