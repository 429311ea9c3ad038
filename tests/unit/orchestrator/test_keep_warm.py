"""The controller's engines kept warm (``autoscaling.keep_warm_s``): how long, and when the budget needs their room.

``PoolChanges`` without Ray (``tests/unit/controller_factories.py``) (no engines start or stop here); the real path, a
scale-down kept warm and taken back on a running cluster, is ``tests/integration/test_autoscale.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

from orchestrator.control import ENGINE_FIELDS
from orchestrator.engine_record import EngineRecord, engine_status
from orchestrator.pool_changes import PoolChanges
from tests.unit.controller_factories import pool_changes as controller


def warm(c: PoolChanges, engine_id: str, since: float) -> EngineRecord:
    record = EngineRecord(engine_id, engine_id.split("-")[0], state="draining")
    record.warm_since, record.warm_cut = since, asyncio.Event()
    c.pools.engines[engine_id] = record
    return record


async def test_engines_are_kept_warm_only_in_the_budget_the_targets_leave():
    c = controller()
    assert c._warm_room() == 1  # 3 engines, targets 1 + 1
    old, new = warm(c, "prefill-1", since=1.0), warm(c, "prefill-2", since=2.0)
    assert c._warm() == [old, new] and c._warm_room() == -1
    c._fit_warm()  # one too many: the longest-warm gives its room
    assert old.warm_cut.is_set() and not new.warm_cut.is_set()
    c.pools.targets["decode"] = 2  # a scale-up of the other pool needs the last one's room too
    c._fit_warm()
    assert new.warm_cut.is_set() and c._warm() == []


async def test_a_warm_engine_waits_keep_warm_s_unless_its_room_is_needed():
    c = controller()
    record = EngineRecord("prefill-1", "prefill", state="draining")
    started = time.monotonic()
    await c._keep_warm(record, 0.2)
    assert time.monotonic() - started >= 0.2
    assert c.events == ["prefill-1 drained; kept warm for 0.2s (autoscaling.keep_warm_s): a scale-up meanwhile "
                        "takes it back at once", "prefill-1 not taken back in 0.2s: stopping it"]  # fmt: skip
    assert record.warm_since is None and record.warm_cut is None

    c.events.clear()
    c.pools.engines["prefill-1"] = record
    task = asyncio.create_task(c._keep_warm(record, 60))
    await asyncio.sleep(0.05)
    c.pools.targets["prefill"] = 2  # the budget: 2 + 1 targets, and it
    c._fit_warm()
    await asyncio.wait_for(task, 5)
    assert c.events[-1] == "prefill-1 no longer kept warm: autoscaling.max_engines needs its room"


def test_status_says_an_engine_is_kept_warm_and_leaves_out_what_only_the_controller_uses():
    c = controller()
    record = warm(c, "prefill-1", since=1.0)
    entry = engine_status(record)
    assert entry["kept_warm"] is True and entry["state"] == "draining"
    assert not set(entry) & {"handle", "warm_since", "warm_cut"}
    assert set(entry) >= set(ENGINE_FIELDS)
    json.dumps(entry)  # the status travels as JSON (it once held the asyncio.Event, which broke it)
