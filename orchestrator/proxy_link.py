"""The controller's link to the proxy actor: start it, find it again after a restart of the controller, watch it,
and publish the pools to it (``Publisher``, ``orchestrator.pools``).

A pool is published as its ready engines and those draining (the proxy routes no new request to those, but
counts their requests in flight); an engine moving between the pools is published as draining in its old one
until its old work is done. Each engine comes with its connector's side channel (one endpoint per TP rank),
where the proxy asks a decode engine how a stream's KV got to it; none for vLLM's own connector.

A cluster of several models has one proxy and one ``Pools`` per model; ``publisher(pools)`` is what that
model's collaborators publish through (its pools go to the proxy's pools of that model).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ray.exceptions import RayActorError

from contract.wire import ROLES, http_url
from orchestrator.engine_handles import EngineHandles
from orchestrator.pools import PROBE_TIMEOUT_S, Events, Pools


class ProxyLink:
    def __init__(self, models: list[Pools], handles: EngineHandles, events: Events) -> None:
        self.models, self.handles, self.events = models, handles, events
        self.handle: Any = None
        spec = models[0].spec
        self.url = http_url(spec.proxy.host, spec.proxy.port)  # where clients reach it

    async def start(self) -> None:
        self.handle = self.handles.create_proxy()
        self.events.add(f"proxy starting on {self.url}")
        self.url = (await self.handle.start.remote())["url"]
        self.events.add("proxy ready")

    async def adopt(self) -> None:
        """Find the running proxy actor (a restarted controller); ``ValueError`` when it is gone."""
        self.handle = self.handles.find("proxy")
        with contextlib.suppress(Exception):  # where clients reach it (its node's address if it listens everywhere)
            self.url = (await asyncio.wait_for(self.handle.info.remote(), timeout=PROBE_TIMEOUT_S))["url"]

    def publisher(self, pools: Pools) -> ModelPublisher:
        """What the collaborators of ``pools``' model publish through (``Publisher``)."""
        return ModelPublisher(self, pools)

    async def publish(self, pools: Pools, role: str) -> None:
        """Tell the proxy the role's engines of ``pools``' model: the ready ones, and those draining (no new
        requests)."""
        records = [
            r
            for r in pools.engines.values()
            if r.url and ((r.role == role and r.state in ("ready", "draining")) or r.moving_from == role)
        ]
        draining = [r.engine_id for r in records if r.state == "draining" or r.moving_from == role]
        pdserve = pools.spec.connector == "pdserve"
        endpoints = [(r.engine_id, r.url, r.kv_endpoints if pdserve else ()) for r in records]
        await self.handle.set_endpoints.remote(role, endpoints, draining, pools.targets[role], pools.spec.model_name)

    async def publish_all(self) -> None:
        for pools in self.models:
            for role in ROLES:
                await self.publish(pools, role)

    async def check(self) -> None:
        """The monitor's look at the proxy: one that Ray restarted serves again with the pools as they are."""
        try:
            info = await asyncio.wait_for(self.handle.info.remote(), timeout=PROBE_TIMEOUT_S)
        except (RayActorError, TimeoutError):
            return
        if info["state"] == "idle":
            self.events.add("proxy restarted by Ray; serving again")
            await self.handle.start.remote()
            await self.publish_all()

    async def in_flight(self, engine_id: str, role: str) -> int:
        with contextlib.suppress(RayActorError, TimeoutError):
            info = await asyncio.wait_for(self.handle.info.remote(), timeout=PROBE_TIMEOUT_S)
            for entry in info["pool"].get(role, []):
                if entry["engine_id"] == engine_id:
                    return int(entry.get("in_flight") or 0)
        return 0


class ModelPublisher:
    """``Publisher`` of one model's pools: the link's calls with its ``Pools``."""

    def __init__(self, link: ProxyLink, pools: Pools) -> None:
        self.link, self.pools = link, pools

    @property
    def handle(self) -> Any:
        """The proxy actor."""
        return self.link.handle

    async def publish(self, role: str) -> None:
        await self.link.publish(self.pools, role)

    async def in_flight(self, engine_id: str, role: str) -> int:
        return await self.link.in_flight(engine_id, role)
