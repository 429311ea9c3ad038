"""``proxy.pool``: membership (set, add, drain, remove), engine state kept across changes, legs, the snapshot."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import UnknownEngine
from proxy.pool import Endpoint, EnginePool


def endpoints(role: str, count: int) -> list[Endpoint]:
    return [Endpoint(f"{role}-{i}", f"http://127.0.0.1:{8100 + i}") for i in range(count)]


@pytest.fixture
def pool() -> EnginePool:
    pool = EnginePool()
    pool.set_endpoints("prefill", endpoints("prefill", 2))
    pool.set_endpoints("decode", endpoints("decode", 2))
    return pool


def ready(pool: EnginePool, role: str) -> list[str]:
    return [e.engine_id for e in pool.ready(role)]


def test_snapshot_reports_each_engines_state(pool):
    with pool.engine("decode-1"):
        pool.drain("prefill-1")
        snapshot = pool.snapshot()

    assert snapshot["prefill"][1] == {
        "engine_id": "prefill-1",
        "url": "http://127.0.0.1:8101",
        "in_flight": 0,
        "healthy": True,
        "draining": True,
        "kv_endpoints": [],
    }
    assert snapshot["decode"][1]["in_flight"] == 1
    assert pool.snapshot()["decode"][1]["in_flight"] == 0


def test_drain_stops_choosing_the_engine_and_add_takes_it_back(pool):
    drained = pool.drain("decode-0")

    assert ready(pool, "decode") == ["decode-1"]
    assert {pool.pick("decode").engine_id for _ in range(4)} == {"decode-1"}
    assert pool.add("decode", Endpoint("decode-0", "http://127.0.0.1:8100")) is drained
    assert ready(pool, "decode") == ["decode-0", "decode-1"]


def test_a_draining_engines_requests_continue(pool):
    engine = pool.engine("prefill-0")
    with engine:
        pool.drain("prefill-0")
        assert engine.in_flight == 1
    assert engine.in_flight == 0
    assert pool.snapshot()["prefill"][0]["draining"] is True


def test_add_appends_a_new_engine(pool):
    added = pool.add("prefill", Endpoint("prefill-9", "http://127.0.0.1:8199"))

    assert ready(pool, "prefill") == ["prefill-0", "prefill-1", "prefill-9"]
    assert added.role == "prefill" and added.in_flight == 0


def test_add_refuses_an_engine_of_the_other_role(pool):
    with pytest.raises(ValueError, match="already a decode engine"):
        pool.add("prefill", Endpoint("decode-0", "http://127.0.0.1:8100"))


def test_remove_forgets_the_engine_and_its_legs_end_on_their_own(pool):
    engine = pool.engine("decode-0")
    engine.start_leg()
    removed = pool.remove("decode-0")
    removed.end_leg()

    assert removed is engine and engine.in_flight == 0
    assert [e["engine_id"] for e in pool.snapshot()["decode"]] == ["decode-1"]
    with pytest.raises(UnknownEngine):
        pool.engine("decode-0")


@pytest.mark.parametrize("action", ["drain", "remove", "engine"])
def test_unknown_engine_ids_are_a_404_error(pool, action):
    with pytest.raises(UnknownEngine) as caught:
        getattr(pool, action)("decode-7")
    assert caught.value.status == 404 and "decode-7" in caught.value.message


def test_an_engines_kv_endpoints_follow_the_latest_set_endpoints(pool):
    engine = pool.engine("decode-0")
    side_channel = ("tcp://127.0.0.1:5700", "tcp://127.0.0.1:5701")

    pool.set_endpoints("decode", [Endpoint("decode-0", engine.url, side_channel), endpoints("decode", 2)[1]])

    assert pool.engine("decode-0") is engine and engine.kv_endpoints == side_channel
    assert pool.snapshot()["decode"][0]["kv_endpoints"] == list(side_channel)


def test_set_endpoints_keeps_the_state_of_engines_it_keeps(pool):
    kept = pool.engine("decode-1")
    kept.start_leg()
    pool.set_healthy(kept, False)
    pool.set_endpoints("decode", [endpoints("decode", 2)[1], Endpoint("decode-5", "http://127.0.0.1:8105")])

    assert pool.engine("decode-1") is kept and kept.in_flight == 1 and not kept.healthy
    assert ready(pool, "decode") == ["decode-5"]
    with pytest.raises(UnknownEngine):
        pool.engine("decode-0")


def test_set_endpoints_with_a_new_url_starts_the_engine_afresh(pool):
    old = pool.engine("decode-0")
    pool.set_healthy(old, False)
    pool.set_endpoints("decode", [Endpoint("decode-0", "http://10.0.0.1:8100")])

    assert pool.engine("decode-0") is not old and pool.engine("decode-0").healthy


def test_ejected_engines_are_not_ready_and_come_back(pool):
    engine = pool.engine("prefill-0")
    pool.set_healthy(engine, False)
    assert ready(pool, "prefill") == ["prefill-1"]
    pool.set_healthy(engine, True)
    assert ready(pool, "prefill") == ["prefill-0", "prefill-1"]


def test_a_leg_ends_when_it_fails():
    engine = EnginePool()
    engine.set_endpoints("prefill", endpoints("prefill", 1))
    state = engine.engine("prefill-0")

    with pytest.raises(RuntimeError), state:
        raise RuntimeError("engine failed")
    assert state.in_flight == 0


async def test_a_leg_ends_when_it_is_cancelled(pool):
    engine = pool.engine("prefill-0")
    started = asyncio.Event()

    async def leg() -> None:
        with engine:
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(leg())
    await started.wait()
    assert engine.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.in_flight == 0


def test_watchers_hear_of_every_change_to_the_ready_engines_until_they_stop_watching(pool):
    seen: list[tuple[int, int]] = []

    def watcher() -> None:
        seen.append((len(pool.ready("prefill")), len(pool.ready("decode"))))

    pool.watch(watcher)
    pool.drain("decode-0")
    pool.add("decode", Endpoint("decode-0", "http://127.0.0.1:8100"))
    pool.set_healthy(pool.engine("prefill-1"), False)
    pool.remove("decode-1")
    pool.set_endpoints("prefill", endpoints("prefill", 3))
    pool.unwatch(watcher)
    pool.drain("decode-0")

    assert seen == [(2, 1), (2, 2), (1, 2), (1, 1), (2, 1)]  # prefill-1 stays ejected: 2 of 3 ready
