"""The cluster controller: a detached Ray actor that owns one pdserve cluster.

``pdserve up`` creates it and calls ``start()``; from then on it

1. starts the proxy actor, then every engine actor at once, recording each
   step as an event (``pdserve up`` prints them as progress);
2. adds an engine to the proxy's pool when it is ready;
3. watches every engine once a second: an engine that stops answering is
   taken out of the pool at once; Ray restarts its actor (``max_restarts``),
   the controller sees it come back ``idle``, starts vLLM in it again and
   puts it back in the pool; an engine that failed (a start, or Ray's restarts
   exhausted) starts again with a fresh actor after a back-off while its pool
   is below its target (``engine_record.retry_delay``);
4. on ``shutdown()`` stops the engines (vLLM shuts its engine core down),
   the proxy, and kills every actor it created.

``status()`` is what ``pdserve status`` shows. The CLI reaches all of this over
the controller's HTTP API (``orchestrator.control``), not through Ray.

The controller survives its own death. The engines and the proxy are
detached actors (they do not share the controller's fate), the controller
keeps a snapshot of what it decided (``controller.json`` in the log
directory: phase, targets, each engine's state and restarts, events), and Ray
restarts it (``max_restarts=-1``): the new process reads the snapshot, finds
the running actors by name, asks each how it is, takes its API port back and
carries on (``resume``), without restarting an engine. A request in flight
never passes through the controller, so none fails on its account.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from contract.auth import ClusterSecret, new_secret
from contract.wire import ROLES, http_url
from orchestrator.autoscale.actuator import Autoscaler
from orchestrator.autoscale.profile import PerformanceProfile
from orchestrator.autoscale.rules import (
    MOVING,
)
from orchestrator.control import cluster_status
from orchestrator.control_server import ControlServer
from orchestrator.engine_actor import error_excerpt
from orchestrator.engine_handles import EngineHandles
from orchestrator.engine_record import (
    EngineRecord,
    first_line,
    take_info,
    take_phases,
)
from orchestrator.errors import EngineStartError
from orchestrator.event_log import EventLog
from orchestrator.launch import EngineLaunch, plan_engines
from orchestrator.logs import redirect_output
from orchestrator.pool_scaling import MONITOR_INTERVAL_S, PROBE_TIMEOUT_S, PoolScaling
from orchestrator.spec import ClusterSpec

logger = logging.getLogger(__name__)

WATCH_S = 30.0
"""A running engine's watch call (``EngineActor.watch``) answers within this long when nothing changes; one that
does not answer within ``PROBE_TIMEOUT_S`` more is stuck. Its death fails the call at once."""
WATCHED = ("ready", "restarting", MOVING)
MOVES_KEPT = 20


class ClusterController(PoolScaling):
    def __init__(
        self,
        spec_data: dict[str, Any],
        log_dir: str,
        host: str | None,
        profile_data: dict[str, Any] | None = None,
        api_token_sha256: str = "",
        api_host: str | None = None,
        secret: ClusterSecret | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        redirect_output(self.log_dir / "controller.log")
        self.spec = ClusterSpec.model_validate(spec_data)
        self.host = host
        self.handles = EngineHandles(self.spec, secret or new_secret(), self.log_dir)
        # Every engine the pools may grow to; the first `replicas` of each start with the cluster.
        self.launches: dict[str, EngineLaunch] = {e.engine_id: e for e in plan_engines(self.spec, host)}
        self.targets = {role: self.spec.pool(role).replicas for role in ROLES}
        self.engines: dict[str, EngineRecord] = {}
        for role in ROLES:
            for launch in self._launches(role)[: self.targets[role]]:
                self.engines[launch.engine_id] = self._record(launch)
        self.phase = "created"  # created | starting | ready | failed | stopping | stopped
        self.error: str | None = None
        self.log = EventLog(self.log_dir, self._snapshot)
        self.started_at = time.time()
        self.ready_s: float | None = None
        self.proxy: Any = None
        self.proxy_url = http_url(self.spec.proxy.host, self.spec.proxy.port)
        self._tasks: set[asyncio.Task] = set()
        self._retiring: dict[str, asyncio.Task] = {}  # engine id -> its _retire, while it may be taken back
        self._watching: dict[str, asyncio.Task] = {}  # engine id -> its _watch, while it runs
        self.moves: collections.deque[dict[str, Any]] = collections.deque(maxlen=MOVES_KEPT)  # the last moves
        self.autoscaler: Autoscaler | None = None
        if self.spec.autoscaling is not None and profile_data is not None:
            self.autoscaler = Autoscaler(
                self.spec.autoscaling,
                PerformanceProfile.from_dict(profile_data),
                self.proxy_url,
                lambda: [(r.engine_id, r.role, r.state, r.url) for r in self.engines.values()],
                functools.partial(self.scale, keep_warm_s=self.spec.autoscaling.keep_warm_s, move=True),
                moves=self.spec.move_problem() is None,
            )
        self.restarts = 0  # Ray restarts of this controller
        # The API listens where the CLI reaches it: loopback on a local cluster, else this node's address.
        api_host = api_host or host or ray.util.get_node_ip_address()
        self.api = ControlServer(self, api_token_sha256, api_host, after_shutdown=self._exit)
        snapshot = self.log.read()
        self._resumed = False
        if snapshot is not None:  # Ray restarted this controller: take the cluster back (``resume``)
            self._restore(snapshot)
            threading.Thread(target=self._call_resume, name="pdserve-resume", daemon=True).start()

    # --- public API (called by the CLI) ---------------------------------------------------

    async def start(self) -> str:
        """Serve the API and bring the cluster up (in the background); return the API's URL."""
        url = await self.api.start()
        if self.phase == "created":
            self.phase = "starting"
            self.log.save()
            self._spawn(self._bring_up())
        return url

    async def status(self) -> dict[str, Any]:
        return cluster_status(self, await asyncio.to_thread(self.handles.nodes))

    async def shutdown(self) -> None:
        self.phase = "stopping"
        for task in list(self._tasks):
            task.cancel()
        handles = [r.handle for r in self.engines.values() if r.handle is not None]
        await self.handles.stop_all([*handles, *([self.proxy] if self.proxy is not None else [])])
        for record in self.engines.values():
            self.handles.remove_placement_group(self.launches[record.engine_id])
            record.state, record.handle = "stopped", None
        self.phase = "stopped"
        self._event("cluster stopped")

    async def _exit(self) -> None:
        """After ``shutdown``: leave for good (an intentional exit, which Ray does not restart)."""
        self.log.write()
        await self.api.stop()
        ray.get_runtime_context().current_actor.exit.remote()

    async def exit(self) -> None:
        ray.actor.exit_actor()

    # --- taking the cluster back after a restart of this controller --------------------------

    def _call_resume(self) -> None:
        """Ask this actor to ``resume`` once Ray has it ALIVE (a call made during the constructor fails with
        "the actor is restarting"); try again until it runs."""
        handle = ray.get_runtime_context().current_actor
        for attempt in range(120):
            try:
                ray.get(handle.resume.remote(), timeout=120)
                return
            except Exception as e:  # noqa: BLE001 - not alive yet: wait and ask again
                logger.info("resume after restart, attempt %d: %s", attempt + 1, type(e).__name__)
                time.sleep(1)

    async def resume(self) -> None:
        """Serve the API again and adopt the running proxy and engines; nothing that runs is restarted."""
        if self._resumed:
            return
        self._resumed = True
        await self.api.start()
        if self.phase in ("stopping", "stopped", "failed", "created"):
            return
        try:
            self.proxy = self.handles.find("proxy")
        except ValueError:
            self._fail("the proxy actor is gone (found after a restart of the controller)")
            return
        with contextlib.suppress(Exception):  # where clients reach it (its node's address if it listens everywhere)
            self.proxy_url = (await asyncio.wait_for(self.proxy.info.remote(), timeout=PROBE_TIMEOUT_S))["url"]
        for record in list(self.engines.values()):
            await self._adopt(record)
        for role in ROLES:
            await self._publish(role)
        self._event(
            f"controller restarted by Ray (restart {self.restarts}); adopted "
            + ", ".join(f"{r.engine_id} ({r.state})" for r in self.engines.values())
        )
        if self.phase == "starting":
            self._spawn(self._finish_bring_up(list(self.engines)))
        else:
            self._start_supervision()

    async def _adopt(self, record: EngineRecord) -> None:
        try:
            record.handle = self.handles.find(record.engine_id)
            info = await asyncio.wait_for(record.handle.info.remote(), timeout=PROBE_TIMEOUT_S)
        except (ValueError, RayActorError, TimeoutError) as e:
            if record.state == MOVING:  # called off: it serves again where the monitor finds it
                record.state, record.moving_from = "ready", None
            if record.handle is None:  # never created, or gone for good: start it (again)
                record.handle = self._create_engine_actor(record.engine_id)
                self._start_adopted(record)
            else:  # alive but not answering: the monitor treats it as any engine that stops answering
                record.state = "restarting"
                logger.warning("adopting %s: %s", record.engine_id, e)
            return
        if info["state"] == "ready":
            take_info(record, info)
            if record.state == "draining":
                self._spawn_retire(record, drain=True)
            elif record.state == MOVING:  # its move goes on: done once its old work is
                self._spawn(self._move(record, time.monotonic()))
            else:
                record.state = "ready"
        elif info["state"] == "failed":
            record.moving_from = None
            record.failed(info["error"])
        elif record.state != "draining":  # idle (Ray restarted it meanwhile) or still starting: start / wait
            record.moving_from = None
            self._start_adopted(record)
        else:
            self._spawn_retire(record, drain=False)

    def _start_adopted(self, record: EngineRecord) -> None:
        """Start (or wait for) an adopted engine; during bring-up ``_finish_bring_up`` starts every engine."""
        if self.phase != "starting":
            self._spawn(self._start_engine(record.engine_id))

    # --- bring-up ---------------------------------------------------------------------------

    async def _bring_up(self) -> None:
        try:
            await self._start_proxy()
        except Exception as e:  # noqa: BLE001 - reported to the user as the cluster's error
            self._fail(f"proxy failed to start: {_cause(e)}")
            return
        try:
            for engine_id, record in self.engines.items():
                record.handle = self._create_engine_actor(engine_id)
        except Exception as e:  # noqa: BLE001 - reported to the user, not a bring-up that never ends
            self._fail(f"cannot create the engine actors: {_cause(e)}")
            return
        await self._finish_bring_up(list(self.engines))

    async def _finish_bring_up(self, engine_ids: list[str]) -> None:
        # Report the first engine that fails at once, rather than after the others loaded.
        for started in asyncio.as_completed([self._start_engine(engine_id) for engine_id in engine_ids]):
            record = self.engines[await started]
            if record.state == "failed":
                self._fail(f"engine {record.engine_id} failed to start:\n{record.error}")
                return
        self.ready_s = time.time() - self.started_at
        self.phase = "ready"
        self._event(f"cluster ready in {self.ready_s:.1f}s: {self.proxy_url}")
        self._start_supervision()

    def _start_supervision(self) -> None:
        self._spawn(self._monitor())
        if self.autoscaler is not None:
            config = self.autoscaler.config
            self._event(
                f"autoscaler on: a decision every {config.interval_s:g}s "
                f"(p90 TTFT <= {config.targets.ttft_p90_s:g}s, p90 ITL <= {config.targets.itl_p90_s:g}s)"
            )
            self._spawn(self.autoscaler.run())
        elif self.spec.autoscaling is not None:
            self._event(
                "autoscaler off: autoscaling.profile is not set (`pdserve profile` measures one); "
                "`pdserve scale` sizes the pools within the autoscaling bounds"
            )

    async def _start_proxy(self) -> None:
        self.proxy = self.handles.create_proxy()
        self._event(f"proxy starting on {self.proxy_url}")
        self.proxy_url = (await self.proxy.start.remote())["url"]
        self._event("proxy ready")

    def _create_engine_actor(self, engine_id: str) -> Any:
        record = self.engines[engine_id]
        record.asked_at, record.phases = time.time(), []
        return self.handles.create_engine(self.launches[engine_id], record.log_path)

    async def _start_engine(self, engine_id: str) -> str:
        record, launch = self.engines[engine_id], self.launches[engine_id]
        record.state, record.error = "starting", None
        where = f"cores {launch.cpu_bind}" if launch.cpu_bind else f"{launch.num_gpus:g} GPU(s)"
        self._event(f"{engine_id} loading ({where}, port {launch.port})")
        following = self._spawn(self._follow_start(record))
        await asyncio.sleep(0)  # its first call goes out before the start's, which holds the actor's main loop
        try:
            info = await asyncio.wait_for(record.handle.start.remote(), timeout=self.spec.engine.startup_timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure becomes the engine's error
            if record.state != "starting":  # scaled away while it started
                return engine_id
            self._start_failed(record, self._start_failure(record, e))
            return engine_id
        finally:
            following.cancel()
        if record.state != "starting":
            return engine_id
        self._say_phases(record, take_phases(record, info))
        record.state, record.failures = "ready", 0
        take_info(record, info)
        self._event(f"{engine_id} ready in {record.load_s:.1f}s at {record.url}")
        await self._publish(record.role)
        return engine_id

    async def _follow_start(self, record: EngineRecord) -> None:
        """Say each phase of an engine's start as it ends (``EngineActor.progress``: one call per phase)."""
        handle = record.handle
        with contextlib.suppress(RayActorError, TimeoutError):
            while record.state == "starting" and record.handle is handle:
                info = await asyncio.wait_for(
                    handle.progress.remote(len(record.phases), WATCH_S), timeout=WATCH_S + PROBE_TIMEOUT_S
                )
                self._say_phases(record, take_phases(record, info))
                if info["state"] != "starting":
                    return

    def _say_phases(self, record: EngineRecord, phases: list[dict[str, Any]]) -> None:
        for phase in phases:
            if phase["phase"] != "ready":  # said with the load time once the start returns
                self._event(f"{record.engine_id}: {phase['phase']} (+{phase['s']:.1f}s)")

    def _start_failed(self, record: EngineRecord, error: str) -> None:
        delay = record.failed(error)
        again = f"; tried again in {delay:g}s while its pool is below its target" if self.phase == "ready" else ""
        self._event(f"{record.engine_id} failed to start ({first_line(error)}){again}")

    def _start_failure(self, record: EngineRecord, error: BaseException) -> str:
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, EngineStartError):
            return cause.detail
        if isinstance(error, TimeoutError):
            return (
                f"did not become ready within {self.spec.engine.startup_timeout_s:g}s "
                f"(engine.startup_timeout_s); its log: {record.log_path}"
            )
        log = Path(record.log_path)
        text = log.read_text(errors="replace") if log.is_file() else ""
        return error_excerpt(text, cause)

    async def _publish(self, role: str) -> None:
        """Tell the proxy the role's engines: the ready ones, and those draining (no new requests)."""
        records = [
            r
            for r in self.engines.values()
            if r.url and ((r.role == role and r.state in ("ready", "draining")) or r.moving_from == role)
        ]
        draining = [r.engine_id for r in records if r.state == "draining" or r.moving_from == role]
        endpoints = [(r.engine_id, r.url, self._kv_endpoints(r.engine_id)) for r in records]
        await self.proxy.set_endpoints.remote(role, endpoints, draining, self.targets[role])

    def _kv_endpoints(self, engine_id: str) -> tuple[str, ...]:
        """The ``pdserve`` connector's side channel of an engine, one endpoint per TP rank (the proxy asks
        a decode engine there how a stream's KV got to it); none for vLLM's connector."""
        if self.spec.connector != "pdserve":
            return ()
        return self.engines[engine_id].kv_endpoints

    async def _start_again(self, record: EngineRecord) -> None:
        """Start a failed engine afresh on its replica: its old actor and placement group go first."""
        await self._release(record)
        if record.state != "pending" or record.stopping:  # retired meanwhile
            return
        record.error, record.url, record.pid = None, "", None
        try:
            record.handle = self._create_engine_actor(record.engine_id)
        except Exception as e:  # noqa: BLE001 - the engine's error, and tried again after its back-off
            self._start_failed(record, f"cannot create its actor: {_cause(e)}")
            return
        await self._start_engine(record.engine_id)

    async def _release(self, record: EngineRecord) -> None:
        """Stop the engine's vLLM and its actor, and free its placement group."""
        await self.handles.release(record.handle, self.launches[record.engine_id])

    async def _stop_engine(self, record: EngineRecord) -> None:
        await self._release(record)
        # Gone from the status and said so in one step: `pdserve scale` returns once the pool
        # has no draining engine, and prints the events it saw by then.
        self.engines.pop(record.engine_id, None)
        self._event(f"{record.engine_id} stopped")
        await self._publish(record.role)

    # --- supervision ------------------------------------------------------------------------

    async def _monitor(self) -> None:
        """Once a second: the proxy, a watch on every running engine (``_watch``), failed engines' back-off."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            await self._check_proxy()
            for record in list(self.engines.values()):  # a scale may add or remove one while a check awaits
                watch = self._watching.get(record.engine_id)
                if record.state in WATCHED and (watch is None or watch.done()):
                    self._watching[record.engine_id] = self._spawn(self._watch(record))
            # Failed engines whose back-off ended: their pools grow back to the targets.
            now = time.monotonic()
            for role in ROLES if self.phase == "ready" else ():
                if any(r.role == role and r.state == "failed" and now >= r.retry_at for r in self.engines.values()):
                    await self._resize(role, "a failed engine's back-off ended")

    async def _watch(self, record: EngineRecord) -> None:
        """Watch a running engine until it leaves ``WATCHED`` states (the monitor then watches it again once
        it runs). The engine answers when its state changes or every ``WATCH_S``; Ray fails the call when the
        process dies: no probe a second wakes the idle engine."""
        while record.state in WATCHED and self.engines.get(record.engine_id) is record:
            await self._check_engine(record)

    async def _check_engine(self, record: EngineRecord) -> None:
        seen = record.state
        engine_state = "ready" if seen == MOVING else seen  # a moving engine serves as before
        try:
            info = await asyncio.wait_for(
                record.handle.watch.remote(engine_state, WATCH_S), timeout=WATCH_S + PROBE_TIMEOUT_S
            )
        except (RayActorError, TimeoutError) as e:
            if record.state not in WATCHED or self.engines.get(record.engine_id) is not record:
                return  # retired or stopped meanwhile: its calls fail, which is no news
            if record.state in ("ready", MOVING):
                was_moving_from, record.state, record.moving_from = record.moving_from, "restarting", None
                moving = f" (its move from {was_moving_from} is called off)" if was_moving_from else ""
                self._event(f"{record.engine_id} stopped answering ({type(e).__name__}); out of the pool{moving}")
                if was_moving_from:
                    await self._publish(was_moving_from)
                await self._publish(record.role)
            if isinstance(e, ActorDiedError):  # restarts exhausted: dead for good
                delay = record.failed(f"actor died for good: {e}")
                self._event(f"{record.engine_id} is gone: Ray will not restart it again; a new one in {delay:g}s")
            elif seen == "restarting":
                await asyncio.sleep(MONITOR_INTERVAL_S)  # Ray is restarting it: ask again in a while
            return
        if record.state != seen or self.engines.get(record.engine_id) is not record:
            return  # changed here meanwhile (a scale, a stop): the monitor decides again
        if info["state"] == "ready" and record.state == "restarting":  # it was only slow to answer
            record.state = "ready"
            take_info(record, info)
            self._event(f"{record.engine_id} answers again; back in the pool")
            await self._publish(record.role)
            return
        if info["state"] == "idle":  # Ray restarted the actor: start vLLM in it again
            # Ray may bring the actor back before a probe ever failed: the old
            # engine's URL must leave the pool before the slow start begins.
            was_ready = record.state == "ready"
            record.state = "starting"  # not probed again until it is ready; the other engines still are
            record.restarts += 1
            record.asked_at, record.phases = time.time(), []
            if was_ready:
                await self._publish(record.role)
            self._event(f"{record.engine_id} restarted by Ray (restart {record.restarts}); starting vLLM")
            self._spawn(self._start_engine(record.engine_id))

    async def _check_proxy(self) -> None:
        try:
            info = await asyncio.wait_for(self.proxy.info.remote(), timeout=PROBE_TIMEOUT_S)
        except (RayActorError, TimeoutError):
            return
        if info["state"] == "idle":
            self._event("proxy restarted by Ray; serving again")
            await self.proxy.start.remote()
            for role in ROLES:
                await self._publish(role)

    # --- helpers ----------------------------------------------------------------------------

    def _launches(self, role: str) -> list[EngineLaunch]:
        return [launch for launch in self.launches.values() if launch.role == role]

    def _record(self, launch: EngineLaunch, role: str | None = None) -> EngineRecord:
        """A new record of ``launch``'s engine, serving ``role`` (default: the pool it was planned for)."""
        log_path = str(self.log_dir / f"{launch.engine_id}.log")
        return EngineRecord(launch.engine_id, role or launch.role, log_path=log_path)

    def _event(self, message: str) -> None:
        self.log.add(message)

    def _snapshot(self) -> dict[str, Any]:
        """What a restarted controller needs (``_restore``; ``EventLog`` writes it with the events)."""
        return {
            "phase": self.phase,
            "error": self.error,
            "started_at": self.started_at,
            "ready_s": self.ready_s,
            "targets": dict(self.targets),
            "api_port": self.api.port,
            "restarts": self.restarts,
            "engines": {
                r.engine_id: {"state": r.state, "restarts": r.restarts, "role": r.role, "moving_from": r.moving_from}
                for r in self.engines.values()
            },
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        self.phase, self.error = snapshot["phase"], snapshot["error"]
        self.started_at, self.ready_s = snapshot["started_at"], snapshot["ready_s"]
        self.targets = snapshot["targets"]
        self.restarts = snapshot["restarts"] + 1
        self.api.port = snapshot["api_port"]
        self.engines = {}
        for engine_id, saved in snapshot["engines"].items():
            record = self.engines[engine_id] = self._record(self.launches[engine_id], saved.get("role"))
            record.state, record.restarts = saved["state"], saved["restarts"]
            record.moving_from = saved.get("moving_from")

    def _fail(self, error: str) -> None:
        self.phase, self.error = "failed", error
        self._event("cluster failed to start" if self.ready_s is None else f"cluster failed: {error}")

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _cause(error: BaseException) -> str:
    cause = error.cause if isinstance(error, RayTaskError) else error
    return f"{type(cause).__name__}: {cause}"
