"""How a pool grows and shrinks: the controller's rules, which the simulator follows too.

- Growing first takes back the pool's draining engines, oldest (lowest replica
  number) first: one serves again at once, where a new engine would need its
  startup. Only then does it start new engines, on the lowest replica numbers no
  engine holds (an engine that is being stopped holds its number until it stopped;
  the controller starts the missing engine then).
- Shrinking retires the newest engines first (the highest replica numbers), and
  an engine that is not serving yet before one that serves.

Pure code: ``orchestrator.controller`` applies these to its engine records, the
simulator to its modelled engines, so that a policy judged in simulation meets the
same scaling mechanics on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["new_replicas", "retirement_order", "take_back_order"]

T = TypeVar("T")


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


def take_back_order(draining: Sequence[T], replica: Callable[[T], int]) -> list[T]:
    """Draining engines in the order a scale-up takes them back: the reverse of retirement."""
    return sorted(draining, key=replica)
