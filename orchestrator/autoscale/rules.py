"""How a pool grows and shrinks: the controller's rules, which the simulator follows too.

- Growing first takes back the pool's draining engines, oldest (lowest replica
  number) first: one serves again at once, where a new engine would need its
  startup. Only then does it start new engines, on the lowest replica numbers no
  engine holds (an engine that is being stopped holds its number until it stopped;
  the controller starts the missing engine then).
- Shrinking retires the newest engines first (the highest replica numbers), and
  an engine that is not serving yet before one that serves.
- Moving changes a ready engine's pool without restarting it (pools of one shape:
  ``ClusterSpec.move_problem``). When one pool is to grow and the other to shrink,
  the change both share is made by moves (``moves_for``): the shrinking pool's
  ready engines move, newest first (``move_order``). A moving engine leaves its
  old pool's routing at once, finishes what it has there, and serves in the new
  pool then; it counts towards the new pool from the decision on. A pool that grows
  also moves in the other pool's draining (or kept-warm) engines, after taking back
  its own and before starting any (``resize_plan``'s ``others``): the ratio of the
  pools then changes in seconds even when its two halves come in separate decisions.
- A retired engine that has drained is kept warm (``autoscaling.keep_warm_s``) only
  while the pools' targets and the engines already warm leave room in
  ``max_engines``; when they no longer fit, the longest-warm stop first.

Pure code: ``orchestrator.controller`` applies these to its engine records, the
simulator to its modelled engines, so that a policy judged in simulation meets the
same scaling mechanics on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = [
    "MOVING",
    "SERVING",
    "ResizePlan",
    "move_order",
    "moves_for",
    "new_replicas",
    "resize_plan",
    "retirement_order",
    "take_back_order",
    "warm_room",
    "warm_to_stop",
]

T = TypeVar("T")
MOVING = "moving"
"""A ready engine on its way from one pool to the other: it finishes its old pool's work, then serves in the new."""
SERVING = ("pending", "starting", "ready", "restarting", MOVING)
"""Engine states that count towards a pool's size: asked for, starting, serving or moving into it."""


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


def move_order(engines: Sequence[T], ready: Callable[[T], bool], replica: Callable[[T], int]) -> list[T]:
    """The engines of a pool that may move, in the order they move: the ready ones, newest first (a shrink's
    order: the engines the pool would retire are the ones it gives away)."""
    return sorted((e for e in engines if ready(e)), key=lambda e: -replica(e))


def moves_for(
    current: Mapping[str, int], wanted: Mapping[str, int], movable: Mapping[str, int]
) -> tuple[str, str, int] | None:
    """``(source, destination, count)``: the part of a change from ``current`` to ``wanted`` pool sizes that
    moves make, when one pool shrinks while the other grows; at most the source's ``movable`` (ready) engines.
    None when no move helps. The rest of the change is starts and retirements (``resize_plan``)."""
    for source, destination in zip(current, reversed(list(current)), strict=True):
        count = min(
            current[source] - wanted.get(source, current[source]),
            wanted.get(destination, current[destination]) - current[destination],
            movable.get(source, 0),
        )
        if count > 0:
            return source, destination, count
    return None


def warm_room(max_engines: int | None, targets: int, warm: int) -> int:
    """How many more drained engines may be kept warm: the budget beyond the pools' ``targets`` together and
    the ``warm`` engines already kept; 0 without a budget. Negative: that many warm engines too many."""
    return 0 if max_engines is None else max_engines - targets - warm


def warm_to_stop(warm: Sequence[T], since: Callable[[T], float], max_engines: int | None, targets: int) -> list[T]:
    """The engines kept warm that stop now so that the targets and the rest fit the budget: the longest-warm
    (smallest ``since``) first."""
    return sorted(warm, key=since)[: max(0, -warm_room(max_engines, targets, len(warm)))]


class PoolEngine(Protocol):
    state: str  # pending | starting | ready | restarting | draining | failed
    stopping: bool  # being stopped: neither taken back nor started again
    retry_at: float  # a failed engine starts again from then (monotonic seconds)


E = TypeVar("E", bound=PoolEngine)


@dataclass(frozen=True, slots=True)
class ResizePlan(Generic[E]):
    """What brings one pool to its target (``resize_plan``)."""

    serving: int
    take_back: list[E]
    """Draining (or warm) engines that serve again at once."""
    move_in: list[E]
    """The other pool's draining (or warm) engines that move into this one (``others``)."""
    start_again: list[E]
    """Failed engines started afresh now (their back-off ended)."""
    waiting: int
    """Failed engines the pool needs whose back-off has not ended: they hold their places."""
    start: int
    """New engines to start, on ``new_replicas``."""
    retire: list[E]
    stop_failed: list[E]
    """Failed engines the pool no longer needs."""


def resize_plan(
    engines: Sequence[E],
    target: int,
    now: float,
    retry_now: bool,
    replica: Callable[[E], int],
    others: Sequence[E] = (),
) -> ResizePlan[E]:
    """How a pool of ``engines`` reaches ``target``: take back draining engines first, then move in the
    draining engines of ``others`` (the other pool's, where engines may move), then start failed ones
    again (once their back-off ended at ``now``, or ``retry_now``), then start new ones; or retire the
    surplus (``retirement_order``). Failed engines beyond what the target needs are stopped."""
    serving = [e for e in engines if e.state in SERVING]
    draining = [e for e in engines if e.state == "draining" and not e.stopping]
    taken = take_back_order(draining, replica)[: max(target - len(serving), 0)]
    leaving = [e for e in others if e.state == "draining" and not e.stopping]
    moved = take_back_order(leaving, replica)[: max(target - len(serving) - len(taken), 0)]
    failed = sorted((e for e in engines if e.state == "failed" and not e.stopping), key=replica)
    wanted = failed[: max(target - len(serving) - len(taken) - len(moved), 0)]
    again = [e for e in wanted if retry_now or now >= e.retry_at]
    retiring = retirement_order(serving, lambda e: e.state == "ready", replica)[: max(len(serving) - target, 0)]
    return ResizePlan(
        serving=len(serving),
        take_back=taken,
        move_in=moved,
        start_again=again,
        waiting=len(wanted) - len(again),
        start=max(target - len(serving) - len(taken) - len(moved) - len(wanted), 0),
        retire=retiring,
        stop_failed=failed[len(wanted) :],
    )
