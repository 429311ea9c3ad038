"""What the controller and its collaborators share, and the interfaces by which they reach each other.

``ClusterController`` (``orchestrator.controller``) owns one ``Pools`` (the cluster's phase, its engines and the
pools' targets) and four collaborators that work on it:

- ``PoolChanges`` (``orchestrator.pool_changes``): scale, move, retire and keep warm;
- ``EngineSupervisor`` (``orchestrator.supervision``): start, watch, start again and stop one engine;
- ``ProxyLink`` (``orchestrator.proxy_link``): the proxy actor, and publishing the pools to it;
- ``EventLog`` (``orchestrator.event_log``): the events and the snapshot a restarted controller resumes from.

Each reaches another only through the protocol below that names what it needs (``Events``, ``Publisher``,
``EngineStarts``), so that a unit test builds one collaborator with stand-ins for the others.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestrator.engine_record import EngineRecord
from orchestrator.launch import EngineLaunch
from orchestrator.spec import ClusterSpec

MONITOR_INTERVAL_S = 1.0
"""How often the controller's monitor ticks, and a retirement's drain asks whether the engine is done."""
PROBE_TIMEOUT_S = 5.0
"""How long a call to the proxy or an engine actor that should answer at once may take."""
MOVES_KEPT = 20
PHASES = ("created", "starting", "ready", "failed", "stopping", "stopped")


@dataclass
class Pools:
    """The cluster's phase, its engines (by id) and the pools' targets; every launch the pools may grow to."""

    spec: ClusterSpec
    launches: dict[str, EngineLaunch]
    log_dir: Path
    targets: dict[str, int]
    engines: dict[str, EngineRecord] = field(default_factory=dict)
    phase: str = "created"  # one of PHASES
    moves: collections.deque[dict[str, Any]] = field(default_factory=lambda: collections.deque(maxlen=MOVES_KEPT))

    def launches_of(self, role: str) -> list[EngineLaunch]:
        """The launches planned for pool ``role`` (an engine that moved keeps its launch)."""
        return [launch for launch in self.launches.values() if launch.role == role]

    def add(self, launch: EngineLaunch, role: str | None = None) -> EngineRecord:
        """A new record of ``launch``'s engine, serving ``role`` (default: the pool it was planned for)."""
        log_path = str(self.log_dir / f"{launch.engine_id}.log")
        record = EngineRecord(launch.engine_id, role or launch.role, log_path=log_path, model=launch.model)
        self.engines[launch.engine_id] = record
        return record

    def holds(self, record: EngineRecord) -> bool:
        """Whether ``record`` is still the cluster's (not stopped and replaced meanwhile)."""
        return self.engines.get(record.engine_id) is record

    def max_engines(self) -> int | None:
        return self.spec.autoscaling.max_engines if self.spec.autoscaling is not None else None


class Tasks:
    """The controller's background tasks: kept until done, cancelled together on shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class Events(Protocol):
    """Where a collaborator says what it did (``EventLog``)."""

    def add(self, message: str) -> None: ...

    def save(self) -> None:
        """Write the snapshot: the pools' state changed."""


class Publisher(Protocol):
    """What a collaborator needs of the proxy (``ProxyLink``)."""

    async def publish(self, role: str) -> None:
        """Tell the proxy pool ``role``'s engines as they are now."""

    async def in_flight(self, engine_id: str, role: str) -> int:
        """The requests in flight at the proxy on ``engine_id`` in pool ``role`` (0 when it does not answer)."""


class EngineStarts(Protocol):
    """What the pool changes need of the engines' lifecycle (``EngineSupervisor``)."""

    def launch(self, engine_id: str) -> None:
        """Create the engine's actor and start it in the background."""

    async def start_again(self, record: EngineRecord) -> None:
        """Start a failed engine afresh on its replica."""

    async def stop(self, record: EngineRecord) -> None:
        """Stop the engine and drop it from the pools."""
