"""``prefix_aware``: the engine whose prefix cache holds the longest prefix of this prompt (its KV events say,
``proxy.residency``; where they do not come, the engine last sent it, which likely still holds it), unless it is
overloaded next to the least loaded engine; otherwise the least loaded.

Prefixes are chained hashes of fixed-size blocks of the prompt (``proxy.routing.prefix_hashes``): hash *i*
covers blocks 0..*i*, so one hash names the whole prefix up to that block. ``PrefixIndex`` keeps, for the most
recent hashes (LRU, bounded), the engine last sent them. The simulator has no prompts: it models this policy as
``least_loaded``.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from proxy.policies.least_loaded import least_loaded

if TYPE_CHECKING:
    from proxy.config import RoutingConfig
    from proxy.pool import EngineState


class PrefixIndex:
    """Which engine was last sent each prefix (chained block hash); the most recent ``capacity`` hashes."""

    __slots__ = ("capacity", "_owners")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: collections.OrderedDict[int, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def longest(self, prefix: tuple[int, ...], engines: Sequence[EngineState]) -> tuple[EngineState | None, int]:
        """The engine among ``engines`` last sent the longest part of ``prefix``, and that part's block count."""
        owners = self._owners
        for depth in range(len(prefix), 0, -1):
            owner = owners.get(prefix[depth - 1])
            if owner is not None:
                for engine in engines:
                    if engine.engine_id == owner:
                        return engine, depth
        return None, 0

    def blocks_sent(self, prefix: tuple[int, ...], engine_id: str) -> int:
        """How many leading blocks of ``prefix`` were last sent to ``engine_id``."""
        owners = self._owners
        for depth in range(len(prefix), 0, -1):
            if owners.get(prefix[depth - 1]) == engine_id:
                return depth
        return 0

    def record(self, prefix: tuple[int, ...], engine_id: str) -> None:
        owners = self._owners
        for block_hash in prefix:
            owners[block_hash] = engine_id
            owners.move_to_end(block_hash)
        while len(owners) > self.capacity:
            owners.popitem(last=False)


class PrefixAware:
    """The engine holding the longest prefix, unless overloaded; else the least loaded. Records its choice."""

    __slots__ = ("index", "overload_factor", "_counter")
    needs_load: ClassVar[bool] = True
    needs_prefix: ClassVar[bool] = True
    simulated_as: ClassVar[str | None] = "least_loaded"
    summary: ClassVar[str] = (
        "the engine whose prefix cache holds the longest prefix of the prompt (its KV events say; without them, the "
        "engine last sent it), unless overloaded; else the least loaded"
    )

    def __init__(self, capacity: int, overload_factor: float) -> None:
        self.index = PrefixIndex(capacity)
        self.overload_factor = overload_factor
        self._counter = itertools.count()

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> PrefixAware:
        return cls(routing.prefix_cache_size, routing.prefix_overload_factor)

    def pick(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        chosen = self.choose(engines, prefix, shared_depth, resident)
        if prefix:
            self.index.record(prefix, chosen.engine_id)
        return chosen

    def choose(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        """``pick`` without recording the choice. ``shared_depth``: leading blocks of ``prefix`` that every engine
        can load (a shared KV tier holds them); a holder of no more than that has nothing to offer over the least
        loaded engine. ``resident``: what each engine's prefix cache holds of ``prefix`` (its KV events), read
        instead of the index."""
        least = least_loaded(engines, next(self._counter))
        if resident is not None:
            holder, depth = max(((e, resident.get(e.engine_id, 0)) for e in engines), key=lambda held: held[1])
        else:
            holder, depth = self.index.longest(prefix, engines) if prefix else (None, 0)
        if holder is not None and depth > shared_depth and holder.load + 1 <= self.overload_factor * (least.load + 1):
            return holder
        return least
