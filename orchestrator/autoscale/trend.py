"""The arrival rate a policy sizes for when the load rises: step 0 of ``orchestrator.autoscale.policy``.

Engines started now serve a start-up later, so a rising load is sized for the rate expected then
(``horizon_s``: the engines' start-up plus one interval). ``ArrivalTrend`` keeps the last windows' rates and
reads two kinds of rise from them, each only where it stands out of the Poisson noise of a window's count:

- a step: the last window rose by more than ``TREND_SIGMAS`` standard deviations over the one before. The rise
  is extrapolated over the horizon, and that forecast holds while the rate keeps from falling, for at most the
  horizon (one window of a ramp may rise less than the noise while the ramp goes on);
- a ramp too gradual for one window's rise to show: the least-squares slope of the last windows' rates over
  each of ``TREND_SPANS`` is more than ``TREND_SIGMAS`` standard errors above zero and the last window is not
  below the line by more than noise. The shorter span sees a fast swing sooner, the longer a slow one at all;
  the fitted rate is extrapolated over the horizon and the largest such forecast counts.

While either rises, ``rising`` is set: the policy shrinks no pool.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

__all__ = ["TREND_SIGMAS", "TREND_SPANS", "ArrivalTrend"]

TREND_SIGMAS = 3.0  # a rise of the arrival rate beyond this many standard deviations of Poisson noise is a trend
TREND_SPANS = (8, 16)  # windows of arrival rates whose least-squares slope reads a ramp (2 and 4 min at 15 s)


class ArrivalTrend:
    """The last windows' arrival rates (``window_s`` each) and the forecast of a rise under way, ``horizon_s``
    ahead."""

    def __init__(self, window_s: float, horizon_s: float) -> None:
        self.window_s, self.horizon_s = window_s, horizon_s
        self.rising = False  # a trend rises now: no pool shrinks
        self._previous: float | None = None
        self._held: tuple[float, float] | None = None  # (made at t, forecast rate) of a rise under way
        self._rates: deque[tuple[float, float]] = deque(maxlen=max(TREND_SPANS))  # (t, arrival rate) for the slope

    def rate(self, t: float, rate: float, reasons: list[str]) -> float:
        """The window ending at ``t`` measured ``rate``: the larger of the step's forecast (``_step_forecast``)
        and of the ramps' over each of ``TREND_SPANS`` (``_slope_forecast``), where one is more than noise; the
        rate now where none is."""
        previous, self._previous = self._previous, rate
        self._rates.append((t, rate))
        self.rising = False
        if previous is None:
            return rate
        step = self._step_forecast(t, rate, previous, reasons)
        slopes = [self._slope_forecast(t, span) for span in TREND_SPANS]
        # The largest forecast; of equal ones, the shorter span's (the first).
        slope = max(filter(None, slopes), key=lambda s: s[0], default=None)
        if slope is not None:
            reasons.append(slope[1])
        self.rising = step > rate or slope is not None
        return max(step, slope[0] if slope else 0.0)

    def _slope_forecast(self, t: float, span: int) -> tuple[float, str] | None:
        """The rate ``horizon_s`` from now on the least-squares line through the last ``span`` windows' rates,
        and the reason, when its slope is more than ``TREND_SIGMAS`` standard errors above zero and the last
        window is not below the line by more than noise; else None."""
        window, horizon = self.window_s, self.horizon_s
        if len(self._rates) < span // 2:
            return None
        last = list(itertools.islice(self._rates, max(0, len(self._rates) - span), None))
        times, rates = [p[0] for p in last], [p[1] for p in last]
        mean_t, mean_rate = sum(times) / len(times), sum(rates) / len(rates)
        spread = sum((x - mean_t) ** 2 for x in times)
        if spread <= 0 or mean_rate <= 0:
            return None
        slope = sum((x - mean_t) * (r - mean_rate) for x, r in zip(times, rates, strict=True)) / spread
        # A window's rate of a Poisson count has variance rate / window: the slope's standard error follows.
        error = math.sqrt(mean_rate / window / spread)
        if slope <= TREND_SIGMAS * error:
            return None
        fitted = mean_rate + slope * (t - mean_t)
        if rates[-1] < fitted - TREND_SIGMAS * math.sqrt(fitted / window):
            return None  # the last window fell below the line by more than noise: the ramp has ended
        forecast = fitted + slope * horizon
        return forecast, (
            f"trend: the last {len(rates)} windows rise {slope * 60:.2f} req/s per minute ({slope / error:.1f} "
            f"standard errors); {fitted:.2f} req/s now, {forecast:.2f} req/s expected in {horizon:g}s"
        )

    def _step_forecast(self, t: float, rate: float, previous: float, reasons: list[str]) -> float:
        """The rise of the last window over the one before, extrapolated, when it is more than noise.

        A forecast holds while the rise goes on (the rate does not fall by more than
        noise) and for at most its horizon: one window of a ramp may rise less than
        the noise while the ramp is still under way.
        """
        window, horizon = self.window_s, self.horizon_s
        # Poisson counts: a change under 3 standard deviations of the difference is noise.
        noise = TREND_SIGMAS * math.sqrt((rate + previous) * window) / window
        rise = rate - previous
        if rise > noise:
            forecast = rate + rise / window * horizon
            self._held = (t, forecast)
            reasons.append(
                f"trend: {previous:.2f} -> {rate:.2f} req/s in {window:g}s (noise {noise:.2f}); "
                f"{forecast:.2f} req/s expected in {horizon:g}s, when new engines serve"
            )
            return forecast
        if self._held is not None and rise >= -noise and t - self._held[0] <= horizon and self._held[1] > rate:
            reasons.append(
                f"trend: still rising ({previous:.2f} -> {rate:.2f} req/s); the forecast of "
                f"{t - self._held[0]:.0f}s ago holds: {self._held[1]:.2f} req/s"
            )
            return self._held[1]
        self._held = None
        return rate
