"""The autoscaler's forecast: a schedule's rates by time of day and weekday, a learned season, the trust each
earns from what was measured, the policy sizing a start-up ahead with them, and the season kept across restarts."""

from __future__ import annotations

import os
from typing import Any

import pytest

from orchestrator.autoscale.config import AutoscalingConfig
from orchestrator.autoscale.forecast import (
    BUCKET_S,
    DAY_S,
    DISTRUSTED_ERROR,
    MIN_TRUST_WINDOWS,
    Forecaster,
    Schedule,
    Season,
    weekday,
)
from orchestrator.autoscale.policy import AutoscalePolicy
from orchestrator.errors import SpecError
from tests.unit.orchestrator.autoscale.test_autoscale_policy import CONFIG, linear_profile, observe

MONDAY = 4 * DAY_S  # 1970-01-05, a Monday, 00:00 UTC
HOUR = 3600.0


def config(**overrides: Any) -> AutoscalingConfig:
    return AutoscalingConfig.model_validate({**CONFIG.model_dump(), "interval_s": 15.0, **overrides})


WORKDAY = [
    {"rps": 80.0, "start": "08:00", "end": "18:00", "days": ["mon", "tue", "wed", "thu", "fri"]},
    {"rps": 30.0, "start": "22:00", "end": "02:00", "days": ["fri"]},
    {"rps": 10.0},
]


def test_a_schedule_gives_the_first_rule_covering_a_weekday_and_time_in_its_zone():
    schedule = Schedule.from_spec(config(schedule=WORKDAY).schedule)
    assert weekday(MONDAY) == (0, 0.0)
    assert schedule.rate_at(MONDAY + 9 * HOUR) == 80.0
    assert schedule.rate_at(MONDAY + 18 * HOUR) == 10.0  # the end is not in it
    assert schedule.rate_at(MONDAY + 5 * DAY_S + 9 * HOUR) == 10.0  # Saturday
    assert schedule.rate_at(MONDAY + 4 * DAY_S + 23 * HOUR) == 30.0  # Friday evening
    assert schedule.rate_at(MONDAY + 5 * DAY_S + 1 * HOUR) == 30.0  # past midnight, into Saturday
    assert schedule.rate_at(MONDAY + 5 * DAY_S + 23 * HOUR) == 10.0
    shifted = Schedule.from_spec(config(schedule=WORKDAY, schedule_utc_offset_h=2).schedule, 2 * HOUR)
    assert shifted.rate_at(MONDAY + 6.5 * HOUR) == 80.0  # 08:30 two hours east of UTC


def test_a_bad_schedule_is_refused_naming_the_field():
    with pytest.raises((SpecError, ValueError), match="start"):
        config(schedule=[{"rps": 1.0, "start": "8am"}])
    with pytest.raises((SpecError, ValueError), match="days"):
        config(schedule=[{"rps": 1.0, "days": ["monday"]}])


def test_a_season_answers_for_a_quarter_hour_seen_on_two_days_and_survives_a_restart():
    season = Season()

    def day(offset: float, rates: dict[int, float]) -> None:
        for hour in range(24):
            for k in range(int(HOUR // 15)):
                season.observe(MONDAY + offset + hour * HOUR + k * 15, rates.get(hour, 5.0), 15.0)

    day(0, {9: 50.0})
    assert season.rate_at(MONDAY + DAY_S + 9 * HOUR) is None  # one day: not yet
    day(DAY_S, {9: 70.0})
    season.observe(MONDAY + 2 * DAY_S, 5.0, 15.0)  # closes the last quarter hour
    assert season.rate_at(MONDAY + 2 * DAY_S + 9 * HOUR) == pytest.approx(60.0)  # weighted: 50 then 70
    assert season.rate_at(MONDAY + 2 * DAY_S + 3 * HOUR) == pytest.approx(5.0)
    again = Season.from_json(season.to_json())
    assert again.rate_at(MONDAY + 2 * DAY_S + 9 * HOUR) == pytest.approx(60.0)
    partial = Season()
    partial.observe(MONDAY, 99.0, BUCKET_S / 4)  # a quarter hour seen a quarter of: no measurement
    partial.observe(MONDAY + BUCKET_S, 1.0, 15.0)
    assert partial.daily == {}


def test_a_forecast_lifts_the_rate_to_the_peak_ahead_and_never_below_the_measured():
    forecaster = Forecaster(Schedule.from_spec(config(schedule=WORKDAY).schedule))
    before = MONDAY + 8 * HOUR - 60  # a minute before the workday
    for k in range(MIN_TRUST_WINDOWS, 0, -1):  # off hours as scheduled: it earns its weight (none before)
        rate, why = forecaster.ahead(before - 60 - k * 15.0, 90.0, 10.0, 15.0)
        assert (rate, why) == (10.0, None)
    rate, why = forecaster.ahead(before, 90.0, 10.0, 15.0)
    assert rate == 80.0 and "schedule" in why
    rate, why = forecaster.ahead(MONDAY + 12 * HOUR, 90.0, 95.0, 15.0)  # busier than scheduled: the measured
    assert (rate, why) == (95.0, None)


def test_a_schedule_the_measured_load_contradicts_loses_its_weight_and_a_matching_one_keeps_it():
    wrong = Forecaster(Schedule.from_spec(config(schedule=[{"rps": 80.0}]).schedule))
    for k in range(MIN_TRUST_WINDOWS + 4):
        rate, _ = wrong.ahead(MONDAY + k * 15, 90.0, 10.0, 15.0)  # 10 req/s measured, 80 scheduled
    assert wrong.trust == 0.0 and rate == 10.0
    right = Forecaster(Schedule.from_spec(config(schedule=[{"rps": 80.0}]).schedule))
    for k in range(MIN_TRUST_WINDOWS + 4):
        right.ahead(MONDAY + k * 15, 90.0, 78.0 + (k % 3), 15.0)
    assert right.trust == 1.0
    assert 0 < DISTRUSTED_ERROR < 1


def test_the_policy_sizes_a_start_up_ahead_for_a_scheduled_rise_and_a_wrong_schedule_changes_nothing():
    profile = linear_profile()  # a 60-s start-up: the horizon is 75 s at 15-s decisions
    rise = [{"rps": 40.0, "start": "09:00", "end": "17:00"}, {"rps": 4.0}]

    def decisions(policy: AutoscalePolicy, start: float, rates: list[float]) -> list[Any]:
        prefill = decode = 2
        out = []
        for k, rate in enumerate(rates):
            d = policy.decide(observe(k * 15.0, rate, prefill, decode, clock_s=start + k * 15.0))
            prefill, decode = d.prefill, d.decode
            out.append(d)
        return out

    rates = [4.0] * 12  # the last three minutes before 09:00, at the off-hours rate
    start = MONDAY + 9 * HOUR - len(rates) * 15.0
    scheduled = decisions(AutoscalePolicy(config(schedule=rise), profile), start, rates)
    reacting = decisions(AutoscalePolicy(config(), profile), start, rates)
    assert scheduled[-1].prefill + scheduled[-1].decode > reacting[-1].prefill + reacting[-1].decode
    assert any("forecast (schedule): 40.00 req/s" in r for r in scheduled[-1].reasons)
    assert all("forecast" not in r for d in scheduled[:6] for r in d.reasons)  # not before the horizon

    wrong = [{"rps": 40.0}]  # all day, where 4 req/s come
    contradicted = decisions(AutoscalePolicy(config(schedule=wrong), profile), start, rates * 4)
    plain = decisions(AutoscalePolicy(config(), profile), start, rates * 4)
    assert [(d.prefill, d.decode) for d in contradicted[-12:]] == [(d.prefill, d.decode) for d in plain[-12:]]


def test_the_autoscaler_keeps_its_learned_season_in_a_private_file_and_reads_it_after_a_restart(tmp_path):
    from orchestrator.autoscale.actuator import Autoscaler

    path = tmp_path / "seasons" / "cluster-model.json"

    def autoscaler() -> Autoscaler:
        return Autoscaler(config(learn_season=True), linear_profile(), "http://127.0.0.1:1", list, None,
                          season_path=path)  # fmt: skip

    first = autoscaler()
    season = first.policy.forecaster.season
    for day in range(2):
        for k in range(int(2 * BUCKET_S // 15)):
            season.observe(MONDAY + day * DAY_S + k * 15, 12.0, 15.0)
    season.observe(MONDAY + 3 * DAY_S, 1.0, 15.0)
    first._keep_season()
    assert path.is_file() and (os.stat(path).st_mode & 0o777) == 0o600
    again = autoscaler()
    assert again.policy.forecaster.season.rate_at(MONDAY + 5 * DAY_S + 60) == pytest.approx(12.0)
    assert Autoscaler(config(), linear_profile(), "http://127.0.0.1:1", list, None,
                      season_path=path).policy.forecaster is None  # fmt: skip
