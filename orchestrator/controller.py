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

The controller coordinates collaborators it owns, each with a declared interface (``orchestrator.pools``):
``PoolChanges`` (scale, move, retire), ``EngineSupervisor`` (one engine's start, watch and stop), ``ProxyLink``
(the proxy actor, publishing the pools to it) and ``EventLog`` (events, snapshot); they share its ``Pools``.
A cluster of several models has one ``ModelGroup`` (``orchestrator.model_group``) per model, each with its own
``Pools``, pool changes, supervisor and autoscaler; the proxy link, event log and engine handles are shared.
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
import logging
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from contract.auth import ClusterSecret, new_secret
from contract.wire import ROLES
from orchestrator.autoscale.rules import MOVING
from orchestrator.control import cluster_status
from orchestrator.control_server import ControlServer
from orchestrator.engine_handles import EngineHandles
from orchestrator.engine_metrics import QUARANTINED_BLOCKS, SampleReader
from orchestrator.engine_record import RUNNING_STATES, EngineRecord, take_info
from orchestrator.errors import PdserveError
from orchestrator.event_log import EventLog
from orchestrator.logs import redirect_output
from orchestrator.model_group import ModelGroup
from orchestrator.pools import MONITOR_INTERVAL_S, PROBE_TIMEOUT_S, Tasks
from orchestrator.proxy_link import ProxyLink
from orchestrator.spec import ClusterSpec
from orchestrator.supervision import cause_of

logger = logging.getLogger(__name__)

STATUS_METRICS_TIMEOUT_S = 2.0  # a status waits no longer for an engine's /metrics (null if it did not answer)


class ClusterController:
    def __init__(
        self,
        spec_data: dict[str, Any],
        log_dir: str,
        host: str | None,
        profiles: dict[str, dict[str, Any]] | None = None,
        api_token_sha256: str = "",
        api_host: str | None = None,
        secret: ClusterSecret | None = None,
    ) -> None:
        redirect_output(Path(log_dir) / "controller.log")
        self.spec = spec = ClusterSpec.model_validate(spec_data)
        self.log_dir = Path(log_dir)
        self.error: str | None = None
        self.started_at, self.ready_s = time.time(), None
        self.restarts = 0  # Ray restarts of this controller
        self._phase = "created"
        self.log = EventLog(self.log_dir, self._snapshot)
        self.handles = EngineHandles(spec, secret or new_secret(), self.log_dir)
        self.tasks = Tasks()
        self.quarantined_blocks = SampleReader(QUARANTINED_BLOCKS, timeout_s=STATUS_METRICS_TIMEOUT_S)
        profiles = profiles or {}
        self.groups = {
            view.model_name: ModelGroup(
                view, host, self.log_dir, self.handles, self.log, self.tasks, profiles.get(view.model_name)
            )
            for view in spec.views()
        }
        self.proxy = ProxyLink([group.pools for group in self.groups.values()], self.handles, self.log)
        for group in self.groups.values():
            group.link(self.proxy)
        # The API listens where the CLI reaches it: loopback on a local cluster, else this node's address.
        api_host = api_host or host or ray.util.get_node_ip_address()
        self.api = ControlServer(self, api_token_sha256, api_host, after_shutdown=self._exit)
        snapshot = self.log.read()
        self._resumed = False
        if snapshot is not None:  # Ray restarted this controller: take the cluster back (``resume``)
            self._restore(snapshot)
            threading.Thread(target=self._call_resume, name="pdserve-resume", daemon=True).start()

    # --- the models' groups ----------------------------------------------------------------

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        """The cluster's phase, which every model's ``Pools`` reads."""
        self._phase = value
        for group in self.groups.values():
            group.pools.phase = value

    def group_of(self, engine_id: str) -> ModelGroup:
        return next(g for g in self.groups.values() if engine_id in g.pools.launches)

    def records(self) -> list[EngineRecord]:
        """Every engine of every model."""
        return [r for group in self.groups.values() for r in group.pools.engines.values()]

    def _group(self, model: str | None) -> ModelGroup | str:
        """The group of ``model`` (its served name or key; None: the only one: ``ClusterSpec.view``), or why there
        is none."""
        try:
            return self.groups[self.spec.view(model).model_name]
        except PdserveError as e:
            return str(e)

    # --- public API (called by the CLI) ---------------------------------------------------

    async def start(self) -> str:
        """Serve the API and bring the cluster up (in the background); return the API's URL."""
        url = await self.api.start()
        if self.phase == "created":
            self.phase = "starting"
            self.log.save()
            self.tasks.spawn(self._bring_up())
        return url

    async def status(self) -> dict[str, Any]:
        """``cluster_status``, with each running engine's quarantined KV blocks read from its /metrics (at most
        ``STATUS_METRICS_TIMEOUT_S`` per engine, all at once, while Ray lists the nodes)."""
        running = {r.engine_id: r.url for r in self.records() if r.url and r.state in RUNNING_STATES}
        nodes, blocks = await asyncio.gather(
            asyncio.to_thread(self.handles.nodes), self.quarantined_blocks.read(running)
        )
        return cluster_status(self, nodes, {e: None if n is None else int(n) for e, n in blocks.items()})

    async def scale(self, targets: dict[str, int], reason: str = "by hand", model: str | None = None) -> dict[str, Any]:
        """``PoolChanges.scale`` of ``model``'s pools by hand (``pdserve scale``)."""
        group = self._group(model)
        return {"error": group} if isinstance(group, str) else await group.changes.scale(targets, reason)

    async def move(
        self, source: str, destination: str, count: int = 1, reason: str = "by hand", model: str | None = None
    ) -> dict[str, Any]:
        """``PoolChanges.move`` between ``model``'s pools by hand (``pdserve scale --move``)."""
        group = self._group(model)
        if isinstance(group, str):
            return {"error": group}
        return await group.changes.move(source, destination, count, reason)

    async def shutdown(self) -> None:
        self.phase = "stopping"
        self.tasks.cancel_all()
        handles = [r.handle for r in self.records() if r.handle is not None]
        await self.handles.stop_all([*handles, *([self.proxy.handle] if self.proxy.handle is not None else [])])
        for record in self.records():
            self.handles.remove_placement_group(self.group_of(record.engine_id).pools.launches[record.engine_id])
            record.state, record.handle = "stopped", None
        self.phase = "stopped"
        self.log.add("cluster stopped")

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
            await self.proxy.adopt()
        except ValueError:
            self._fail("the proxy actor is gone (found after a restart of the controller)")
            return
        for record in self.records():
            await self._adopt(record)
        await self.proxy.publish_all()
        self.log.add(
            f"controller restarted by Ray (restart {self.restarts}); adopted "
            + ", ".join(f"{r.engine_id} ({r.state})" for r in self.records())
        )
        if self.phase == "starting":
            self.tasks.spawn(self._finish_bring_up([r.engine_id for r in self.records()]))
        else:
            self._start_supervision()

    async def _adopt(self, record: EngineRecord) -> None:
        group = self.group_of(record.engine_id)
        try:
            record.handle = self.handles.find(record.engine_id)
            info = await asyncio.wait_for(record.handle.info.remote(), timeout=PROBE_TIMEOUT_S)
        except (ValueError, RayActorError, TimeoutError) as e:
            if record.state == MOVING:  # called off: it serves again where the monitor finds it
                record.state, record.moving_from = "ready", None
            if record.handle is None:  # never created, or gone for good: start it (again)
                group.supervisor.create_actor(record.engine_id)
                self._start_adopted(record)
            else:  # alive but not answering: the monitor treats it as any engine that stops answering
                record.state = "restarting"
                logger.warning("adopting %s: %s", record.engine_id, e)
            return
        if info["state"] == "ready":
            take_info(record, info)
            if record.state == "draining":
                group.changes.retire(record, drain=True)
            elif record.state == MOVING:  # its move goes on: done once its old work is
                self.tasks.spawn(group.changes.finish_move(record, time.monotonic()))
            else:
                record.state = "ready"
        elif info["state"] == "failed":
            record.moving_from = None
            record.failed(info["error"])
        elif record.state != "draining":  # idle (Ray restarted it meanwhile) or still starting: start / wait
            record.moving_from = None
            self._start_adopted(record)
        else:
            group.changes.retire(record, drain=False)

    def _start_adopted(self, record: EngineRecord) -> None:
        """Start (or wait for) an adopted engine; during bring-up ``_finish_bring_up`` starts every engine."""
        if self.phase != "starting":
            self.tasks.spawn(self.group_of(record.engine_id).supervisor.start(record.engine_id))

    # --- bring-up and supervision -----------------------------------------------------------

    async def _bring_up(self) -> None:
        try:
            await self.proxy.start()
        except Exception as e:  # noqa: BLE001 - reported to the user as the cluster's error
            self._fail(f"proxy failed to start: {cause_of(e)}")
            return
        engine_ids = [r.engine_id for r in self.records()]
        try:
            for engine_id in engine_ids:
                self.group_of(engine_id).supervisor.create_actor(engine_id)
        except Exception as e:  # noqa: BLE001 - reported to the user, not a bring-up that never ends
            self._fail(f"cannot create the engine actors: {cause_of(e)}")
            return
        await self._finish_bring_up(engine_ids)

    async def _finish_bring_up(self, engine_ids: list[str]) -> None:
        # Report the first engine that fails at once, rather than after the others loaded.
        starts = [self.group_of(engine_id).supervisor.start(engine_id) for engine_id in engine_ids]
        for started in asyncio.as_completed(starts):
            engine_id = await started
            record = self.group_of(engine_id).pools.engines[engine_id]
            if record.state == "failed":
                self._fail(f"engine {record.engine_id} failed to start:\n{record.error}")
                return
        self.ready_s = time.time() - self.started_at
        self.phase = "ready"
        self.log.add(f"cluster ready in {self.ready_s:.1f}s: {self.proxy.url}")
        self._start_supervision()

    def _start_supervision(self) -> None:
        self.tasks.spawn(self._monitor())
        for group in self.groups.values():
            of = f" for {group.name}" if len(self.groups) > 1 else ""
            if group.autoscaler is not None:
                config = group.autoscaler.config
                self.log.add(
                    f"autoscaler on{of}: a decision every {config.interval_s:g}s "
                    f"(p90 TTFT <= {config.targets.ttft_p90_s:g}s, p90 ITL <= {config.targets.itl_p90_s:g}s)"
                )
                self.tasks.spawn(group.autoscaler.run())
            elif group.pools.spec.autoscaling is not None:
                self.log.add(
                    f"autoscaler off{of}: autoscaling.profile is not set (`pdserve profile` measures one); "
                    "`pdserve scale` sizes the pools within the autoscaling bounds"
                )

    async def _monitor(self) -> None:
        """Once a second: the proxy, a watch on every running engine, failed engines' back-off."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            await self.proxy.check()
            for group in self.groups.values():
                group.supervisor.watch_running()
                # Failed engines whose back-off ended: their pools grow back to the targets.
                now = time.monotonic()
                for role in ROLES if self.phase == "ready" else ():
                    engines = group.pools.engines.values()
                    if any(r.role == role and r.state == "failed" and now >= r.retry_at for r in engines):
                        await group.changes.resize(role, "a failed engine's back-off ended")

    # --- the snapshot a restarted controller resumes from -----------------------------------

    def _snapshot(self) -> dict[str, Any]:
        """What a restarted controller needs (``_restore``; ``EventLog`` writes it with the events)."""
        return {
            "phase": self.phase,
            "error": self.error,
            "started_at": self.started_at,
            "ready_s": self.ready_s,
            "targets": {name: dict(group.pools.targets) for name, group in self.groups.items()},
            "api_port": self.api.port,
            "restarts": self.restarts,
            "engines": {
                r.engine_id: {"state": r.state, "restarts": r.restarts, "role": r.role, "moving_from": r.moving_from}
                for r in self.records()
            },
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        self.phase, self.error = snapshot["phase"], snapshot["error"]
        self.started_at, self.ready_s = snapshot["started_at"], snapshot["ready_s"]
        self.restarts = snapshot["restarts"] + 1
        self.api.port = snapshot["api_port"]
        for name, group in self.groups.items():
            group.pools.targets = snapshot["targets"][name]
            group.pools.engines = {}
        for engine_id, saved in snapshot["engines"].items():
            pools = self.group_of(engine_id).pools
            record = pools.add(pools.launches[engine_id], saved.get("role"))
            record.state, record.restarts = saved["state"], saved["restarts"]
            record.moving_from = saved.get("moving_from")

    def _fail(self, error: str) -> None:
        self.phase, self.error = "failed", error
        self.log.add("cluster failed to start" if self.ready_s is None else f"cluster failed: {error}")
