"""How a pool grows and shrinks: the controller's rules, which the simulator follows too.

- Growing first takes back the pool's draining engines, oldest (lowest replica
  number) first: one serves again at once, where a new engine would need its
  startup. Only then does it start new engines, on the lowest replica numbers no
  engine holds (an engine that is being stopped holds its number until it stopped;
  the controller starts the missing engine then).
- Shrinking retires the newest engines first (the highest replica numbers), and
  an engine that is not serving yet before one that serves.
- A retired engine that has drained is kept warm (``autoscaling.keep_warm_s``) only
  while the pools' targets and the engines already warm leave room in
  ``max_engines``; when they no longer fit, the longest-warm stop first.

Pure code: ``orchestrator.controller`` applies these to its engine records, the
simulator to its modelled engines, so that a policy judged in simulation meets the
same scaling mechanics on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["new_replicas", "retirement_order", "take_back_order", "warm_room", "warm_to_stop"]

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


def warm_room(max_engines: int | None, targets: int, warm: int) -> int:
    """How many more drained engines may be kept warm: the budget beyond the pools' ``targets`` together and
    the ``warm`` engines already kept; 0 without a budget. Negative: that many warm engines too many."""
    return 0 if max_engines is None else max_engines - targets - warm


def warm_to_stop(warm: Sequence[T], since: Callable[[T], float], max_engines: int | None, targets: int) -> list[T]:
    """The engines kept warm that stop now so that the targets and the rest fit the budget: the longest-warm
    (smallest ``since``) first."""
    return sorted(warm, key=since)[: max(0, -warm_room(max_engines, targets, len(warm)))]
