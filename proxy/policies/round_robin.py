"""``round_robin``: the engines in turn. The default; it costs a counter per request."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from proxy.config import RoutingConfig
    from proxy.pool import EngineState


class RoundRobin:
    __slots__ = ("_counter",)
    needs_load: ClassVar[bool] = False
    needs_prefix: ClassVar[bool] = False
    simulated_as: ClassVar[str | None] = "in_turn"
    summary: ClassVar[str] = "in turn"
    index = None

    def __init__(self) -> None:
        self._counter = itertools.count()

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> RoundRobin:
        return cls()

    def pick(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        return engines[next(self._counter) % len(engines)]

    choose = pick
