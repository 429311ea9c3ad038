"""``least_loaded``: the lowest ``EngineState.load`` (this proxy's legs on the engine, its queue and KV cache use
from ``/metrics``); ties go in turn."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from proxy.config import RoutingConfig
    from proxy.pool import EngineState


def least_loaded(engines: Sequence[EngineState], turn: int = 0) -> EngineState:
    """The engine with the lowest load; among equals, the first from position ``turn`` on (so ties rotate)."""
    count = len(engines)
    best = engines[turn % count]
    best_load = best.load
    for step in range(1, count):
        engine = engines[(turn + step) % count]
        load = engine.load
        if load < best_load:
            best, best_load = engine, load
    return best


class LeastLoaded:
    __slots__ = ("_counter",)
    needs_load: ClassVar[bool] = True
    needs_prefix: ClassVar[bool] = False
    simulated_as: ClassVar[str | None] = "least_loaded"
    summary: ClassVar[str] = (
        "fewest of the proxy's requests plus the engine's vllm:num_requests_waiting and vllm:kv_cache_usage_perc "
        "from its /metrics"
    )
    index = None

    def __init__(self) -> None:
        self._counter = itertools.count()

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> LeastLoaded:
        return cls()

    def pick(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        return least_loaded(engines, next(self._counter))

    choose = pick
