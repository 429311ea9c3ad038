"""How a pool grows and shrinks: the controller's rules, which the simulator follows too.

- Growing starts new engines on the lowest replica numbers no engine holds (a
  draining engine still holds its number until it stops).
- Shrinking retires the newest engines first (the highest replica numbers), and
  an engine that is not serving yet before one that serves.
- A draining engine is not taken back: it finishes its requests and stops; a
  scale-up while it drains starts another engine (which serves after its startup).

Pure code: ``orchestrator.controller`` applies these to its engine records, the
simulator to its modelled engines, so that a policy judged in simulation meets the
same scaling mechanics on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["DRAINING_TAKEN_BACK", "new_replicas", "retirement_order"]

T = TypeVar("T")

DRAINING_TAKEN_BACK = False


def new_replicas(held: Iterable[int], count: int) -> list[int]:
    """The ``count`` lowest replica numbers not in ``held``."""
    taken, out, n = set(held), [], 0
    while len(out) < count:
        if n not in taken:
            out.append(n)
        n += 1
    return out


def retirement_order(engines: Sequence[T], serving: Callable[[T], bool], replica: Callable[[T], int]) -> list[T]:
    """``engines`` (those starting or serving) in the order a shrink retires them."""
    return sorted(engines, key=lambda e: (serving(e), -replica(e)))
