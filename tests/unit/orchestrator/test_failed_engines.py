"""A failed engine of a pool below its target starts again after a back-off, or at once by hand; one its pool no
longer needs stops.

``PoolChanges`` without Ray (``tests/unit/controller_factories.py``) (nothing starts or stops here); the real path, an
engine that cannot start during a scale-up and starts once its port is free, is ``tests/integration/test_scale.py``.
"""

from __future__ import annotations

import time

from orchestrator.engine_record import RETRY_FIRST_S, RETRY_MAX_S, EngineRecord, engine_status, retry_delay
from orchestrator.pool_changes import PoolChanges
from tests.unit.controller_factories import pool_changes


def controller() -> tuple[PoolChanges, list[str]]:
    """``PoolChanges`` without Ray, and what it would start or stop, in order."""
    c = pool_changes(prefill=2, decode=1)
    actions: list[str] = []
    c.tasks.spawn = lambda coro: (coro.close(), actions.append(coro.__qualname__))  # type: ignore[method-assign]
    c._grow = lambda role, count: [f"{role}-new"] * max(count, 0)  # type: ignore[method-assign]
    c.retire = lambda record, **_: actions.append(f"retire {record.engine_id}")  # type: ignore[method-assign]
    return c, actions


def engine(c: PoolChanges, engine_id: str, state: str) -> EngineRecord:
    record = c.pools.engines[engine_id] = EngineRecord(engine_id, engine_id.split("-")[0], state=state)
    return record


def test_the_back_off_doubles_from_10_s_to_5_min() -> None:
    assert [retry_delay(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 300, 300]
    assert (RETRY_FIRST_S, RETRY_MAX_S) == (10.0, 300.0)
    record = EngineRecord("prefill-1", "prefill", state="starting")
    before = time.monotonic()
    assert record.failed("OSError: [Errno 98] Address already in use") == 10.0
    assert record.failed("again") == 20.0
    assert (record.state, record.failures, record.error) == ("failed", 2, "again")
    assert record.retry_at >= before + 20.0
    entry = engine_status(record)
    assert entry["failures"] == 2 and "retry_at" not in entry


async def test_a_failed_engine_holds_its_replica_until_its_back_off_ends() -> None:
    c, actions = controller()
    engine(c, "prefill-0", "ready")
    failed = engine(c, "prefill-1", "failed")
    failed.failed("OSError: [Errno 98] Address already in use")
    plan = await c.resize("prefill", "autoscaler: ...")
    # no new replica instead of it, no start yet
    assert plan == {"take_back": [], "move_in": [], "start": [], "retire": []}
    assert failed.state == "failed" and actions == [] and c.events == []

    failed.retry_at = time.monotonic() - 1  # the back-off ended
    plan = await c.resize("prefill", "a failed engine's back-off ended")
    assert plan["start"] == ["prefill-1"] and failed.state == "pending"
    assert actions == ["Starts.start_again"]
    assert c.events == [
        "scaling prefill 1 -> 2 (a failed engine's back-off ended)",
        "prefill-1 starting again (start 2; it failed: OSError: [Errno 98] Address already in use)",
    ]
    await c.resize("prefill", "again")  # counted as serving now: not started twice
    assert actions == ["Starts.start_again"]


async def test_a_scale_by_hand_tries_a_failed_engine_at_once() -> None:
    c, actions = controller()
    engine(c, "prefill-0", "ready")
    engine(c, "prefill-1", "failed").failed("boom\ntraceback ...")
    plan = await c.resize("prefill", "by hand", retry_now=True)
    assert plan["start"] == ["prefill-1"] and c.pools.engines["prefill-1"].state == "pending"
    assert c.events[-1] == "prefill-1 starting again (start 2; it failed: boom)"


async def test_a_failed_engine_its_pool_no_longer_needs_stops() -> None:
    c, actions = controller()
    c.pools.targets["prefill"] = 1
    engine(c, "prefill-0", "ready")
    engine(c, "prefill-1", "failed").failed("boom")
    plan = await c.resize("prefill", "by hand", retry_now=True)
    assert plan == {"take_back": [], "move_in": [], "start": [], "retire": []}
    assert actions == ["retire prefill-1"]
    assert c.events == ["prefill-1 failed and its pool is at its target without it: stopping it"]


async def test_a_failed_engine_does_not_stop_new_ones_on_free_replicas() -> None:
    c, actions = controller()
    c.pools.targets["prefill"] = 2
    engine(c, "prefill-0", "failed").failed("boom")  # in its back-off
    plan = await c.resize("prefill", "by hand")
    assert plan["start"] == ["prefill-new"]  # one new engine; prefill-0 waits for its back-off
