"""The engines' own view of their load, from their Prometheus ``/metrics``, for the load-aware policies.

``LoadPoller`` runs in the app's lifespan when a policy reads load
(``least_loaded``, ``prefix_aware``): every ``interval_s`` it fetches each
engine's ``GET /metrics`` on the app's ``EngineClient`` and stores, on its
``EngineState``, the requests waiting in its queue and the share of its KV
cache in use. An engine that does not answer keeps its last values (its
health is ``proxy.health``'s business).
"""

from __future__ import annotations

import asyncio
import logging

from proxy.errors import EngineConnectionError
from proxy.health import EngineSweep
from proxy.pool import EngineState

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""vLLM's name for KV cache use (a fraction, 0-1), and the name older versions used."""


def parse_engine_load(text: str) -> tuple[float, float] | None:
    """(requests waiting, KV cache use 0-1) from Prometheus text; None if neither is there.

    Series with labels (one per model, or per data-parallel rank) are summed for
    the queue and averaged for the cache.
    """
    waiting = 0.0
    usage: list[float] = []
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name != WAITING and name not in KV_CACHE_USAGE:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        seen = True
        if name == WAITING:
            waiting += value
        else:
            usage.append(value)
    if not seen:
        return None
    return waiting, (sum(usage) / len(usage) if usage else 0.0)


class LoadPoller(EngineSweep):
    async def visit(self, engine: EngineState) -> bool:
        return await self.poll(engine)

    async def poll(self, engine: EngineState) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.client.get(engine.url + "/metrics", self.timeout_s)
                payload = await response.read(self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            logger.debug("engine %s: /metrics failed: %s", engine.engine_id, e)
            return False
        load = parse_engine_load(payload.decode(errors="replace")) if response.status == 200 else None
        if load is None:
            logger.debug("engine %s: /metrics (HTTP %d) has no vLLM load", engine.engine_id, response.status)
            return False
        engine.waiting, engine.kv_cache_usage = load
        return True
