"""One engine's lifecycle under the controller: its actor created, vLLM started in it (each phase said as it
ends), watched while it runs, started again after Ray restarted it or after it failed, and stopped.

``EngineSupervisor`` is the controller's collaborator for this (``EngineStarts``, ``orchestrator.pools``). A running
engine is watched with one long call at a time (``EngineActor.watch``): it answers when the engine's state changes
or every ``WATCH_S``, and Ray fails it at once when the process dies, so no probe a second wakes an idle engine. An
engine that stops answering leaves the proxy's pool at once; when Ray brings its actor back ``idle``, vLLM starts in
it again and it rejoins the pool once ready. An engine whose restarts are exhausted, or whose start failed, waits
out its back-off (``engine_record.retry_delay``); the controller's monitor then grows its pool back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from orchestrator.autoscale.rules import MOVING
from orchestrator.engine_handles import EngineHandles
from orchestrator.engine_log import error_excerpt
from orchestrator.engine_record import EngineRecord, first_line, take_info, take_phases
from orchestrator.errors import EngineStartError
from orchestrator.pools import MONITOR_INTERVAL_S, PROBE_TIMEOUT_S, Events, Pools, Publisher, Tasks

WATCH_S = 30.0
"""A running engine's watch call (``EngineActor.watch``) answers within this long when nothing changes; one that
does not answer within ``PROBE_TIMEOUT_S`` more is stuck. Its death fails the call at once."""
WATCHED = ("ready", "restarting", MOVING)


class EngineSupervisor:
    def __init__(self, pools: Pools, handles: EngineHandles, proxy: Publisher, events: Events, tasks: Tasks) -> None:
        self.pools, self.handles, self.proxy, self.events, self.tasks = pools, handles, proxy, events, tasks
        self._watching: dict[str, asyncio.Task] = {}  # engine id -> its watch, while it runs

    def create_actor(self, engine_id: str) -> Any:
        record = self.pools.engines[engine_id]
        record.asked_at, record.phases = time.time(), []
        record.handle = self.handles.create_engine(self.pools.launches[engine_id], record.log_path)
        return record.handle

    def launch(self, engine_id: str) -> None:
        self.create_actor(engine_id)
        self.tasks.spawn(self.start(engine_id))

    async def start(self, engine_id: str) -> str:
        """Start vLLM in the engine's actor; once ready it joins the proxy's pool. Returns ``engine_id``."""
        record, launch = self.pools.engines[engine_id], self.pools.launches[engine_id]
        record.state, record.error = "starting", None
        where = f"cores {launch.cpu_bind}" if launch.cpu_bind else f"{launch.num_gpus:g} GPU(s)"
        self.events.add(f"{engine_id} loading ({where}, port {launch.port})")
        following = self.tasks.spawn(self._follow_start(record))
        await asyncio.sleep(0)  # its first call goes out before the start's, which holds the actor's main loop
        try:
            timeout = self.pools.spec.engine.startup_timeout_s
            info = await asyncio.wait_for(record.handle.start.remote(), timeout=timeout)
        except Exception as e:  # noqa: BLE001 - every failure becomes the engine's error
            if record.state == "starting":  # not scaled away while it started
                self.start_failed(record, self._start_failure(record, e))
            return engine_id
        finally:
            following.cancel()
        if record.state != "starting":
            return engine_id
        self._say_phases(record, take_phases(record, info))
        record.state, record.failures = "ready", 0
        take_info(record, info)
        self.events.add(f"{engine_id} ready in {record.load_s:.1f}s at {record.url}")
        await self.proxy.publish(record.role)
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
                self.events.add(f"{record.engine_id}: {phase['phase']} (+{phase['s']:.1f}s)")

    def start_failed(self, record: EngineRecord, error: str) -> None:
        delay = record.failed(error)
        again = f"; tried again in {delay:g}s while its pool is below its target" if self.pools.phase == "ready" else ""
        self.events.add(f"{record.engine_id} failed to start ({first_line(error)}){again}")

    def _start_failure(self, record: EngineRecord, error: BaseException) -> str:
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, EngineStartError):
            return cause.detail
        if isinstance(error, TimeoutError):
            return (
                f"did not become ready within {self.pools.spec.engine.startup_timeout_s:g}s "
                f"(engine.startup_timeout_s); its log: {record.log_path}"
            )
        log = Path(record.log_path)
        text = log.read_text(errors="replace") if log.is_file() else ""
        return error_excerpt(text, cause)

    async def start_again(self, record: EngineRecord) -> None:
        """Start a failed engine afresh on its replica: its old actor and placement group go first."""
        await self.release(record)
        if record.state != "pending" or record.stopping:  # retired meanwhile
            return
        record.error, record.url, record.pid = None, "", None
        try:
            self.create_actor(record.engine_id)
        except Exception as e:  # noqa: BLE001 - the engine's error, and tried again after its back-off
            self.start_failed(record, f"cannot create its actor: {cause_of(e)}")
            return
        await self.start(record.engine_id)

    async def release(self, record: EngineRecord) -> None:
        """Stop the engine's vLLM and its actor, and free its placement group."""
        await self.handles.release(record.handle, self.pools.launches[record.engine_id])

    async def stop(self, record: EngineRecord) -> None:
        await self.release(record)
        # Gone from the status and said so in one step: `pdserve scale` returns once the pool
        # has no draining engine, and prints the events it saw by then.
        self.pools.engines.pop(record.engine_id, None)
        self.events.add(f"{record.engine_id} stopped")
        await self.proxy.publish(record.role)

    # --- watching running engines -------------------------------------------------------------

    def watch_running(self) -> None:
        """A watch on every running engine that has none (the monitor calls this once a second)."""
        for record in list(self.pools.engines.values()):
            watch = self._watching.get(record.engine_id)
            if record.state in WATCHED and (watch is None or watch.done()):
                self._watching[record.engine_id] = self.tasks.spawn(self._watch(record))

    async def _watch(self, record: EngineRecord) -> None:
        """Watch a running engine until it leaves ``WATCHED`` states (``watch_running`` watches it again once
        it runs)."""
        while record.state in WATCHED and self.pools.holds(record):
            await self._check(record)

    async def _check(self, record: EngineRecord) -> None:
        seen = record.state
        engine_state = "ready" if seen == MOVING else seen  # a moving engine serves as before
        try:
            info = await asyncio.wait_for(
                record.handle.watch.remote(engine_state, WATCH_S), timeout=WATCH_S + PROBE_TIMEOUT_S
            )
        except (RayActorError, TimeoutError) as e:
            await self._lost(record, seen, e)
            return
        if record.state != seen or not self.pools.holds(record):
            return  # changed here meanwhile (a scale, a stop): the monitor decides again
        if info["state"] == "ready" and record.state == "restarting":  # it was only slow to answer
            record.state = "ready"
            take_info(record, info)
            self.events.add(f"{record.engine_id} answers again; back in the pool")
            await self.proxy.publish(record.role)
            return
        if info["state"] == "idle":  # Ray restarted the actor: start vLLM in it again
            # Ray may bring the actor back before a probe ever failed: the old
            # engine's URL must leave the pool before the slow start begins.
            was_ready = record.state == "ready"
            record.state = "starting"  # not probed again until it is ready; the other engines still are
            record.restarts += 1
            record.asked_at, record.phases = time.time(), []
            if was_ready:
                await self.proxy.publish(record.role)
            self.events.add(f"{record.engine_id} restarted by Ray (restart {record.restarts}); starting vLLM")
            self.tasks.spawn(self.start(record.engine_id))

    async def _lost(self, record: EngineRecord, seen: str, error: BaseException) -> None:
        """The watch call failed: out of the proxy's pool; gone for good when Ray will not restart it."""
        if record.state not in WATCHED or not self.pools.holds(record):
            return  # retired or stopped meanwhile: its calls fail, which is no news
        if record.state in ("ready", MOVING):
            was_moving_from, record.state, record.moving_from = record.moving_from, "restarting", None
            moving = f" (its move from {was_moving_from} is called off)" if was_moving_from else ""
            self.events.add(f"{record.engine_id} stopped answering ({type(error).__name__}); out of the pool{moving}")
            if was_moving_from:
                await self.proxy.publish(was_moving_from)
            await self.proxy.publish(record.role)
        if isinstance(error, ActorDiedError):  # restarts exhausted: dead for good
            delay = record.failed(f"actor died for good: {error}")
            self.events.add(f"{record.engine_id} is gone: Ray will not restart it again; a new one in {delay:g}s")
        elif seen == "restarting":
            await asyncio.sleep(MONITOR_INTERVAL_S)  # Ray is restarting it: ask again in a while


def cause_of(error: BaseException) -> str:
    """A Ray call's failure in one line: the remote exception's, not Ray's wrapper."""
    cause = error.cause if isinstance(error, RayTaskError) else error
    return f"{type(cause).__name__}: {cause}"
