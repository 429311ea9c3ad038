"""LeaseTable: the prefill side's KV block leases, driven by a fake clock (no sleeping)."""

from __future__ import annotations

import math
import random
import sys
import threading
from collections import Counter

import pytest

from connectors.errors import ConnectorError, LeaseError
from connectors.leases import (
    LeaseState,
    LeaseStats,
    LeaseTable,
    PinAnswer,
    parse_read_notification,
    read_notification,
)
from tests.kv_probes import held_block_ids, held_leases, lease_state, pinned_block_ids


class FakeClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(default_ttl_s=120.0, clock=clock, engine_id="prefill-0")


def test_hold_keeps_blocks_for_the_tables_ttl(table: LeaseTable, clock: FakeClock):
    table.hold("req-1", [3, 4, 5])

    assert lease_state(table, "req-1") is LeaseState.HELD
    assert held_leases(table) == 1
    assert held_block_ids(table) == {3, 4, 5}
    assert list(table.take_finished()) == []
    clock.advance(120.0 - 1e-6)
    assert table.expire() == []
    clock.advance(1e-6)
    assert table.expire() == ["req-1"]


def test_a_read_frees_the_blocks_once(table: LeaseTable):
    table.hold("req-1", [3, 4])
    table.hold("req-2", [7])

    assert table.mark_read("req-1", reader_id=0) is True

    assert list(table.take_finished()) == ["req-1"]
    assert list(table.take_finished()) == []
    assert held_block_ids(table) == {7}
    assert held_leases(table) == 1


def test_with_two_expected_readers_only_the_second_frees(table: LeaseTable):
    table.hold("req-1", [3, 4], expected_reads=2)

    assert table.mark_read("req-1", reader_id=0) is False
    assert list(table.take_finished()) == []
    assert held_block_ids(table) == {3, 4}

    assert table.mark_read("req-1", reader_id=1) is True
    assert list(table.take_finished()) == ["req-1"]
    assert held_leases(table) == 0


def test_readers_say_how_many_of_them_to_expect(table: LeaseTable):
    # Held before any reader is known (expected 1); the decode engine has two ranks reading this one.
    table.hold("req-1", [3, 4])

    assert table.mark_read("req-1", reader_id="decode-rank-0", expected_reads=2) is False
    assert list(table.take_finished()) == []
    assert table.mark_read("req-1", reader_id="decode-rank-1", expected_reads=2) is True
    assert list(table.take_finished()) == ["req-1"]
    with pytest.raises(LeaseError, match="expected_reads must be at least 1, got 0"):
        table.mark_read("req-2", reader_id=0, expected_reads=0)


@pytest.mark.parametrize(
    ("message", "parsed"),
    [
        (read_notification("req-1", 2), ("req-1", 2, None)),
        (read_notification("req-1", 2, "decode/rank0"), ("req-1", 2, "decode/rank0")),
        (read_notification("id with spaces", 1), ("id with spaces", 1, None)),
        (b"req-1", ("req-1", None, None)),  # a reader that does not say: the lease's own count
        (b"PDRD x r req-1", ("PDRD x r req-1", None, None)),
        (b"PDRD 0 r req-1", ("PDRD 0 r req-1", None, None)),
        (b"\xff\xfe", ("\ufffd\ufffd", None, None)),
    ],
)
def test_read_notifications_round_trip_and_never_raise(message: bytes, parsed: tuple[str, int | None, str | None]):
    assert parse_read_notification(message) == parsed


def test_a_duplicate_notification_from_one_reader_is_idempotent(table: LeaseTable):
    table.hold("req-1", [3], expected_reads=2)

    assert table.mark_read("req-1", reader_id=0) is False
    assert table.mark_read("req-1", reader_id=0) is False

    assert list(table.take_finished()) == []
    assert held_block_ids(table) == {3}
    assert table.stats().late_notifications == 0
    assert table.mark_read("req-1", reader_id=1) is True
    assert list(table.take_finished()) == ["req-1"]


def test_release_frees_at_once_and_a_later_read_is_a_late_notification(table: LeaseTable):
    table.hold("req-1", [3, 4])

    assert table.release("req-1") is True
    assert list(table.take_finished()) == ["req-1"]
    assert held_block_ids(table) == set()

    assert table.mark_read("req-1", reader_id=0) is False
    assert list(table.take_finished()) == []
    assert table.stats() == LeaseStats(held=1, released=1, late_notifications=1)


def test_release_of_an_unknown_or_finished_request_returns_false(table: LeaseTable):
    assert table.release("never-held") is False
    table.hold("req-1", [3])
    table.mark_read("req-1", reader_id=0)

    assert table.release("req-1") is False
    assert list(table.take_finished()) == ["req-1"]
    assert table.stats() == LeaseStats(held=1, read=1)


def test_a_read_for_an_unknown_request_is_counted_and_ignored(table: LeaseTable):
    assert table.mark_read("never-held", reader_id=0) is False
    assert table.stats().late_notifications == 1
    assert list(table.take_finished()) == []


def test_expiry_frees_exactly_the_expired_leases_at_the_right_time(table: LeaseTable, clock: FakeClock):
    start = clock.now
    table.hold("short", [1, 2], ttl_s=10.0)
    clock.advance(5.0)
    table.hold("later", [3], ttl_s=10.0)  # expires at start + 15
    table.hold("long", [4])  # default 120 s

    clock.now = start + 10.0 - 1e-6
    assert table.expire() == []
    assert list(table.take_finished()) == []

    clock.now = start + 10.0
    assert table.expire() == ["short"]
    assert held_block_ids(table) == {3, 4}

    clock.now = start + 14.9
    assert table.expire() == []
    clock.now = start + 15.0
    assert table.expire() == ["later"]
    assert list(table.take_finished()) == ["short", "later"]
    assert held_block_ids(table) == {4}
    assert held_leases(table) == 1
    assert table.stats().expired == 2


def test_expiry_skips_leases_that_were_already_read_or_released(table: LeaseTable, clock: FakeClock):
    table.hold("read", [1], ttl_s=10.0)
    table.hold("released", [2], ttl_s=10.0)
    table.hold("abandoned", [3], ttl_s=10.0)
    table.mark_read("read", reader_id=0)
    table.release("released")

    clock.advance(10.0)
    assert table.expire() == ["abandoned"]
    assert list(table.take_finished()) == ["read", "released", "abandoned"]
    assert table.stats() == LeaseStats(held=3, read=1, released=1, expired=1)


def test_a_read_after_expiry_is_a_late_notification(table: LeaseTable, clock: FakeClock):
    table.hold("req-1", [1], ttl_s=10.0)
    clock.advance(10.0)
    assert table.expire() == ["req-1"]

    assert table.mark_read("req-1", reader_id=0) is False
    assert list(table.take_finished()) == ["req-1"]
    assert table.stats() == LeaseStats(held=1, expired=1, late_notifications=1)


def test_take_finished_returns_each_id_once_in_finishing_order(table: LeaseTable, clock: FakeClock):
    for request_id in ("a", "b", "c", "d"):
        table.hold(request_id, [ord(request_id)], ttl_s=10.0 if request_id == "c" else 100.0)
    table.release("b")
    table.mark_read("a", reader_id=0)

    assert list(table.take_finished()) == ["b", "a"]
    clock.advance(10.0)
    table.expire()
    table.release("d")
    assert list(table.take_finished()) == ["c", "d"]
    assert list(table.take_finished()) == []


def test_holding_the_same_id_twice_raises_a_clear_error(table: LeaseTable):
    table.hold("req-1", [3, 4])

    with pytest.raises(LeaseError, match=r"request 'req-1' already holds a lease on 2 blocks") as raised:
        table.hold("req-1", [5])
    assert isinstance(raised.value, ConnectorError)
    assert held_block_ids(table) == {3, 4}
    assert table.stats().held == 1


def test_an_id_can_be_held_again_only_after_it_was_reported(table: LeaseTable):
    table.hold("req-1", [3])
    table.release("req-1")

    with pytest.raises(LeaseError, match=r"request 'req-1' finished its lease \(RELEASED\) but was not yet reported"):
        table.hold("req-1", [3])

    assert list(table.take_finished()) == ["req-1"]
    table.hold("req-1", [9])
    assert held_block_ids(table) == {9}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expected_reads": 0}, "expected_reads must be at least 1, got 0"),
        ({"ttl_s": 0.0}, "positive finite number of seconds, got 0.0"),
        ({"ttl_s": -1.0}, "positive finite number of seconds, got -1.0"),
        ({"ttl_s": math.inf}, "positive finite number of seconds, got inf"),
        ({"ttl_s": math.nan}, "positive finite number of seconds, got nan"),
    ],
)
def test_hold_rejects_bad_counts_and_ttls(table: LeaseTable, kwargs: dict, message: str):
    with pytest.raises(LeaseError, match=message):
        table.hold("req-1", [1], **kwargs)
    assert held_leases(table) == 0
    assert table.stats().held == 0


def test_a_bad_default_ttl_is_rejected():
    with pytest.raises(LeaseError, match="got -5"):
        LeaseTable(default_ttl_s=-5)


def test_stats_count_every_outcome(table: LeaseTable, clock: FakeClock):
    table.hold("read", [1], expected_reads=2)
    table.hold("released", [2])
    table.hold("expired", [3], ttl_s=1.0)
    table.hold("still-held", [4])
    table.mark_read("read", reader_id=0)
    table.mark_read("read", reader_id=1)
    table.mark_read("read", reader_id=1)  # late: the lease is already read
    table.release("released")
    clock.advance(1.0)
    table.expire()
    table.mark_read("expired", reader_id=0)  # late

    assert table.stats() == LeaseStats(held=4, read=1, released=1, expired=1, late_notifications=2)
    assert held_leases(table) == 1


def test_concurrent_reads_releases_and_expiry_free_every_lease_exactly_once(clock: FakeClock):
    """NIXL notification threads, the proxy's releases, the scheduler's expire() and get_finished() all at once."""
    table = LeaseTable(default_ttl_s=50.0, clock=clock)
    request_ids = [f"req-{i}" for i in range(2000)]
    for i, request_id in enumerate(request_ids):
        table.hold(request_id, [2 * i, 2 * i + 1], expected_reads=2)
    shuffled = random.Random(0).sample(request_ids, len(request_ids))
    # 500 leases are both read and released, so the two race for the same lease; the last 200 only expire.
    readers, to_release = shuffled[:1500], shuffled[1000:1800]

    start = threading.Barrier(6)
    stop_taking = threading.Event()
    taken: list[str] = []
    errors: list[BaseException] = []

    def run(work) -> None:
        try:
            start.wait()
            work()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread's assertion
            errors.append(e)

    def read_as(reader_id: int, order: int) -> None:
        for request_id in readers[::order]:
            table.mark_read(request_id, reader_id)
            table.mark_read(request_id, reader_id)  # duplicate notifications race too

    def release() -> None:
        for request_id in reversed(to_release):
            table.release(request_id)

    def expire() -> None:
        for _ in range(200):
            clock.advance(0.5)  # reaches the 50 s TTL part way through
            table.expire()

    def take() -> None:
        while not stop_taking.is_set():
            taken.extend(table.take_finished())
        taken.extend(table.take_finished())

    workers = [
        threading.Thread(target=run, args=(lambda: read_as(0, 1),)),
        threading.Thread(target=run, args=(lambda: read_as(1, -1),)),
        threading.Thread(target=run, args=(release,)),
        threading.Thread(target=run, args=(expire,)),
    ]
    taker = threading.Thread(target=run, args=(take,))
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many more thread switches inside the table's methods
    try:
        for thread in [*workers, taker]:
            thread.start()
        start.wait()
        for thread in workers:
            thread.join()
        clock.now = math.inf
        table.expire()  # whatever no thread ended
        stop_taking.set()
        taker.join()
    finally:
        sys.setswitchinterval(switch_interval)

    assert errors == []
    counts = Counter(taken)
    assert set(counts) == set(request_ids)
    assert max(counts.values()) == 1
    assert held_leases(table) == 0
    assert held_block_ids(table) == set()
    stats = table.stats()
    assert stats.read + stats.released + stats.expired == stats.held == len(request_ids)
    assert stats.expired >= 200


# ---------------------------------------------------------------- pins: a READ in flight keeps its blocks


def pinned_table(clock: FakeClock) -> LeaseTable:
    table = LeaseTable(10.0, clock=clock, grace_s=2.0, epoch="e1")
    table.hold("r1", (1, 2))
    return table


def test_a_pin_answers_ok_for_a_held_lease_wait_before_it_and_gone_after_it(clock: FakeClock):
    table = LeaseTable(10.0, clock=clock, epoch="e1")
    assert table.pin("r1", "decode/rank0", "e1") is PinAnswer.WAIT  # the hold comes with the next step
    table.hold("r1", (1, 2))
    assert table.pin("r1", "decode/rank0", "e1") is PinAnswer.OK
    assert lease_state(table, "r1") is LeaseState.BEING_READ
    assert table.mark_read("r1", "decode/rank0", 1) is True
    assert table.pin("r1", "decode/rank1", "e1") is PinAnswer.GONE  # ended: the reader recomputes


def test_a_pin_from_parameters_of_another_start_is_gone(clock: FakeClock):
    table = pinned_table(clock)
    assert table.pin("r1", "decode/rank0", "e0") is PinAnswer.GONE
    assert lease_state(table, "r1") is LeaseState.HELD


def test_a_release_that_names_no_reader_is_refused_under_a_pin(clock: FakeClock):
    table = pinned_table(clock)
    table.pin("r1", "decode/rank0", "e1")

    assert table.release("r1") is False  # the proxy's: a READ may be in flight
    assert held_block_ids(table) == pinned_block_ids(table) == {1, 2}
    assert table.stats().releases_refused == 1
    assert table.mark_read("r1", "decode/rank0", 1) is True
    assert table.take_finished() == {"r1": LeaseState.READ}


def test_a_readers_own_release_ends_its_pin_and_the_lease_once_no_pin_is_left(clock: FakeClock):
    table = pinned_table(clock)
    table.pin("r1", "decode/rank0", "e1")
    table.pin("r1", "decode/rank1", "e1")

    assert table.release("r1", by="decode/rank0") is False  # rank 1 still reads
    assert table.release("r1", by="decode/rank1") is True
    assert table.take_finished() == {"r1": LeaseState.RELEASED}


def test_a_read_of_one_reader_does_not_end_a_lease_another_still_reads(clock: FakeClock):
    table = pinned_table(clock)
    table.pin("r1", "decode/rank0", "e1")
    table.pin("r1", "decode/rank1", "e1")
    assert table.mark_read("r1", "decode/rank0", 1) is False  # expected 1, but rank 1's READ may still land
    assert table.mark_read("r1", "decode/rank1", 1) is True


def test_a_pinned_lease_waits_the_grace_past_its_end_for_a_reader_never_heard_of_again(clock: FakeClock):
    table = pinned_table(clock)
    table.pin("r1", "decode/rank0", "e1")
    clock.advance(10.0)
    assert table.expire() == []  # a READ aborted at the lease's end less the margin may still be draining
    clock.advance(2.0)
    assert table.expire() == ["r1"]
    assert table.take_finished() == {"r1": LeaseState.EXPIRED}
