"""The autoscaling policy: observed load in, target prefill and decode replica counts out.

Pure code: no Ray, no clock, no I/O. The caller (the simulator, or the actuator
that runs next to a real cluster) builds a ``ClusterObservation`` every
``interval_s`` and calls ``AutoscalePolicy.decide``; the ``ScalingDecision`` it
gets back holds the two target counts and one line of arithmetic per step of the
reasoning. The policy keeps only its own memory (recent wishes, last change times),
so the same observations always give the same decisions.

How one decision is made (both pools at once). Each step has its module: the rate in
``orchestrator.autoscale.trend`` (and a schedule's or season's in ``forecast``), the demand and the
feedback in ``demand``, the limits, stability and moves in ``stability``; the observation and the
decision are ``observation``'s. Why each rule and constant is what it is, measured on simulated and
real loads: docs/autoscaling-research.md.

0. Rate. The last window's arrival rate; when it rose by more than Poisson noise
   (3 standard deviations) since the window before, the rise is extrapolated to
   when engines started now would serve (``startup_s`` + one interval), and that
   forecast holds while the rate keeps from falling, for at most that long. A ramp
   too gradual for one window's rise to stand out of the noise is found by the
   least-squares slope of the last windows' rates, over each of ``TREND_SPANS`` (2 and
   4 minutes: the shorter sees a fast swing sooner, the longer a slow one at all): when
   it is more than 3 standard errors above zero (Poisson counts) and the last window is
   not below the line by more than noise (the ramp goes on), the fitted rate is
   extrapolated over the same horizon (the largest such forecast counts). While any
   trend rises, no pool shrinks.
1. Prefill. An engine computes ``max_num_batched_tokens`` prompt tokens per pass;
   the profile says how long that takes, hence tokens/s per engine and a mean
   service time per request. The TTFT target, less the time an idle engine needs
   for a prompt (prefill, KV transfer, one decode step), is the wait that prompt
   affords, taken over ``LENGTH_QUANTILES`` lengths of a log-normal with the
   window's mean and cv^2 (a long prompt affords less; lengths late even unqueued
   are left out); the smallest N for which at most ``TTFT_TAIL`` of the requests
   wait past their budget in M/G/N is the prefill demand (Erlang C, its tail
   stretched by (1 + cv^2) / 2 for the spread of the prompt lengths). Queued prompt tokens add engines to clear them
   within one interval plus an engine's startup time (within one interval of their serving at a cold start).
2. Decode. The largest batch whose step time is within ``target_utilization`` of
   the ITL target and whose sequences fill at most that fraction of the KV cache
   is the batch one engine should hold; Little's law (concurrency = rate x output tokens x step
   time) gives the engines. Requests waiting for a slot (vLLM's waiting gauge of the
   decode engines: prefilled requests not admitted yet, and those whose KV loads) add
   engines. At a cold start (``cold_start``), the prompts prefill clears out of its backlog reach decode at
   the rate they clear, on top of the arrivals: the engines beyond both pools' needs for the rate are split
   between clearing the backlog and decoding what it releases, so that decode holds what prefill hands it
   (``drain``).
3. Feedback. A measured p90 TTFT or ITL above its target forbids shrinking the
   pool to blame (decode, when the requests waiting for a decode slot wait, by
   Little's law, more than ``DECODE_BLAME_SHARE`` of the TTFT target; else prefill)
   and adds one engine to it, so a wrong profile cannot hold the cluster in breach.
4. Limits: each pool within its min/max, both within ``max_engines`` (shared in
   proportion to what each needs for the arrival rate when they do not fit: queues are served by
   the split, not allowed to skew it).
5. Stability. Growing is allowed once ``scale_up_cooldown_s`` has passed since the
   pool's last change. Shrinking goes to the largest wish of the last
   ``scale_down_cooldown_s`` (so a burst that fades is not forgotten at once),
   only after that long since the pool's last change (or since the first window:
   a cluster just started is not shrunk on one cold sample), and only when it frees more
   than ``hysteresis`` of the pool (and at least one engine). Burst guard: a pool
   shrinks only to its demand plus ``burst_guard`` of the largest one-interval
   rise of its demand in the last ``burst_memory_s``, so that a burst like the
   last one finds part of its engines still serving while the rest start
   (bursts come at random; holding all of it would cost what scaling saves).
   A pool scaled by hand (``pdserve scale``; ``scaled_by_hand``) counts as changed at the
   next decision: it is not shrunk again before ``scale_down_cooldown_s``.
6. Moves (``moves``: the spec lets ready engines change pool, ``ClusterSpec.move_problem``).
   The ratio follows load in seconds, the fleet size in minutes: when one pool grows,
   the other gives it the engines it holds beyond its own demand (the largest wish of
   its last ``MOVE_MEMORY`` decisions, never below its min) at once, without waiting
   for its scale-down cooldown, hysteresis or burst guard: the controller moves them
   (``rules.moves_for``), and what the growth needs beyond them it starts. A growth
   smaller than the growing pool's hysteresis band moves nothing unless the feedback
   asked for it: a window's noise in the wishes would otherwise trade engines back
   and forth, and each trade takes from the giving pool what its own band kept. A pool's
   reserve is thus shared: a burst of the other pool takes it in seconds, and its own
   takes it back the same way. The memory of a few decisions keeps one noisy window from
   moving engines back and forth, and a pool that changed within its scale-down cooldown
   gives nothing unless a measured breach of the other asks: load near a pool's edge would
   otherwise move an engine back and forth every few windows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from orchestrator.autoscale.demand import decode_demand, drain, feedback, prefill_demand
from orchestrator.autoscale.forecast import Forecaster, forecaster_of
from orchestrator.autoscale.observation import ClusterObservation, ScalingDecision
from orchestrator.autoscale.stability import Stability, clamp, fit_budget, hold_budget
from orchestrator.autoscale.trend import ArrivalTrend

if TYPE_CHECKING:
    from collections.abc import Iterable

    from orchestrator.autoscale.config import AutoscalingConfig
    from orchestrator.autoscale.profile import PerformanceProfile

logger = logging.getLogger(__name__)

__all__ = ["AutoscalePolicy", "StaticPolicy"]


class AutoscalePolicy:
    """Decides both pools' sizes every interval; see the module docstring for the arithmetic."""

    def __init__(
        self,
        config: AutoscalingConfig,
        profile: PerformanceProfile,
        moves: bool = False,
        forecaster: Forecaster | None = None,
        cold_start: bool = True,
    ) -> None:
        self.config = config
        self.profile = profile
        self.moves = moves  # engines move between the pools (the spec's role_moves; ClusterSpec.move_problem)
        # The pools start at the spec's sizes, sized for no demand (a cluster just up): a backlog in the first
        # scale_down_cooldown_s is the start falling short (demand.prefill_demand). False: they start sized.
        self.cold_start = cold_start
        # a schedule's or season's rates a start-up ahead (orchestrator.autoscale.forecast); None: reacting only
        self.forecaster = forecaster if forecaster is not None else forecaster_of(config)
        self._trend = ArrivalTrend(config.interval_s, profile.engine.startup_s + config.interval_s)
        self._stability = Stability(config)

    def scaled_by_hand(self, roles: Iterable[str]) -> None:
        """Pools someone else resized (``pdserve scale``): the next decision counts them as changed then,
        so the policy does not undo a hand's scale-up before ``scale_down_cooldown_s``."""
        self._stability.scaled_by_hand(roles)

    def _forecast_rate(self, obs: ClusterObservation, reasons: list[str]) -> float:
        """The arrival rate one startup time ahead: the largest of the trends (``ArrivalTrend``) and of what a
        schedule or season expects (``forecaster``), as far as it is trusted."""
        rate = self._trend.rate(obs.t, obs.arrival_rate_rps, reasons)
        if self.forecaster is None or obs.clock_s is None:
            return rate
        window = self.config.interval_s
        horizon = self.profile.engine.startup_s + window
        expected, why = self.forecaster.ahead(obs.clock_s, horizon, obs.arrival_rate_rps, window)
        if why is not None and expected > rate:
            reasons.append(why)
            return expected
        return rate

    def decide(self, obs: ClusterObservation) -> ScalingDecision:
        cfg, prof = self.config, self.profile
        reasons: list[str] = []
        watched_s = self._stability.watch(obs.t)
        rate = self._forecast_rate(obs, reasons)
        cold = self.cold_start and watched_s < cfg.scale_down_cooldown_s
        (prefill, prefill_rate, backlog), (decode, decode_rate) = (
            prefill_demand(cfg, prof, obs, rate, cold, reasons),
            decode_demand(cfg, prof, obs, rate, reasons),
        )
        if backlog is not None:
            prefill, decode = drain(cfg, prof, obs, backlog, prefill, decode, reasons)
        floor = feedback(cfg, obs, reasons)
        wish = {role: max(want, floor[role]) for role, want in (("prefill", prefill), ("decode", decode))}
        clamp(cfg, wish, floor, reasons)
        wish = fit_budget(cfg, wish, {"prefill": prefill_rate, "decode": decode_rate}, reasons)

        self._stability.remember(obs.t, wish)
        target = self._stability.settle(obs, wish, floor, self._trend.rising, reasons)
        if self.moves:
            self._stability.move(obs, target, floor, reasons)
        hold_budget(cfg, obs, target, reasons)
        decision = ScalingDecision(obs.t, target["prefill"], target["decode"], reasons)
        for line in reasons:
            logger.info("autoscale t=%.1f %s", obs.t, line)
        return decision


class StaticPolicy:
    """Fixed pool sizes: the baseline the autoscaler is judged against."""

    def __init__(self, prefill: int, decode: int) -> None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"a static split needs at least one engine per pool (got {prefill}:{decode})")
        self.prefill, self.decode = prefill, decode

    def decide(self, obs: ClusterObservation) -> ScalingDecision:
        return ScalingDecision(obs.t, self.prefill, self.decode, [f"static {self.prefill}:{self.decode}"])
