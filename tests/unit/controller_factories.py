"""The controller's collaborators without Ray (``orchestrator.pools``): each built on a real ``Pools`` of the
autoscaling demo with stand-ins for the others, which record what they were asked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from orchestrator.engine_record import EngineRecord
from orchestrator.launch import plan_engines
from orchestrator.pool_changes import PoolChanges
from orchestrator.pools import Pools
from orchestrator.proxy_link import ModelPublisher, ProxyLink
from orchestrator.spec import ClusterSpec

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-cpu-autoscale.yaml"  # max_engines 3


class Events(list):
    """``Events``: the messages, in order."""

    def add(self, message: str) -> None:
        self.append(message)

    def save(self) -> None:
        pass


class Tasks(list):
    """``Tasks``: every task spawned, in order."""

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.append(task)
        return task

    def cancel_all(self) -> None:
        for task in self:
            task.cancel()


class Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class ProxyHandle:
    """The proxy actor: what it was told, ``(role, serving, draining)`` per ``set_endpoints``."""

    def __init__(self) -> None:
        self.told: list[tuple[str, list[str], list[str]]] = []

        async def set_endpoints(role, endpoints, draining, target, model=None):  # noqa: ANN001, ANN202
            serving = [e[0] for e in endpoints if e[0] not in draining]
            self.told.append((role, serving, list(draining)))

        self.set_endpoints = Remote(set_endpoints)


class Starts:
    """``EngineStarts``: the engines it was asked to launch and to start again; ``stop`` drops the record."""

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self.launched: list[str] = []
        self.started_again: list[str] = []

    def launch(self, engine_id: str) -> None:
        self.launched.append(engine_id)

    async def start_again(self, record: EngineRecord) -> None:
        self.started_again.append(record.engine_id)

    async def stop(self, record: EngineRecord) -> None:
        self.pools.engines.pop(record.engine_id, None)


def pools(prefill: int = 1, decode: int = 1) -> Pools:
    """The autoscaling demo's pools (prefill 1..2, decode 1..2, 3 engines), ready, with no engine yet."""
    spec = ClusterSpec.from_file(CONFIG)
    launches = {launch.engine_id: launch for launch in plan_engines(spec)}
    return Pools(spec, launches, Path("/nonexistent"), {"prefill": prefill, "decode": decode}, phase="ready")


def proxy_link(of: Pools, events: Events) -> ModelPublisher:
    """The publisher of ``of``'s model, on a link whose proxy is a ``ProxyHandle`` (``.handle``)."""
    link = ProxyLink([of], handles=None, events=events)  # type: ignore[arg-type]
    link.handle = ProxyHandle()
    return link.publisher(of)


def pool_changes(prefill: int = 1, decode: int = 1, ready: bool = False) -> PoolChanges:
    """``PoolChanges`` on ``pools(prefill, decode)`` (with ready engines ``{role}-{n}`` up to the targets when
    ``ready``); ``.events``, ``.tasks``, ``.starts`` and ``.proxy.handle`` record what it did."""
    of, events = pools(prefill, decode), Events()
    changes = PoolChanges(of, Starts(of), proxy_link(of, events), events, Tasks(), nodes=lambda: None)
    for role, count in of.targets.items() if ready else ():
        for n in range(count):
            of.engines[f"{role}-{n}"] = EngineRecord(f"{role}-{n}", role, state="ready", url=f"http://{role}-{n}")
    return changes
