"""The controller's parts that act for it: the event log and its snapshot, the pure resize plan, the status
document (with what it reads of stub engines' /metrics). Without Ray; the controller's coordination runs for
real in tests/integration (test_lifecycle, test_scale, test_control)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from orchestrator import event_log
from orchestrator.autoscale.rules import resize_plan
from orchestrator.control import cluster_status
from orchestrator.engine_metrics import QUARANTINED_BLOCKS, SampleReader
from orchestrator.engine_record import EngineRecord, replica
from orchestrator.event_log import SNAPSHOT_NAME, EventLog
from orchestrator.placement import HEAD_RESOURCE, Node
from orchestrator.pools import Pools
from orchestrator.spec import ClusterSpec
from tests.status_schema import schema_problems
from tests.unit.conftest import spec_dict
from tests.unit.proxy_requests import wait_until


def snapshot(path: Path) -> dict:
    return json.loads((path / SNAPSHOT_NAME).read_text())


async def test_a_change_of_state_is_written_at_once_and_events_alone_together(tmp_path, monkeypatch):
    monkeypatch.setattr(event_log, "EVENT_FLUSH_S", 0.05)
    state = {"phase": "starting"}
    log = EventLog(tmp_path, lambda: dict(state))

    log.add("proxy starting")  # the first write: no state was written yet
    for n in range(20):
        log.add(f"engine {n} loading")
    assert log.writes == 1 and len(snapshot(tmp_path)["events"]) == 1

    await wait_until(lambda: log.writes == 2, 10)
    assert len(snapshot(tmp_path)["events"]) == 21  # twenty events, one write

    state["phase"] = "ready"
    log.add("cluster ready")
    assert log.writes == 3 and snapshot(tmp_path)["phase"] == "ready"  # a restart must see it: at once
    await asyncio.sleep(0.2)
    assert log.writes == 3  # nothing left to write


def test_a_restarted_controller_reads_the_state_and_the_events_back(tmp_path):
    EventLog(tmp_path, lambda: {"phase": "ready", "targets": {"prefill": 2}}).add("cluster ready")

    log = EventLog(tmp_path, dict)
    assert log.read() == {"phase": "ready", "targets": {"prefill": 2}}
    assert [e["message"] for e in log.events] == ["cluster ready"]
    assert EventLog(tmp_path / "none", dict).read() is None


def pool(*states: str) -> list[EngineRecord]:
    return [EngineRecord(f"prefill-{i}", "prefill", state=state) for i, state in enumerate(states)]


def plan(engines, target, now=0.0, retry_now=False):
    return resize_plan(engines, target, now, retry_now, lambda r: replica(r.engine_id))


def test_growing_takes_draining_engines_back_before_starting_new_ones():
    engines = pool("ready", "draining", "draining")
    grown = plan(engines, 4)
    assert [r.engine_id for r in grown.take_back] == ["prefill-1", "prefill-2"] and grown.start == 1
    assert grown.retire == [] and grown.serving == 1


def test_shrinking_retires_the_newest_and_those_not_serving_yet_first():
    engines = pool("ready", "starting", "ready", "ready")
    shrunk = plan(engines, 2)
    assert [r.engine_id for r in shrunk.retire] == ["prefill-1", "prefill-3"] and shrunk.start == 0


def test_a_failed_engine_holds_its_place_until_its_back_off_ends():
    engines = pool("ready", "failed", "failed")
    for record in engines[1:]:
        record.retry_at = 10.0
    waiting = plan(engines, 2, now=5.0)
    assert (waiting.start_again, waiting.waiting, waiting.start) == ([], 1, 0)
    assert [r.engine_id for r in waiting.stop_failed] == ["prefill-2"]  # the pool does not need it
    assert [r.engine_id for r in plan(engines, 2, now=11.0).start_again] == ["prefill-1"]
    assert [r.engine_id for r in plan(engines, 2, now=5.0, retry_now=True).start_again] == ["prefill-1"]


def test_the_status_document_is_the_documented_schema():
    spec = ClusterSpec.model_validate(spec_dict())
    engines = {r.engine_id: r for r in pool("ready", "draining")}
    engines["prefill-0"].host = "10.0.0.1"
    pools = Pools(spec, {}, Path("/tmp/logs"), {"prefill": 2, "decode": 1}, engines, phase="ready")
    group = SimpleNamespace(name=spec.model_name, pools=pools, autoscaler=None)
    controller = SimpleNamespace(
        spec=spec, groups={spec.model_name: group}, records=lambda: list(engines.values()), phase="ready",
        log_dir=Path("/tmp/logs"), error=None, proxy=SimpleNamespace(url="http://127.0.0.1:8000"), started_at=1.0,
        ready_s=2.0, restarts=0, api=SimpleNamespace(url="http://127.0.0.1:9"), log=SimpleNamespace(events=[]),
    )  # fmt: skip
    nodes = [
        Node("a", "10.0.0.1", {"ray.io/node-id": "a", "pool": "p"}, {HEAD_RESOURCE: 1.0}, alive=False),
        Node("b", "10.0.0.1", {"pool": "p"}, {}),  # the same host, back as a new node
    ]

    status = cluster_status(controller, nodes)

    assert schema_problems(json.loads(json.dumps(status))) == []  # as the client reads it
    assert status["hosts"] == [
        {"ip": "10.0.0.1", "alive": True, "head": False, "labels": {"pool": "p"}, "engines": ["prefill-0"]}
    ]
    assert status["pools"]["prefill"] == {
        "target": 2,
        "max": spec.max_replicas("prefill"),
        "ready": 1,
        "moving": 0,
        "draining": 1,
    }
    assert cluster_status(controller, None)["hosts"] == []  # the GCS did not answer


async def test_status_shows_each_running_engines_quarantined_kv_blocks_and_null_for_one_that_does_not_answer(
    make_engine,
):
    from orchestrator.controller import ClusterController

    def page(blocks: int) -> Callable[[], str]:
        return lambda: f'# TYPE {QUARANTINED_BLOCKS} counter\n{QUARANTINED_BLOCKS}{{engine="0"}} {blocks}.0\n'

    quarantining = await make_engine("decode-0", extra_metrics=page(12))
    stuck = await make_engine("decode-1", extra_metrics=page(3), metrics_delay_s=60)
    spec = ClusterSpec.model_validate(spec_dict())
    records = [
        EngineRecord("decode-0", "decode", state="ready", url=quarantining.url),
        EngineRecord("decode-1", "decode", state="draining", url=stuck.url),
        EngineRecord("prefill-0", "prefill", state="ready", url="http://127.0.0.1:1"),  # nothing listens
        EngineRecord("prefill-1", "prefill", state="restarting", url=quarantining.url),  # not read: not running
    ]
    pools = Pools(spec, {}, Path("/tmp/logs"), {"prefill": 2, "decode": 2}, {r.engine_id: r for r in records})
    controller = ClusterController.__new__(ClusterController)
    controller.spec, controller._phase, controller.error, controller.restarts = spec, "ready", None, 0
    controller.groups = {spec.model_name: SimpleNamespace(pools=pools, autoscaler=None)}
    controller.log_dir, controller.log = Path("/tmp/logs"), SimpleNamespace(events=[])
    controller.proxy, controller.api = SimpleNamespace(url="http://127.0.0.1:8000"), SimpleNamespace(url="")
    controller.started_at, controller.ready_s = 1.0, 2.0
    controller.handles = SimpleNamespace(nodes=lambda: [])
    controller.quarantined_blocks = SampleReader(QUARANTINED_BLOCKS, timeout_s=0.5)  # the cluster's: 2 s

    started = time.monotonic()
    status = await controller.status()

    assert time.monotonic() - started < 2.0  # the stuck engine is not waited for
    assert schema_problems(json.loads(json.dumps(status))) == []
    assert {e["engine_id"]: e["kv_quarantined_blocks"] for e in status["engines"]} == {
        "decode-0": 12,
        "decode-1": None,
        "prefill-0": None,
        "prefill-1": None,
    }


async def test_an_engines_watch_answers_when_its_state_changes_or_after_the_timeout(monkeypatch):
    from orchestrator import engine_actor

    monkeypatch.setattr(engine_actor, "WATCH_STEP_S", 0.01)
    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)
    actor.state = "ready"
    actor.info = lambda: _info(actor)  # type: ignore[method-assign]

    started = asyncio.get_running_loop().time()
    assert (await actor.watch("ready", 0.1))["state"] == "ready"  # nothing changed: after the timeout
    assert asyncio.get_running_loop().time() - started >= 0.1

    watch = asyncio.create_task(actor.watch("ready", 60))
    await asyncio.sleep(0.05)
    actor.state = "idle"
    assert (await asyncio.wait_for(watch, 1))["state"] == "idle"  # at once, not after a minute


async def _info(actor) -> dict:
    return {"state": actor.state}


class _DeadActor:
    """An engine handle whose calls fail as Ray fails them when the actor's process died (once ``dies`` is set)."""

    def __init__(self, error: Exception) -> None:
        self.dies = asyncio.Event()
        self.dies.set()
        self.watch = SimpleNamespace(remote=lambda *_: self._fail(error))

    async def _fail(self, error: Exception) -> None:
        await self.dies.wait()
        raise error


async def test_a_watched_engine_that_dies_leaves_the_pool_and_a_retired_one_stays_retired():
    from ray.exceptions import RayActorError

    from orchestrator.supervision import EngineSupervisor
    from tests.unit.controller_factories import Events, Tasks, pools

    published: list[str] = []

    class Publisher:
        async def publish(self, role: str) -> None:
            published.append(role)

    c = EngineSupervisor(pools(), None, Publisher(), Events(), Tasks())  # type: ignore[arg-type]
    ready = c.pools.engines["prefill-0"] = EngineRecord("prefill-0", "prefill", state="ready")
    ready.handle = _DeadActor(RayActorError())
    await c._check(ready)
    assert ready.state == "restarting" and published == ["prefill"]
    assert c.events == ["prefill-0 stopped answering (RayActorError); out of the pool"]

    draining = c.pools.engines["prefill-1"] = EngineRecord("prefill-1", "prefill", state="ready")
    draining.handle = _DeadActor(RayActorError())
    draining.handle.dies.clear()
    call = asyncio.create_task(c._check(draining))
    await asyncio.sleep(0.01)  # the watch is under way
    draining.state = "draining"  # retired meanwhile: its actor is killed
    draining.handle.dies.set()
    await call
    assert draining.state == "draining" and published == ["prefill"]


async def test_a_start_notes_each_phase_as_vllms_log_says_it_ended(tmp_path, monkeypatch):
    import threading

    from orchestrator import engine_actor

    monkeypatch.setattr(engine_actor, "PHASE_READ_S", 0.01)
    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)
    actor.log_path = tmp_path / "prefill-0.log"
    actor.log_path.write_text("an earlier start's line: Loading weights took 9.1 seconds\n")
    actor.state, actor.phases, actor.placed_at, actor._phase_lock = "starting", [], 100.0, threading.Lock()
    actor._log_offset, actor._log_tail = actor.log_path.stat().st_size, b""
    actor.info = lambda: _phases(actor)  # type: ignore[method-assign]
    actor._phase("actor placed", actor.placed_at)

    waiting = asyncio.create_task(actor.progress(1, 60))
    await asyncio.sleep(0.05)
    with actor.log_path.open("a") as log:
        log.write("(EngineCore pid=1) INFO 11-27 18:10:24 [core.py:133] Initializing a V1 LLM engine (v0.32.0) ...\n")
        log.write("(Worker pid=2) INFO 11-27 18:10:36 [default_loader.py:501] Loading weights took 0.54 sec")
    info = await asyncio.wait_for(waiting, 1)  # at the new phase, not after a minute
    with actor.log_path.open("a") as log:
        log.write("onds\n(EngineCore pid=1) INFO 11-27 18:10:38 [kv_cache_utils.py:2327] CPU KV cache size: 23,296\n")
    actor._read_phases()

    assert info["phases"][-1]["phase"] == "engine core started"
    assert [p["phase"] for p in actor.phases] == [
        "actor placed", "engine core started", "weights loaded", "KV cache allocated",
    ]  # fmt: skip
    assert actor.phases[0]["t"] == 100.0
    assert actor.phases[2]["t"] - actor.phases[1]["t"] == 12.0  # when vLLM logged them, not when read


async def _phases(actor) -> dict:
    return {"state": actor.state, "phases": list(actor.phases)}


def test_phases_are_said_in_seconds_since_the_engine_was_asked_for():
    from orchestrator.engine_record import take_phases

    record = EngineRecord("prefill-0", "prefill", asked_at=1000.0)
    first = take_phases(record, {"phases": [{"phase": "actor placed", "t": 1001.24}]})
    more = take_phases(record, {"phases": [{"phase": "actor placed", "t": 1001.24}, {"phase": "ready", "t": 1060.0}]})
    assert first == [{"phase": "actor placed", "s": 1.2}] and more == [{"phase": "ready", "s": 60.0}]
    assert record.phases == first + more


def test_up_on_a_terminal_redraws_a_line_with_each_starting_engines_phase(capsys):
    from orchestrator.cli.cluster import EventPrinter

    status = {
        "engines": [
            {"engine_id": "prefill-0", "state": "starting", "phases": [{"phase": "weights loaded", "s": 12.0}]},
            {"engine_id": "decode-0", "state": "pending", "phases": []},
            {"engine_id": "decode-1", "state": "ready", "phases": []},
        ]
    }
    live = EventPrinter(live=True)
    live.status(status)
    live({"t": live.t0 + 1, "message": "prefill-0: KV cache allocated (+13.0s)"})
    out = capsys.readouterr().out
    assert "starting: prefill-0: weights loaded; decode-0: asked for" in out
    assert "\r\033[K[   1.0s] prefill-0: KV cache allocated (+13.0s)\n" in out  # the live line erased first

    plain = EventPrinter(live=False)
    plain.status(status)
    plain({"t": plain.t0, "message": "cluster ready"})
    assert capsys.readouterr().out == "[   0.0s] cluster ready\n"  # lines only


async def test_a_change_of_a_cluster_of_several_models_names_its_model():
    from orchestrator.controller import ClusterController

    asked = []

    def group(name: str, key: str) -> SimpleNamespace:
        async def scale(targets, reason):  # noqa: ANN001, ANN202
            asked.append((name, targets))
            return {"targets": targets}

        spec = SimpleNamespace(key=key)
        return SimpleNamespace(name=name, pools=SimpleNamespace(spec=spec), changes=SimpleNamespace(scale=scale))

    controller = ClusterController.__new__(ClusterController)
    model = spec_dict()["model"]
    controller.spec = ClusterSpec.model_validate(
        {
            "resources": {"cpus": 4},
            "models": [
                {"model": model, "served_model_name": "org/Demo-1", "key": "demo-1",
                 "prefill": {"port": 8100, "kv_port": 5600}, "decode": {"port": 8200, "kv_port": 5700}},
                {"model": model, "served_model_name": "tiny",
                 "prefill": {"port": 8110, "kv_port": 5610}, "decode": {"port": 8210, "kv_port": 5710}},
            ],
        }
    )  # fmt: skip
    controller.groups = {"org/Demo-1": group("org/Demo-1", "demo-1"), "tiny": group("tiny", "tiny")}

    assert await controller.scale({"decode": 2}) == {"error": "name the model (--model): one of org/Demo-1, tiny"}
    assert await controller.scale({"decode": 2}, model="big") == {"error": "no model 'big': org/Demo-1, tiny"}
    assert await controller.move("prefill", "decode", model=None) == {
        "error": "name the model (--model): one of org/Demo-1, tiny"
    }
    await controller.scale({"decode": 2}, model="demo-1")  # its key
    await controller.scale({"prefill": 1}, model="tiny")  # its served name
    assert asked == [("org/Demo-1", {"decode": 2}), ("tiny", {"prefill": 1})]
