"""Engine health: ejecting engines that fail, readmitting them when they answer again.

``HealthTracker`` is the state machine, on each ``EngineState``: a failure
(a ``/health`` probe that failed or timed out, or a request that could not
reach the engine) adds to ``failures``; ``unhealthy_after`` of them in a row
eject the engine (``EnginePool.ready`` leaves it out, so routing no longer
chooses it). Any success resets the count. An ejected engine gets no
requests, only probes; ``healthy_after`` successful probes in a row readmit
it. With every engine of a role ejected, requests get 503 with Retry-After.

``HealthMonitor`` runs in the app's lifespan: every ``interval_s`` it probes
``GET /health`` of every engine at once, on the app's ``EngineClient``, each
probe bounded by ``timeout_s``.
"""

from __future__ import annotations

import abc
import asyncio
import logging

from proxy.engine_client import EngineClient
from proxy.errors import EngineConnectionError
from proxy.pool import EnginePool, EngineState

logger = logging.getLogger(__name__)


class HealthTracker:
    def __init__(self, pool: EnginePool, unhealthy_after: int, healthy_after: int) -> None:
        self.pool = pool
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after

    def failed(self, engine: EngineState, reason: str, request_id: str | None = None) -> None:
        engine.successes = 0
        engine.failures += 1
        if engine.healthy and engine.failures >= self.unhealthy_after:
            self.pool.set_healthy(engine, False)
            logger.warning(
                "engine %s (%s) ejected after %d failures in a row; last (request %s): %s",
                engine.engine_id, engine.role, engine.failures, request_id or "-", reason,
            )  # fmt: skip

    def probe_succeeded(self, engine: EngineState) -> None:
        engine.failures = 0
        if engine.healthy:
            return
        engine.successes += 1
        if engine.successes >= self.healthy_after:
            engine.successes = 0
            self.pool.set_healthy(engine, True)
            logger.warning(
                "engine %s (%s) readmitted after %d good probes", engine.engine_id, engine.role, self.healthy_after
            )


class EngineSweep(abc.ABC):
    """Calls ``visit`` on every engine of the pool at once, every ``interval_s`` (``run``, a background task)."""

    def __init__(self, pool: EnginePool, client: EngineClient, interval_s: float, timeout_s: float) -> None:
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            await self.sweep()
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> None:
        engines = self.pool.engines()
        if engines:
            await asyncio.gather(*(self.visit(engine) for engine in engines))

    @abc.abstractmethod
    async def visit(self, engine: EngineState) -> bool:
        """Look at one engine; True if it answered as expected."""


class HealthMonitor(EngineSweep):
    def __init__(self, tracker: HealthTracker, client: EngineClient, interval_s: float, timeout_s: float) -> None:
        super().__init__(tracker.pool, client, interval_s, timeout_s)
        self.tracker = tracker

    async def visit(self, engine: EngineState) -> bool:
        return await self.probe(engine)

    async def probe(self, engine: EngineState) -> bool:
        """Probe the engine's ``/health`` once and tell the tracker; True if it answered 2xx in time."""
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.client.get(engine.url + "/health", self.timeout_s)
                await response.read(self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            reason = f"health probe: {type(e).__name__}: {e}" if str(e) else f"health probe: {type(e).__name__}"
            self.tracker.failed(engine, reason)
            return False
        if not 200 <= response.status < 300:
            self.tracker.failed(engine, f"health probe: HTTP {response.status}")
            return False
        self.tracker.probe_succeeded(engine)
        return True
