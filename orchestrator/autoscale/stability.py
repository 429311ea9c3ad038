"""From wishes to targets: steps 4 to 6 of ``orchestrator.autoscale.policy``.

The demand (``orchestrator.autoscale.demand``) says what each pool wishes for one window; this module decides
what the pools get, so that the cluster neither breaks its limits nor flaps:

- limits: ``clamp`` keeps each pool within its min/max, ``fit_budget`` both within ``max_engines`` (shared in
  proportion to what each needs for the arrival rate), ``hold_budget`` the targets after stability;
- stability (``Stability``, which remembers the wishes and each pool's last change): cooldowns, the largest
  recent wish, the hysteresis band and the burst guard;
- moves (``Stability.move``): a growing pool takes the other pool's engines beyond that pool's own demand.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import TYPE_CHECKING

from contract.wire import ROLES

if TYPE_CHECKING:
    from collections.abc import Iterable

    from orchestrator.autoscale.config import AutoscalingConfig
    from orchestrator.autoscale.observation import ClusterObservation

__all__ = ["MOVE_MEMORY", "Stability", "clamp", "fit_budget", "hold_budget"]

MOVE_MEMORY = 3  # a pool gives engines away by moves only down to the largest of its last this many wishes


def clamp(config: AutoscalingConfig, wish: dict[str, int], floor: dict[str, int], reasons: list[str]) -> None:
    """Each pool's wish within its min/max, and its floor within its max (in place)."""
    for role in ROLES:
        limits = config.limits(role)
        clamped = min(max(wish[role], limits.min), limits.max)
        if clamped != wish[role]:
            reasons.append(f"{role}: {wish[role]} clamped to [{limits.min}, {limits.max}] -> {clamped}")
        wish[role] = clamped
        floor[role] = min(floor[role], limits.max)


def fit_budget(
    config: AutoscalingConfig, want: dict[str, int], demand: dict[str, int], reasons: list[str]
) -> dict[str, int]:
    """``want`` (each within its pool's bounds) fitted to ``max_engines``: shared in proportion to
    ``demand``, what each pool needs for the arrival rate, before the pools' max clamped it and without
    what clears a queue or the feedback adds. Shared by the clamped wishes, a pool that needs far more than
    its max would count as its max, and the budget would go to the other pool, which serves only what the
    first lets through. Shared with the queues' engines, a long prefill queue would take nearly the whole
    budget and leave decode too few engines for the rate: the requests prefilled would then wait for decode."""
    cfg = config
    total = want["prefill"] + want["decode"]
    if total <= cfg.max_engines:
        return want
    share = round(cfg.max_engines * demand["prefill"] / (demand["prefill"] + demand["decode"]))
    prefill = min(max(share, cfg.prefill.min), cfg.max_engines - cfg.decode.min, cfg.prefill.max)
    decode = min(cfg.max_engines - prefill, cfg.decode.max)
    reasons.append(
        f"budget: {want['prefill']}+{want['decode']} = {total} engines > max_engines {cfg.max_engines}; "
        f"shared in proportion to what the arrival rate needs ({demand['prefill']}:{demand['decode']}): "
        f"{prefill}+{decode}"
    )
    return {"prefill": prefill, "decode": decode}


def hold_budget(config: AutoscalingConfig, obs: ClusterObservation, target: dict[str, int], reasons: list[str]) -> None:
    """Targets within ``max_engines`` (in place): where stability kept one pool above its budget share, the
    growing pool gives way."""
    if target["prefill"] + target["decode"] > config.max_engines:
        grow = "prefill" if target["prefill"] > obs.prefill.provisioned else "decode"
        other = "decode" if grow == "prefill" else "prefill"
        target[grow] = max(config.limits(grow).min, config.max_engines - target[other])
        reasons.append(f"budget: {grow} limited to {target[grow]} while the other pool holds")


class Stability:
    """The pools' recent wishes and last changes, and the rules that keep the targets from flapping.

    Growing is allowed once ``scale_up_cooldown_s`` has passed since the pool's last change. Shrinking goes to
    the largest wish of the last ``scale_down_cooldown_s`` (so a burst that fades is not forgotten at once),
    only after that long since the pool's last change (or since the first window: a cluster just started is
    not shrunk on one cold sample), and only when it frees more than ``hysteresis`` of the pool (and at least
    one engine). The burst guard keeps ``burst_guard`` of the largest one-interval rise of a pool's demand in
    the last ``burst_memory_s``. A pool scaled by hand (``scaled_by_hand``) counts as changed at the next
    decision."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._wishes: deque[tuple[float, int, int]] = deque()  # (t, prefill, decode) before stability rules
        self._last_change: dict[str, float] = {}
        self._by_hand: set[str] = set()  # pools scaled by hand since the last decision
        self._watching_since = math.inf  # when the first observed window began
        self._history: deque[tuple[float, int, int]] = deque()  # wishes of the last burst_memory_s

    def scaled_by_hand(self, roles: Iterable[str]) -> None:
        """Pools someone else resized: the next decision counts them as changed then."""
        self._by_hand.update(roles)

    def watch(self, t: float) -> float:
        """A decision at ``t`` (its window began an interval before): how long the pools have been watched."""
        self._watching_since = min(self._watching_since, t - self.config.interval_s)
        return t - self._watching_since

    def remember(self, t: float, wish: dict[str, int]) -> None:
        """The wishes of the decision at ``t``; those older than the memories are forgotten."""
        cfg = self.config
        self._wishes.append((t, wish["prefill"], wish["decode"]))
        self._history.append((t, wish["prefill"], wish["decode"]))
        while self._history and self._history[0][0] <= t - cfg.burst_memory_s:
            self._history.popleft()
        while len(self._wishes) > 1 and self._wishes[0][0] <= t - cfg.scale_down_cooldown_s:
            self._wishes.popleft()

    def settle(
        self, obs: ClusterObservation, wish: dict[str, int], floor: dict[str, int], rising: bool, reasons: list[str]
    ) -> dict[str, int]:
        """Each pool's target from its wish (``remember`` it first) under the cooldowns, the hysteresis band and
        the burst guard; ``rising``: the load rises, no pool shrinks."""
        target: dict[str, int] = {}
        for role in ROLES:
            current = obs.pool(role).provisioned
            if role in self._by_hand:
                reasons.append(f"{role}: scaled by hand to {current}; the cooldowns count from now")
                self._last_change[role] = obs.t
            target[role] = self._stabilize(role, obs.t, current, wish[role], floor[role], rising, reasons)
            if target[role] != current:
                self._last_change[role] = obs.t
        self._by_hand.clear()
        return target

    def _stabilize(
        self, role: str, t: float, current: int, wish: int, floor: int, rising: bool, reasons: list[str]
    ) -> int:
        cfg = self.config
        since = t - self._last_change.get(role, -math.inf)
        if wish > current:
            if since < cfg.scale_up_cooldown_s:
                reasons.append(
                    f"{role}: hold at {current} (wants {wish}; scale-up cooldown, {since:.0f}s of "
                    f"{cfg.scale_up_cooldown_s:g}s since the last change)"
                )
                return current
            reasons.append(f"{role}: {current} -> {wish}")
            return wish
        if wish == current:
            reasons.append(f"{role}: stay at {current}")
            return current
        if rising:
            reasons.append(f"{role}: stay at {current} (wants {wish}; the load is rising)")
            return current
        index = 1 if role == "prefill" else 2
        recent = max(max(w[index] for w in self._wishes), floor)
        history = [w[index] for w in self._history]
        rise = max((b - a for a, b in itertools.pairwise(history)), default=0)
        guarded = min(wish + math.ceil(cfg.burst_guard * rise), current)
        if guarded > recent:
            reasons.append(
                f"{role}: burst guard: demand rose by {rise} in one interval within the last "
                f"{cfg.burst_memory_s:g}s; {cfg.burst_guard:g} of that kept in reserve: {wish} + "
                f"{math.ceil(cfg.burst_guard * rise)} = {guarded}"
            )
            recent = guarded
        step = self._band(current)
        if recent > current - step:
            reasons.append(
                f"{role}: stay at {current} (wants {wish}; largest wish of the last "
                f"{cfg.scale_down_cooldown_s:g}s is {recent}, within the hysteresis band of {step})"
            )
            return current
        # The start counts as a change: shrinking waits for a whole window of wishes, not one cold sample.
        since = min(since, t - self._watching_since)
        if since < cfg.scale_down_cooldown_s:
            reasons.append(
                f"{role}: hold at {current} (wants {recent}; scale-down cooldown, {since:.0f}s of "
                f"{cfg.scale_down_cooldown_s:g}s since the last change or the first window)"
            )
            return current
        reasons.append(f"{role}: {current} -> {recent} (largest wish of the last {cfg.scale_down_cooldown_s:g}s)")
        return recent

    def _band(self, engines: int) -> int:
        """A pool's hysteresis band: it shrinks only to free more than this, and moves in no less."""
        return max(1, math.ceil(self.config.hysteresis * engines))

    def move(self, obs: ClusterObservation, target: dict[str, int], floor: dict[str, int], reasons: list[str]) -> None:
        """Where one pool grows, the other gives it what it holds beyond the largest of its last
        ``MOVE_MEMORY`` wishes (and its floor and min) at once: the controller moves those engines. A growth
        within the growing pool's hysteresis band moves nothing unless the feedback's floor asks for it."""
        for grow, give in (("prefill", "decode"), ("decode", "prefill")):
            provisioned = obs.pool(grow).provisioned
            growth = target[grow] - provisioned
            if growth <= 0:
                continue
            band = self._band(provisioned)
            if growth < band and floor[grow] <= provisioned:
                reasons.append(
                    f"move: none ({grow} grows by {growth}, within its hysteresis band of {band}, and no "
                    "measured breach asks for it)"
                )
                continue
            since = obs.t - self._last_change.get(give, -math.inf)
            if since < self.config.scale_down_cooldown_s and floor[grow] <= provisioned:
                reasons.append(
                    f"move: none ({give} changed {since:.0f}s ago, within its scale-down cooldown of "
                    f"{self.config.scale_down_cooldown_s:g}s, and no measured breach of {grow} asks for it)"
                )
                continue
            index = 1 if give == "prefill" else 2
            recent = max(w[index] for w in itertools.islice(reversed(self._wishes), MOVE_MEMORY))
            keep = max(recent, floor[give], self.config.limits(give).min)
            count = min(growth, target[give] - keep)
            if count <= 0:
                continue
            reasons.append(
                f"move: {grow} grows by {growth}; {give} gives {count} of its {target[give]} (it wishes at most "
                f"{keep} over the last {MOVE_MEMORY} decisions): {give} {target[give]} -> {target[give] - count}"
            )
            target[give] -= count
            self._last_change[give] = obs.t
