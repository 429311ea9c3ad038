"""A bounded model checker of KV ownership: every interleaving of the events of two requests, on the real classes.

It drives the holder's ``connectors.leases.LeaseTable`` and the reader's
``connectors.reads.ReadRecord`` (the protocol's two state machines, the same
objects the connector runs) with a scripted transport whose READs can be
delayed, fail, land late (after an abort: NIXL cannot always cancel one), and a
model of vLLM's block pools on both engines, a prefill engine that restarts,
and a proxy that sends its release at any moment. From the empty state it
explores, depth first, every sequence of enabled events (states already seen are
not explored twice) and checks after each event:

- ``freed-under-read``: a prefill block is freed (vLLM may reuse it) while a READ from it can still land;
- ``landed-in-reused``: a READ lands in a decode block vLLM got back;
- ``served-unheld``: a READ's result is served (DONE) though its source blocks were not held for that request
  the whole time (freed, reused, or another start of the engine);
- ``other-start``: a READ is posted through a mapping of another start of the prefill engine than the one that
  signed the parameters;
- ``never-ends``: once time has run past lease + margin and every pending event was delivered, a lease or a
  record is still open.

``Knobs`` turn parts of the protocol off (pins, drains, epochs), to show the checker finds the hole each one
closes. Time is discrete: a lease lasts ``TTL`` ticks, a read must land ``MARGIN`` ticks before its end, a
pinned lease waits ``GRACE`` ticks more.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator

from connectors.leases import LeaseTable
from connectors.metadata import ReceiveSpec
from connectors.reads import ReadPhase, ReadRecord
from connectors.transport.base import TransferState
from contract.wire import KVTransferParams

TTL, MARGIN, GRACE = 2, 1, 1
END = TTL + GRACE
READER = "decode/rank0"
REQUESTS = ("A", "B")
FULL = ("A",)
"""Requests whose every event is explored (proxy releases, failed and aborted READs); the others only run the
protocol's main path (finish, hold, receive, pin, READ, notification, polls), around them and the restart."""


@dataclasses.dataclass(frozen=True)
class Knobs:
    pins: bool = True
    """Readers pin before they READ, and a release that names no reader is refused under a pin."""
    drains: bool = True
    """An aborted READ ends (and its blocks go back to vLLM) only once it cannot land any more."""
    epochs: bool = True
    """Parameters carry the start of the engine; pins and mappings of another start are refused."""


class ScriptedTransfer:
    """A READ whose fate the checker decides: it lands, fails, or (aborted) lands late or drains. An abort never
    cancels it by itself (NIXL may not cancel a READ in flight): ``drain`` or ``land`` ends it."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.num_bytes = 1
        self.elapsed_s = 0.0
        self.state = TransferState.PENDING
        self.failure_reason: str | None = None
        self.in_flight = True  # bytes may still land

    @property
    def drained(self) -> bool:
        return not self.in_flight

    def poll(self) -> TransferState:
        return self.state

    def abort(self, reason: str = "aborted") -> None:
        if self.state is TransferState.PENDING:
            self.state, self.failure_reason = TransferState.FAILED, reason


@dataclasses.dataclass
class Request:
    name: str
    issued_epoch: str | None = None  # the start that signed its parameters (None: not finished on prefill yet)
    issued_at: int = 0
    hold_sent: bool = False
    src_blocks_live: bool = False  # vLLM keeps its prefill blocks
    src_version: int = 0  # bumps when its prefill blocks are freed (reused by anyone)
    record: ReadRecord | None = None
    transfer: ScriptedTransfer | None = None
    posted_version: int = -1
    landed_version: int = -1
    mapping_epoch: str | None = None
    dst_live: bool = False  # vLLM keeps its decode blocks for the load
    notification: bool = False
    reader_release: bool = False
    proxy_released: bool = False
    reported: bool = False
    doomed: bool = False  # its source restarted: the READ can only fail


class World:
    def __init__(self, knobs: Knobs, requests: tuple[str, ...] = REQUESTS) -> None:
        self.knobs = knobs
        self.t = 0
        self.epoch = "e1"
        self.cached_mapping: str | None = None  # the reader's one mapping per peer, without epochs
        self.table = self._table()
        self.requests = {name: Request(name) for name in requests}
        self.violations: list[str] = []

    def _table(self) -> LeaseTable:
        table = LeaseTable(TTL, clock=lambda: self.t, grace_s=GRACE, epoch=self.epoch if self.knobs.epochs else "")
        table._lock = contextlib.nullcontext()  # one thread here, and copyable
        return table

    def __deepcopy__(self, memo: dict) -> World:
        clone = copy.copy(self)
        memo[id(self)] = clone
        clone.requests = copy.deepcopy(self.requests, memo)
        clone.violations = list(self.violations)
        table = copy.copy(self.table)
        table._leases = copy.deepcopy(self.table._leases, memo)
        table._deadlines = [
            (d, s, memo.get(id(lease), copy.deepcopy(lease, memo))) for d, s, lease in self.table._deadlines
        ]
        table._finished = dict(self.table._finished)
        table._ended = copy.copy(self.table._ended)
        table._counts = copy.copy(self.table._counts)
        table._clock = lambda: clone.t
        clone.table = table
        return clone

    # ------------------------------------------------------------ events

    def events(self) -> Iterator[tuple[str, Callable[[], None]]]:
        for r in self.requests.values():
            if r.issued_epoch is None:
                yield f"finish {r.name}", lambda r=r: self.finish(r)
                continue
            if not r.hold_sent and r.issued_epoch == self.epoch:
                yield f"hold {r.name}", lambda r=r: self.hold(r)
            if r.record is None:
                yield f"receive {r.name}", lambda r=r: self.receive(r)
                continue
            if r.record.phase is ReadPhase.PINNING:
                yield f"pin {r.name}", lambda r=r: self.pin(r)
            if r.record.phase in (ReadPhase.PINNING, ReadPhase.READING, ReadPhase.ABORTED) or (
                r.record.ended and not r.reported
            ):
                yield f"reader-poll {r.name}", lambda r=r: self.reader_poll(r)
            full = r.name in FULL
            if r.transfer is not None and r.transfer.in_flight:
                yield f"land {r.name}", lambda r=r: self.land(r)
                if r.transfer.state is TransferState.PENDING and full:
                    yield f"fail {r.name}", lambda r=r: self.fail(r)
                elif not r.transfer.drained:
                    yield f"drain {r.name}", lambda r=r: self.drain(r)
            if r.notification:
                yield f"notify {r.name}", lambda r=r: self.notify(r)
            if r.reader_release:
                yield f"reader-release {r.name}", lambda r=r: self.reader_release(r)
            if not r.proxy_released and full:
                yield f"proxy-release {r.name}", lambda r=r: self.proxy_release(r)
        yield "holder-poll", self.holder_poll
        if self.t < END:
            yield "tick", self.tick
        if self.epoch == "e1":
            yield "restart", self.restart

    def finish(self, r: Request) -> None:
        r.issued_epoch, r.issued_at, r.src_blocks_live = self.epoch, self.t, True

    def hold(self, r: Request) -> None:
        r.hold_sent = True
        self.table.hold(r.name, (0,), ttl_s=TTL)

    def receive(self, r: Request) -> None:
        params = KVTransferParams(
            remote_engine_id="prefill", remote_request_id=r.name, remote_host="127.0.0.1", remote_port=1,
            remote_block_ids=(0,), pdserve_expires=float(r.issued_at + TTL), pdserve_epoch=None,
        )  # fmt: skip
        # A lease starts when the hold lands, after the parameters were signed: their deadline is no later.
        r.record = ReadRecord(ReceiveSpec(r.name, (0,), params, (0,)), ("prefill/rank0",), r.issued_at + TTL - MARGIN,
                              drain_timeout_s=10**6)  # fmt: skip
        r.dst_live = True
        if self.knobs.epochs and r.issued_epoch != self.epoch:
            # The handshake of the parameters' start finds another one: that mapping is never made.
            r.record.fail("gone", "the prefill engine restarted", self.t)
            return
        r.record.sources_known()
        if not self.knobs.pins:
            r.record.granted.add("prefill/rank0")

    def pin(self, r: Request) -> None:
        for source in r.record.pins_to_ask():
            epoch = r.issued_epoch if self.knobs.epochs else None
            r.record.pin_answered(source, self.table.pin(r.name, READER, epoch))
        if r.record.ready_to_post(self.t):
            self._post(r)

    def _post(self, r: Request) -> None:
        if self.cached_mapping is None or self.knobs.epochs:
            self.cached_mapping = r.issued_epoch if self.knobs.epochs else self.epoch
        r.mapping_epoch = r.issued_epoch if self.knobs.epochs else self.cached_mapping
        if r.mapping_epoch != self.epoch:
            self.violations.append(f"other-start: {r.name} READ through a mapping of {r.mapping_epoch}, "
                                   f"the engine runs {self.epoch}")  # fmt: skip
        r.transfer = ScriptedTransfer("prefill/rank0")
        r.posted_version = r.src_version if r.issued_epoch == self.epoch else -2
        r.doomed = r.issued_epoch != self.epoch or r.mapping_epoch != self.epoch
        r.record.posted([r.transfer])

    def land(self, r: Request) -> None:
        transfer = r.transfer
        transfer.in_flight = False
        if not r.dst_live:
            self.violations.append(f"landed-in-reused: {r.name}'s READ landed in decode blocks vLLM got back")
        if transfer.state is TransferState.PENDING:
            if r.doomed:
                transfer.state, transfer.failure_reason = TransferState.FAILED, "the source is gone"
            else:
                transfer.state = TransferState.DONE
                r.landed_version = r.src_version
                r.notification = True

    def fail(self, r: Request) -> None:
        r.transfer.state, r.transfer.failure_reason = TransferState.FAILED, "peer reset"

    def drain(self, r: Request) -> None:
        r.transfer.in_flight = False  # the transport confirmed the abort: nothing more lands

    def notify(self, r: Request) -> None:
        r.notification = False
        if r.issued_epoch == self.epoch:
            self.table.mark_read(r.name, READER, 1)

    def reader_release(self, r: Request) -> None:
        r.reader_release = False
        if r.issued_epoch == self.epoch:
            self.table.release(r.name, by=READER if self.knobs.pins else None)

    def proxy_release(self, r: Request) -> None:
        r.proxy_released = True
        if r.issued_epoch == self.epoch:
            self.table.release(r.name)

    def holder_poll(self) -> None:
        self.table.expire()
        for name in self.table.take_finished():
            self._free_source(self.requests[name])

    def _free_source(self, r: Request) -> None:
        if not r.src_blocks_live:
            return
        r.src_blocks_live = False
        r.src_version += 1
        # A READ past its deadline is never trusted (its record fails as expired): freeing under it is harmless.
        if r.transfer is not None and r.transfer.in_flight and r.posted_version >= 0 and self.t < r.record.deadline:
            self.violations.append(f"freed-under-read: {r.name}'s prefill blocks freed while its READ can land")

    def reader_poll(self, r: Request) -> None:
        record = r.record
        if not self.knobs.drains and record.phase is ReadPhase.ABORTED:
            record.phase = ReadPhase.DRAINED  # the old code: an aborted READ counts as over at once
        if record.phase is ReadPhase.PINNING and record.ready_to_post(self.t):
            self._post(r)
        record.poll(self.t)
        if record.ended and not r.reported:
            r.reported = True
            r.dst_live = False
            if record.phase is ReadPhase.DONE and (r.posted_version < 0 or r.landed_version != r.posted_version):
                self.violations.append(f"served-unheld: {r.name}'s READ served though its source was not held")
            if record.release_owed() and r.issued_epoch is not None:
                r.reader_release = True

    def tick(self) -> None:
        self.t += 1

    def restart(self) -> None:
        for r in self.requests.values():
            if r.issued_epoch != self.epoch:
                continue
            if r.transfer is not None and r.transfer.in_flight:
                self._lost_source(r)
            else:
                self._free_source(r)
        self.epoch = "e2"
        self.table = self._table()

    def _lost_source(self, r: Request) -> None:
        # The process died: its READs in flight fail, and its memory is gone (not reused by a live request).
        r.src_blocks_live = False
        r.src_version += 1
        r.doomed = True

    # ------------------------------------------------------------ the end

    def quiescent_violations(self) -> list[str]:
        """At the end of time, with every message delivered and every side polled: what is still open."""
        world = copy.deepcopy(self)
        world.t = END + TTL + GRACE + 1
        for _ in range(8):
            for r in world.requests.values():
                if r.transfer is not None and r.transfer.in_flight and r.transfer.state is not TransferState.PENDING:
                    world.drain(r)
                if r.notification:
                    world.notify(r)
                if r.reader_release:
                    world.reader_release(r)
                if r.record is not None and not r.reported:
                    world.reader_poll(r)
            world.holder_poll()
        open_ = [f"never-ends: lease {name}" for name in world.table._leases]
        open_ += [f"never-ends: record {r.name}" for r in world.requests.values() if r.record and not r.reported]
        return open_ + world.violations[len(self.violations) :]

    def signature(self) -> tuple:
        """The state, up to the names of requests that run the same events (they are interchangeable)."""
        table = self.table
        requests = []
        for r in self.requests.values():
            lease = table._leases.get(r.name)
            requests.append((
                r.name in FULL,
                (lease.state.value, tuple(sorted(lease.pins)), len(lease.reads_done)) if lease else None,
                table._finished.get(r.name), r.name in table._ended,
                r.issued_epoch, r.issued_at, r.hold_sent, r.src_blocks_live, r.src_version, r.posted_version,
                r.landed_version, r.mapping_epoch, r.record.phase.value if r.record else None,
                tuple(sorted(r.record.granted)) if r.record else (),
                (r.transfer.state.value, r.transfer.in_flight) if r.transfer else None, r.dst_live, r.notification,
                r.reader_release, r.proxy_released, r.reported, r.doomed,
            ))  # fmt: skip
        return (self.t, self.epoch, self.cached_mapping, tuple(sorted(requests, key=repr)))


@dataclasses.dataclass
class Result:
    states: int
    transitions: int
    violations: dict[str, list[str]]  # kind -> the shortest trace found


def explore(
    knobs: Knobs = Knobs(),
    requests: tuple[str, ...] = REQUESTS,
    full: tuple[str, ...] = FULL,
    stop_at: str | None = None,
    max_states: int = 2_000_000,
) -> Result:
    """Every reachable state of ``requests`` under ``knobs`` (those in ``full`` run every event, the others the
    main path); the shortest trace found to each kind of violation. ``stop_at``: end at the first of that kind."""
    global FULL
    FULL = full
    logging.disable(logging.WARNING)  # the classes log every refusal and expiry; millions of lines here
    start = World(knobs, requests)
    seen = {start.signature()}
    stack: list[tuple[World, tuple[str, ...]]] = [(start, ())]
    transitions = 0
    violations: dict[str, list[str]] = {}
    while stack:
        world, trace = stack.pop()
        for name, _ in list(world.events()):
            child = copy.deepcopy(world)
            event = dict(child.events())[name]
            event()
            transitions += 1
            found = child.violations
            signature = child.signature()
            if not found and child.t == END and signature not in seen:
                found = child.quiescent_violations()  # the same for any state that differs only by time
            for violation in found:
                kind = violation.partition(":")[0]
                if kind not in violations or len(violations[kind]) > len(trace) + 1:
                    violations[kind] = [*trace, name, violation]
                if kind == stop_at:
                    return Result(len(seen), transitions, violations)
            if found:
                continue  # a broken state: no need to go on from it
            if signature in seen:
                continue
            seen.add(signature)
            if len(seen) > max_states:
                raise RuntimeError(f"more than {max_states} states")
            stack.append((child, (*trace, name)))
    return Result(len(seen), transitions, violations)
