"""Role moves: a ready engine changes pool without a restart (``PoolChanges.move``, and ``scale(move=True)``,
the autoscaler's), by the rules the simulator follows too (``rules.moves_for``, ``rules.move_order``).

``PoolChanges`` without Ray (``tests/unit/controller_factories.py``), with a stand-in for the proxy actor that
records what it is told; the real path, moves under load on a running cluster, is ``tests/integration/test_scale.py``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.autoscale.rules import MOVING, move_order, moves_for
from orchestrator.controller import ClusterController
from orchestrator.engine_record import EngineRecord, replica
from orchestrator.pool_changes import PoolChanges
from tests.unit.controller_factories import ProxyHandle, pool_changes


def controller(prefill: int = 2, decode: int = 1) -> tuple[PoolChanges, ProxyHandle, dict[str, str]]:
    """``PoolChanges`` of the autoscaling demo (prefill 1..2, decode 1..2, 3 engines) with ready engines, and
    what keeps each busy (``_busy``: '' when it is done)."""
    c = pool_changes(prefill, decode, ready=True)
    busy: dict[str, str] = {}

    async def _busy(record: EngineRecord) -> str:
        return busy.get(record.engine_id, "")

    c._busy = _busy  # type: ignore[method-assign]
    return c, c.proxy.handle, busy


def test_moves_for_takes_the_part_of_a_change_both_pools_share() -> None:
    both = {"prefill": 3, "decode": 3}
    assert moves_for({"prefill": 3, "decode": 1}, {"prefill": 1, "decode": 3}, both) == ("prefill", "decode", 2)
    assert moves_for({"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 4}, both) == ("prefill", "decode", 1)
    assert moves_for({"prefill": 1, "decode": 3}, {"prefill": 3}, both) is None  # decode does not shrink
    assert moves_for({"prefill": 1, "decode": 3}, {"prefill": 2, "decode": 2}, both) == ("decode", "prefill", 1)
    only_one_ready = {"prefill": 1, "decode": 3}
    assert moves_for({"prefill": 3, "decode": 1}, {"prefill": 1, "decode": 3}, only_one_ready) == (
        "prefill", "decode", 1)  # fmt: skip
    records = [EngineRecord(f"prefill-{n}", "prefill", state=s) for n, s in enumerate(["ready", "ready", "starting"])]
    order = move_order(records, lambda r: r.state == "ready", lambda r: replica(r.engine_id))
    assert [r.engine_id for r in order] == ["prefill-1", "prefill-0"]  # ready ones, newest first


async def test_a_moving_engine_leaves_its_pool_at_once_and_serves_the_other_once_its_work_is_done() -> None:
    c, proxy, busy = controller()
    busy["prefill-1"] = "1 request(s) running or queued"
    answer = await c.move("prefill", "decode", 1)
    assert answer == {"plan": {"move": {"prefill->decode": ["prefill-1"]}}, "targets": {"prefill": 1, "decode": 2}}
    mover = c.pools.engines["prefill-1"]
    assert (mover.state, mover.role, mover.moving_from) == (MOVING, "decode", "prefill")
    # out of prefill's routing now (kept as draining: its requests are counted), not yet in decode's
    assert proxy.told == [("prefill", ["prefill-0"], ["prefill-1"]), ("decode", ["decode-0"], [])]
    await asyncio.sleep(0.5)
    assert mover.state == MOVING  # its prefill work is not done
    busy.pop("prefill-1")
    await asyncio.wait_for(asyncio.gather(*c.tasks), 5)
    assert (mover.state, mover.role, mover.moving_from) == ("ready", "decode", None)
    # out of the old pool's table before it joins the new one
    assert proxy.told[-2:] == [("prefill", ["prefill-0"], []), ("decode", ["prefill-1", "decode-0"], [])]
    [move] = c.pools.moves
    assert (move["engine_id"], move["from"], move["to"]) == ("prefill-1", "prefill", "decode")
    assert move["finishing_s"] >= 0.5 and 0 <= move["switch_s"] < 1
    assert c.events[0] == ("prefill-1 moving prefill -> decode (by hand): out of the prefill pool, finishing its "
                           "prefill work")  # fmt: skip
    assert c.events[-1].startswith("prefill-1 serves decode now: moved in ")


@pytest.mark.parametrize(
    ("source", "destination", "count", "why"),
    [
        ("prefill", "decode", 2, "would leave prefill below its minimum (1)"),
        ("decode", "prefill", 1, "would leave decode below its minimum (1)"),
        ("prefill", "prefill", 1, "a move goes between the pools prefill and decode"),
        ("prefill", "decode", 0, "a move needs at least one engine"),
    ],
)
async def test_a_move_that_would_break_a_bound_is_refused(source: str, destination: str, count: int, why: str):
    c, proxy, _ = controller()
    assert why in (await c.move(source, destination, count))["error"]
    assert proxy.told == [] and all(r.state == "ready" for r in c.pools.engines.values())


async def test_a_move_needs_a_ready_engine_and_pools_of_one_shape() -> None:
    c, _, _ = controller()
    c.pools.engines["prefill-1"].state, c.pools.engines["prefill-0"].state = "starting", "draining"
    assert (await c.move("prefill", "decode"))["error"] == "prefill has 0 ready engine(s) that could move, not 1"
    c, _, _ = controller()
    c.pools.spec = c.pools.spec.model_copy(update={"role_moves": False})
    refused = (await c.move("prefill", "decode"))["error"]
    assert refused == "engines cannot move: the spec forbids it (role_moves: false)"
    decode = c.pools.spec.decode.model_copy(update={"cpu_cores": 2})
    c.pools.spec = c.pools.spec.model_copy(update={"role_moves": True, "decode": decode})
    assert c.pools.spec.move_problem() == "the pools differ in shape (cpu_cores)"


async def test_the_autoscalers_change_of_ratio_is_made_by_moves_and_the_rest_by_starts() -> None:
    c, proxy, _ = controller(prefill=2, decode=1)
    grown: list[tuple[str, int]] = []
    c._grow = lambda role, count: grown.append((role, count)) or []  # type: ignore[method-assign]
    answer = await c.scale({"prefill": 1, "decode": 2}, "autoscaler: prefill 2 -> 1, decode 1 -> 2", move=True)
    assert answer["plan"]["move"] == {"prefill->decode": ["prefill-1"]}
    no_change = {"take_back": [], "move_in": [], "start": [], "retire": []}
    assert answer["plan"]["decode"] == no_change  # the move is all it needs
    assert answer["plan"]["prefill"]["retire"] == [] and grown == [("prefill", 0), ("decode", 0)]
    assert c.pools.engines["prefill-1"].state == MOVING
    # without move: the same change is a start and a retirement
    c, _, _ = controller(prefill=2, decode=1)
    c._grow = lambda role, count: [f"{role}-new"] * count  # type: ignore[method-assign]
    c.retire = lambda record, **_: None  # type: ignore[method-assign]
    answer = await c.scale({"prefill": 1, "decode": 2}, "by hand")
    assert "move" not in answer["plan"] and answer["plan"]["decode"]["start"] == ["decode-new"]


async def test_a_mover_retired_before_it_arrives_drains_from_its_old_pool() -> None:
    c, proxy, busy = controller()
    busy["prefill-1"] = "1 request(s) running or queued"
    await c.move("prefill", "decode", 1)
    mover = c.pools.engines["prefill-1"]
    retired: list[Any] = []
    c._retirement = lambda record, drain, announce, keep_warm_s=0.0: (  # type: ignore[method-assign]
        retired.append((drain, announce)) or asyncio.sleep(0)
    )
    c.retire(mover)
    assert (mover.state, mover.role, mover.moving_from) == ("draining", "prefill", None)
    assert retired == [(True, True)]
    busy.pop("prefill-1")
    await asyncio.wait_for(asyncio.gather(*c.tasks), 5)
    assert mover.state == "draining" and not c.pools.moves  # the move was called off


def test_a_pool_grows_on_the_other_pools_free_launches_when_its_own_are_held_by_movers() -> None:
    c, _, _ = controller(prefill=2, decode=1)
    c.pools.engines["prefill-1"].role = "decode"  # moved: prefill's two launches are both held
    assert c._grow("prefill", 1) == ["decode-1"]
    assert c.pools.engines["decode-1"].role == "prefill" and c.starts.launched == ["decode-1"]


def bare_controller(changes: PoolChanges, api_port: int) -> ClusterController:
    """The controller's snapshot and restore, on ``changes``' pools (no Ray, no API)."""
    c = ClusterController.__new__(ClusterController)
    c.groups = {changes.pools.spec.model_name: SimpleNamespace(name=changes.pools.spec.model_name, pools=changes.pools)}
    c.api, c._phase = type("Api", (), {"port": api_port})(), changes.pools.phase
    c.error, c.started_at, c.ready_s, c.restarts = None, 0.0, 1.0, 0
    return c


def test_a_restarted_controller_knows_which_pool_a_moved_engine_serves() -> None:
    c, _, _ = controller()
    c.pools.engines["prefill-1"].role, c.pools.engines["prefill-1"].state = "decode", MOVING
    c.pools.engines["prefill-1"].moving_from = "prefill"
    snapshot = bare_controller(c, api_port=1)._snapshot()
    again = bare_controller(controller()[0], api_port=0)
    again._restore(snapshot)
    record = again.groups["smollm2-135m-instruct"].pools.engines["prefill-1"]
    assert (record.role, record.state, record.moving_from) == ("decode", MOVING, "prefill")


async def test_a_growing_pool_moves_in_the_other_pools_draining_or_warm_engine_before_it_starts_one() -> None:
    c, proxy, busy = controller(prefill=1, decode=1)
    warm = c.pools.engines["prefill-1"] = EngineRecord("prefill-1", "prefill", state="draining", url="http://prefill-1")
    warm.warm_since, warm.warm_cut = 1.0, asyncio.Event()  # retired a while ago, kept warm
    grown: list[tuple[str, int]] = []
    c._grow = lambda role, count: grown.append((role, count)) or []  # type: ignore[method-assign]
    answer = await c.scale({"decode": 2}, "autoscaler: decode 1 -> 2")
    assert answer["plan"]["decode"]["move_in"] == ["prefill-1"] and grown == [("decode", 0)]
    assert (warm.state, warm.role, warm.moving_from, warm.warm_cut) == (MOVING, "decode", "prefill", None)
    await asyncio.wait_for(asyncio.gather(*c.tasks), 5)
    assert (warm.state, warm.role) == ("ready", "decode")
    assert proxy.told[-1] == ("decode", ["decode-0", "prefill-1"], [])
    assert c.events[1].startswith("prefill-1 moving prefill -> decode (autoscaler: decode 1 -> 2; it was kept warm")
    # where the spec forbids moves, the pool starts an engine instead
    c, _, _ = controller(prefill=1, decode=1)
    c.pools.spec = c.pools.spec.model_copy(update={"role_moves": False})
    c.pools.engines["prefill-1"] = EngineRecord("prefill-1", "prefill", state="draining", url="http://prefill-1")
    grown.clear()
    c._grow = lambda role, count: grown.append((role, count)) or []  # type: ignore[method-assign]
    assert (await c.scale({"decode": 2}, "by hand"))["plan"]["decode"]["move_in"] == []
    assert grown == [("decode", 1)]
