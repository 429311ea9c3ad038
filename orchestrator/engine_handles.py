"""A cluster's Ray actors and placement groups: made, found again by name, stopped, freed.

The controller decides; ``EngineHandles`` does the Ray plumbing. Every actor
is detached and named ``<cluster>-<part>`` (``part`` an engine id or
``proxy``), so that a restarted controller finds it again (``find``). A GPU
engine runs in a placement group of its own (one bundle per TP rank), named
after the actor with ``-pg``; a CPU engine asks for its cores directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from contract.auth import ClusterSecret, EngineKey
from orchestrator.engine_actor import ENGINE_ACTOR_GROUPS, EngineActor
from orchestrator.launch import EngineLaunch
from orchestrator.placement import Node, control_placement
from orchestrator.proxy_actor import ProxyActor
from orchestrator.spec import ClusterSpec

logger = logging.getLogger(__name__)

ENGINE_MAX_RESTARTS = 5
STOP_TIMEOUT_S = 60.0


class EngineHandles:
    def __init__(self, spec: ClusterSpec, secret: ClusterSecret, log_dir: Path) -> None:
        self.spec = spec
        self._secret = secret  # engines get it, the proxy only its engine key; never logged
        self.log_dir = log_dir

    def actor_name(self, part: str) -> str:
        """The Ray actor name of the proxy (``part="proxy"``) or an engine: found again by a restarted controller."""
        return f"{self.spec.name}-{part}"

    def find(self, part: str) -> Any:
        """The running actor of ``part``; ``ValueError`` if there is none."""
        return ray.get_actor(self.actor_name(part))

    def create_proxy(self) -> Any:
        return (
            ray.remote(ProxyActor)
            .options(
                max_restarts=-1,
                max_task_retries=0,
                name=self.actor_name("proxy"),
                lifetime="detached",
                **control_placement(self.spec).actor_options(),
            )
            .remote(
                self.spec.proxy_configs(),
                self.spec.proxy.host,
                self.spec.proxy.port,
                str(self.log_dir / "proxy.log"),
                EngineKey.of(self._secret),  # the engine key alone: the proxy never holds the cluster secret
            )
        )

    def create_engine(self, launch: EngineLaunch, log_path: str) -> Any:
        options: dict[str, Any] = {
            "max_restarts": ENGINE_MAX_RESTARTS,
            "max_task_retries": 0,
            "name": self.actor_name(launch.engine_id),
            "lifetime": "detached",  # outlives a restart of the controller, which adopts it
            # Ray would record each call to the actor as a task event and ship it to the GCS: a cost per
            # call for a dashboard list nobody reads.
            "enable_task_events": False,
        }
        if launch.placement.bundles:  # GPU: the engine and its TP workers in one placement group
            options.update(
                num_cpus=0,
                num_gpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group(launch), placement_group_capture_child_tasks=True
                ),
            )
        else:
            options.update(launch.placement.actor_options())
        return (
            ray.remote(concurrency_groups=ENGINE_ACTOR_GROUPS)(EngineActor)  # stop() has a loop of its own
            .options(**options)
            .remote(launch, log_path, self.spec.network.interface, self._secret)
        )

    def _placement_group(self, launch: EngineLaunch) -> Any:
        """The engine's placement group (one bundle per TP rank): the one a previous controller made, or a new one."""
        name = self.actor_name(launch.engine_id) + "-pg"
        with contextlib.suppress(ValueError):
            return ray.util.get_placement_group(name)
        return ray.util.placement_group(name=name, lifetime="detached", **launch.placement.placement_group_args())

    def remove_placement_group(self, launch: EngineLaunch) -> None:
        if not launch.placement.bundles:
            return
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(ray.util.get_placement_group(self.actor_name(launch.engine_id) + "-pg"))

    async def release(self, handle: Any, launch: EngineLaunch) -> None:
        """Stop the engine's vLLM and its actor, and free its placement group."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.stop.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
        # The replica may start again later under the same actor name: wait until Ray let it go.
        for _ in range(100):
            try:
                self.find(launch.engine_id)
            except ValueError:
                break
            await asyncio.sleep(0.1)
        self.remove_placement_group(launch)

    async def stop_all(self, handles: list[Any]) -> None:
        """Stop these actors (engines, the proxy) together, then kill them."""
        with contextlib.suppress(Exception):
            stops = [h.stop.remote() for h in handles]
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), timeout=STOP_TIMEOUT_S)
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    @staticmethod
    def nodes() -> list[Node] | None:
        """Ray's nodes, alive and dead; None (logged) when the GCS does not answer."""
        try:
            return [Node.from_ray(entry) for entry in ray.nodes()]
        except Exception as e:  # noqa: BLE001 - callers carry on without the list
            logger.warning("cannot list Ray's nodes: %s", e)
            return None
