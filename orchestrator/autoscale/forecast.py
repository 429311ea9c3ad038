"""What the arrival rate will be when engines started now serve: a schedule the user writes, or the daily and
weekly season of the cluster's own arrivals, discounted by how well it has matched what was measured.

A reacting policy sizes the pools for the load it sees (``policy``); engines take a start-up to serve, so a
load that rises faster than that finds them late. A forecast moves the rise earlier:

* ``Schedule``: rates by time of day and weekday (the spec's ``autoscaling.schedule``), e.g. 80 req/s on
  weekdays 08:00-18:00, 20 req/s otherwise.
* ``Season``: the measured rate of every quarter hour of the week and of the day, an exponentially weighted
  mean of what each was on the days seen; it answers for a quarter hour once it has seen it on ``MIN_DAYS``
  days (of the week once seen on as many weeks). Kept across controller restarts (``to_json``).

``Forecaster.ahead(clock_s, horizon_s, measured)`` gives the rate to size for, never below the one measured:
the forecast lifts the sizing where it says more is coming, it never holds the pools below what the load
needs now. Its weight (``trust``) follows how well the forecast of the last windows matched the rate measured
in them: none before ``MIN_TRUST_WINDOWS`` windows were judged, whole under a median relative error of
``TRUSTED_ERROR``, none over ``DISTRUSTED_ERROR``; so a schedule the measured load contradicts is not followed.
Pure code: clocks are given.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.autoscale.config import AutoscalingConfig

__all__ = ["DAYS", "Forecaster", "Schedule", "ScheduleRule", "Season", "forecaster_of"]

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday
BUCKET_S = 900.0  # a season's resolution: a quarter of an hour
MIN_DAYS = 2  # a season answers for a quarter hour seen on this many days (or weeks, for the weekly one)
SEASON_WEIGHT = 0.5  # a new day's rate of a quarter hour against what the season held
TRUSTED_ERROR, DISTRUSTED_ERROR = 0.25, 0.6  # median relative error of the forecast: whole weight, none
TRUST_WINDOWS = 40  # decisions the trust is judged over (10 minutes at 15 s)
MIN_TRUST_WINDOWS = 4  # windows a forecast is judged on before it has any weight


def weekday(clock_s: float, utc_offset_s: float = 0.0) -> tuple[int, float]:
    """(day of the week, 0 = Monday; seconds into that day) of an epoch time, ``utc_offset_s`` east of UTC."""
    local = clock_s + utc_offset_s
    days = math.floor(local / DAY_S)
    return (days + _EPOCH_WEEKDAY) % 7, local - days * DAY_S


@dataclass(frozen=True)
class ScheduleRule:
    """``rps`` from ``start_s`` to ``end_s`` seconds into each day of ``days`` (an end before the start runs
    past midnight)."""

    rps: float
    start_s: float = 0.0
    end_s: float = DAY_S
    days: tuple[int, ...] = tuple(range(7))

    def covers(self, day: int, second: float) -> bool:
        if self.start_s <= self.end_s:
            return day in self.days and self.start_s <= second < self.end_s
        # past midnight: the evening of one of its days, or the morning after one
        return (day in self.days and second >= self.start_s) or ((day - 1) % 7 in self.days and second < self.end_s)


@dataclass(frozen=True)
class Schedule:
    """The user's rates by time of day and weekday; the first rule that covers a time gives its rate."""

    rules: tuple[ScheduleRule, ...]
    utc_offset_s: float = 0.0

    def rate_at(self, clock_s: float) -> float | None:
        day, second = weekday(clock_s, self.utc_offset_s)
        return next((rule.rps for rule in self.rules if rule.covers(day, second)), None)

    @classmethod
    def from_spec(cls, entries: Sequence[Any], utc_offset_s: float = 0.0) -> Schedule:
        """From the spec's entries (``orchestrator.autoscale.config.ScheduleEntry``)."""
        return cls(
            tuple(
                ScheduleRule(e.rps, _seconds(e.start), _seconds(e.end) or DAY_S, tuple(DAYS.index(d) for d in e.days))
                for e in entries
            ),
            utc_offset_s,
        )


def _seconds(hh_mm: str) -> float:
    hours, minutes = hh_mm.split(":")
    return int(hours) * 3600.0 + int(minutes) * 60.0


@dataclass
class Season:
    """The measured rate of each quarter hour of the day and of the week (see the module's docstring)."""

    daily: dict[int, tuple[float, int]] = field(default_factory=dict)  # bucket -> (rate, days seen)
    weekly: dict[int, tuple[float, int]] = field(default_factory=dict)
    _open: dict[str, Any] = field(default_factory=dict)  # the quarter hour being measured: its key and sums

    def observe(self, clock_s: float, rate: float, window_s: float) -> None:
        """One window's measured rate; a quarter hour enters the season once it is over."""
        key = math.floor(clock_s / BUCKET_S)
        if self._open.get("key") not in (None, key):
            self._close()
        if self._open.get("key") != key:
            self._open = {"key": key, "arrivals": 0.0, "seconds": 0.0}
        self._open["arrivals"] += rate * window_s
        self._open["seconds"] += window_s

    def _close(self) -> None:
        key, seconds = self._open["key"], self._open["seconds"]
        if seconds < BUCKET_S / 2:  # seen for less than half of it (a restart): not a measurement
            return
        rate = self._open["arrivals"] / seconds
        per_day, per_week = int(DAY_S // BUCKET_S), int(WEEK_S // BUCKET_S)
        for table, bucket in ((self.daily, key % per_day), (self.weekly, (key + _EPOCH_WEEKDAY * per_day) % per_week)):
            old, seen = table.get(bucket, (rate, 0))
            table[bucket] = ((1 - SEASON_WEIGHT) * old + SEASON_WEIGHT * rate if seen else rate, seen + 1)

    def rate_at(self, clock_s: float) -> float | None:
        key = math.floor(clock_s / BUCKET_S)
        per_day, per_week = int(DAY_S // BUCKET_S), int(WEEK_S // BUCKET_S)
        weekly = self.weekly.get((key + _EPOCH_WEEKDAY * per_day) % per_week)
        if weekly is not None and weekly[1] >= MIN_DAYS:
            return weekly[0]
        daily = self.daily.get(key % per_day)
        return daily[0] if daily is not None and daily[1] >= MIN_DAYS else None

    def to_json(self) -> dict[str, Any]:
        return {"daily": {str(k): list(v) for k, v in self.daily.items()},
                "weekly": {str(k): list(v) for k, v in self.weekly.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Season:
        def table(name: str) -> dict[int, tuple[float, int]]:
            return {int(k): (float(v[0]), int(v[1])) for k, v in data.get(name, {}).items()}

        return cls(table("daily"), table("weekly"))


@dataclass
class Forecaster:
    """A schedule and/or a season, and the trust each has earned (see the module's docstring)."""

    schedule: Schedule | None = None
    season: Season | None = None
    _said: deque[tuple[float, float]] = field(default_factory=deque)  # (for the clock, forecast rate) said
    _errors: deque[float] = field(default_factory=lambda: deque(maxlen=TRUST_WINDOWS))

    def _rate_at(self, clock_s: float) -> float | None:
        if self.schedule is not None and (rate := self.schedule.rate_at(clock_s)) is not None:
            return rate
        return self.season.rate_at(clock_s) if self.season is not None else None

    @property
    def trust(self) -> float:
        """The forecast's weight, 0-1, from the median relative error of its last windows."""
        if len(self._errors) < MIN_TRUST_WINDOWS:
            return 0.0  # a forecast earns its weight: a wrong one is never followed on its word alone
        error = statistics.median(self._errors)
        return min(1.0, max(0.0, (DISTRUSTED_ERROR - error) / (DISTRUSTED_ERROR - TRUSTED_ERROR)))

    def ahead(self, clock_s: float, horizon_s: float, measured: float, window_s: float) -> tuple[float, str | None]:
        """The rate to size for now (never below ``measured``) and why, ``horizon_s`` ahead; learns from
        ``measured`` (the last window's rate, ending at ``clock_s``)."""
        now = self._rate_at(clock_s - window_s / 2)  # what it says of the window just measured
        if now is not None:
            self._errors.append(abs(measured - now) / max(measured, now, 1e-9))
        if self.season is not None:
            self.season.observe(clock_s - window_s, measured, window_s)
        # the largest rate it expects between now and when engines started now serve
        expected = [r for k in range(5) if (r := self._rate_at(clock_s + horizon_s * k / 4)) is not None]
        if not expected:
            return measured, None
        trust, peak = self.trust, max(expected)
        rate = max(measured, measured + trust * (peak - measured))
        if rate <= measured:
            return measured, None
        source = "schedule" if self.schedule is not None and self.schedule.rate_at(clock_s) is not None else "season"
        return rate, (
            f"forecast ({source}): {peak:.2f} req/s within {horizon_s:g}s, trusted {trust:.2f} "
            f"(median error {statistics.median(self._errors) if self._errors else 0.0:.2f}); sized for {rate:.2f}"
        )


def forecaster_of(config: AutoscalingConfig, season: Season | None = None) -> Forecaster | None:
    """The spec's schedule and, with ``learn_season``, a season (``season``: one kept from before), or None."""
    schedule = Schedule.from_spec(config.schedule, config.schedule_utc_offset_h * 3600.0) if config.schedule else None
    if config.learn_season and season is None:
        season = Season()
    if schedule is None and not config.learn_season:
        return None
    return Forecaster(schedule, season if config.learn_season else None)
