"""The cluster controller: a detached Ray actor that owns one pdserve cluster.

``pdserve up`` creates it and calls ``start()``; from then on it

1. starts the proxy actor, then every engine actor at once, recording each
   step as an event (``pdserve up`` prints them as progress);
2. adds an engine to the proxy's pool when it is ready;
3. watches every engine once a second: an engine that stops answering is
   taken out of the pool at once; Ray restarts its actor (``max_restarts``),
   the controller sees it come back ``idle``, starts vLLM in it again and
   puts it back in the pool;
4. on ``shutdown()`` stops the engines (vLLM shuts its engine core down),
   the proxy, and kills every actor it created.

``status()`` is what ``pdserve status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from orchestrator.engine_actor import EngineActor, error_excerpt
from orchestrator.errors import EngineStartError
from orchestrator.launch import EngineLaunch, plan_engines
from orchestrator.logs import redirect_output
from orchestrator.proxy_actor import ProxyActor
from orchestrator.spec import ClusterSpec
from proxy.pool import ROLES

logger = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
ENGINE_MAX_RESTARTS = 5


@dataclass(slots=True)
class EngineRecord:
    engine_id: str
    role: str
    state: str = "pending"  # pending | starting | ready | restarting | failed | stopped
    url: str = ""
    pid: int | None = None
    cpu_bind: str | None = None
    load_s: float | None = None
    restarts: int = 0
    error: str | None = None
    log_path: str = ""
    handle: Any = field(default=None, repr=False)


class ClusterController:
    def __init__(self, spec_data: dict[str, Any], log_dir: str, host: str) -> None:
        self.log_dir = Path(log_dir)
        redirect_output(self.log_dir / "controller.log")
        self.spec = ClusterSpec.model_validate(spec_data)
        self.host = host
        self.launches: dict[str, EngineLaunch] = {e.engine_id: e for e in plan_engines(self.spec, host)}
        self.engines = {
            engine_id: EngineRecord(engine_id, launch.role, log_path=str(self.log_dir / f"{engine_id}.log"))
            for engine_id, launch in self.launches.items()
        }
        self.phase = "created"  # created | starting | ready | failed | stopping | stopped
        self.error: str | None = None
        self.events: list[dict[str, Any]] = []
        self.started_at = time.time()
        self.ready_s: float | None = None
        self.proxy: Any = None
        self.proxy_url = f"http://{self.spec.proxy.host}:{self.spec.proxy.port}"
        self._tasks: set[asyncio.Task] = set()

    # --- public API (called by the CLI) ---------------------------------------------------

    async def start(self) -> None:
        if self.phase != "created":
            return
        self.phase = "starting"
        self._spawn(self._bring_up())

    async def status(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "model": self.spec.model_name,
            "connector": self.spec.connector,
            "phase": self.phase,
            "error": self.error,
            "proxy_url": self.proxy_url,
            "started_at": self.started_at,
            "ready_s": self.ready_s,
            "log_dir": str(self.log_dir),
            "engines": [{k: v for k, v in asdict(r).items() if k != "handle"} for r in self.engines.values()],
            "events": self.events,
        }

    async def shutdown(self) -> None:
        self.phase = "stopping"
        for task in list(self._tasks):
            task.cancel()
        handles = [r.handle for r in self.engines.values() if r.handle is not None]
        if self.proxy is not None:
            handles.append(self.proxy)
        stops = [h.stop.remote() for h in handles]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), timeout=60)
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        for record in self.engines.values():
            record.state, record.handle = "stopped", None
        self.phase = "stopped"
        self._event("cluster stopped")

    # --- bring-up ---------------------------------------------------------------------------

    async def _bring_up(self) -> None:
        try:
            await self._start_proxy()
        except Exception as e:  # noqa: BLE001 - reported to the user as the cluster's error
            self._fail(f"proxy failed to start: {_cause(e)}")
            return
        for engine_id, launch in self.launches.items():
            self.engines[engine_id].handle = self._create_engine_actor(launch)
        # Report the first engine that fails at once, rather than after the others loaded.
        for started in asyncio.as_completed([self._start_engine(engine_id) for engine_id in self.engines]):
            record = self.engines[await started]
            if record.state == "failed":
                self._fail(f"engine {record.engine_id} failed to start:\n{record.error}")
                return
        self.ready_s = time.time() - self.started_at
        self.phase = "ready"
        self._event(f"cluster ready in {self.ready_s:.1f}s: {self.proxy_url}")
        self._spawn(self._monitor())

    async def _start_proxy(self) -> None:
        config = self.spec.proxy_config()
        self.proxy = (
            ray.remote(ProxyActor)
            .options(num_cpus=0, max_restarts=-1, max_task_retries=0, name=f"{self.spec.name}-proxy")
            .remote(config, self.spec.proxy.host, self.spec.proxy.port, str(self.log_dir / "proxy.log"))
        )
        self._event(f"proxy starting on {self.proxy_url}")
        await self.proxy.start.remote()
        self._event("proxy ready")

    def _create_engine_actor(self, launch: EngineLaunch) -> Any:
        return (
            ray.remote(EngineActor)
            .options(
                num_cpus=launch.num_cpus,
                num_gpus=launch.num_gpus,
                max_restarts=ENGINE_MAX_RESTARTS,
                max_task_retries=0,
                name=f"{self.spec.name}-{launch.engine_id}",
            )
            .remote(launch, self.engines[launch.engine_id].log_path)
        )

    async def _start_engine(self, engine_id: str) -> str:
        record, launch = self.engines[engine_id], self.launches[engine_id]
        record.state, record.error = "starting", None
        where = f"cores {launch.cpu_bind}" if launch.cpu_bind else f"{launch.num_gpus:g} GPU(s)"
        self._event(f"{engine_id} loading ({where}, port {launch.port})")
        try:
            info = await asyncio.wait_for(record.handle.start.remote(), timeout=self.spec.engine.startup_timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure becomes the engine's error
            record.state, record.error = "failed", self._start_failure(record, e)
            self._event(f"{engine_id} failed to start")
            return engine_id
        record.state = "ready"
        record.url, record.pid, record.cpu_bind = info["url"], info["pid"], info["cpu_bind"]
        record.load_s = info["load_s"]
        self._event(f"{engine_id} ready in {record.load_s:.1f}s at {record.url}")
        await self._publish(record.role)
        return engine_id

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
        endpoints = [(r.engine_id, r.url) for r in self.engines.values() if r.role == role and r.state == "ready"]
        await self.proxy.set_endpoints.remote(role, endpoints)

    # --- supervision ------------------------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            await self._check_proxy()
            for record in self.engines.values():
                if record.state in ("ready", "restarting"):
                    await self._check_engine(record)

    async def _check_engine(self, record: EngineRecord) -> None:
        try:
            info = await asyncio.wait_for(record.handle.info.remote(), timeout=PROBE_TIMEOUT_S)
        except (RayActorError, TimeoutError) as e:
            if record.state == "ready":
                record.state = "restarting"
                self._event(f"{record.engine_id} stopped answering ({type(e).__name__}); out of the pool")
                await self._publish(record.role)
            if isinstance(e, ActorDiedError):  # restarts exhausted: dead for good
                record.state, record.error = "failed", f"actor died for good: {e}"
                self._event(f"{record.engine_id} is gone: Ray will not restart it again")
            return
        if info["state"] == "idle":  # Ray restarted the actor: start vLLM in it again
            # Ray may bring the actor back before a probe ever failed: the old
            # engine's URL must leave the pool before the slow start begins.
            was_ready = record.state == "ready"
            record.state = "starting"  # not probed again until it is ready; the other engines still are
            record.restarts += 1
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

    def _event(self, message: str) -> None:
        self.events.append({"t": time.time(), "message": message})
        del self.events[:-500]
        logger.info("%s", message)

    def _fail(self, error: str) -> None:
        self.phase, self.error = "failed", error
        self._event("cluster failed to start")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _cause(error: BaseException) -> str:
    cause = error.cause if isinstance(error, RayTaskError) else error
    return f"{type(cause).__name__}: {cause}"
