"""lab/autoscale_study.py and lab/study.py: the split search, the seeds, the tenants' merge and the bursts'
windows (the simulations themselves: tests/unit/orchestrator/autoscale/test_simulator.py)."""

from __future__ import annotations

import itertools

import pytest

from lab import autoscale_study as study
from lab import study as definitions
from orchestrator.autoscale import traces
from orchestrator.autoscale.observation import ClusterObservation, PoolObservation
from orchestrator.autoscale.traces import TraceRequest


def test_the_split_search_finds_the_peak_of_a_rise_then_fall_in_few_runs() -> None:
    for peak in (1, 2, 17, 32, 45, 63):
        runs: list[int] = []

        def score(p: int, peak=peak, runs=runs) -> float:
            runs.append(p)
            return -abs(p - peak)

        assert definitions.search_split(64, score) == peak
        assert len(set(runs)) <= 8 + 6 + 4  # of 63


def test_a_flat_top_picks_the_split_nearest_the_middle() -> None:
    assert definitions.search_split(64, lambda p: min(p, 40)) == 40
    assert definitions.search_split(64, lambda p: 1.0) == 32


def test_a_search_near_a_split_refines_around_it_only() -> None:
    runs: list[int] = []

    def score(p: int) -> float:
        runs.append(p)
        return -abs(p - 33)

    assert definitions.search_split(49, score, near=31) == 33
    assert min(runs) >= 31 - 6 and max(runs) <= 31 + 6 + 3  # no scan of every 8th split
    assert len(set(runs)) <= 7 + 6


def test_the_bounds_table_shows_each_bound_a_trace_has() -> None:
    static = {"slo_attainment": 0.977}
    row = {"family": "steady", "mix": "long-output", "seed": 11, "best_static": "35:29", "static": static}
    row |= {"ratio": 1.0, "slo_points": 0.0, "right_sized": {"ratio": 1.0, "slo_points": 0.0, "engines": 64}}
    row["target_sized"] = {"ratio": 0.4, "slo_points": -60.2, "engines": 49, "split": "27:22"}
    line = study.bounds_table([row]).splitlines()[-1]
    assert line == (
        "| steady | long-output | 11 | 35:29, 97.7 % | 1.00x, +0.0 | 1.00x, +0.0 (64 engines) "
        "| 0.40x, -60.2 (27:22) | - | - | - | - |"
    )
    row["load_reacting"] = {"ratio": 1.27, "slo_points": -1.8, "headroom": 1.1, "sqrt": True, "held": True}
    row["load_foreseeing"] = {"ratio": 0.9, "slo_points": -7.0, "headroom": 1.2, "sqrt": False, "held": False}
    assert (
        study.bounds_table([row])
        .splitlines()[-1]
        .endswith("| 1.27x, -1.8 (square-root, headroom 1.1) | 0.90x, -7.0 (linear, headroom 1.2, misses) |")
    )


def test_the_bounds_summary_averages_over_seeds_and_counts_an_oracles_misses() -> None:
    def row(seed: int, ratio: float, held: bool) -> dict:
        oracle = {"ratio": ratio, "slo_points": -2.0 if held else -8.0, "headroom": 1.2, "sqrt": False, "held": held}
        right = {"ratio": 1.2, "slo_points": -3.0, "engines": 48}
        return {
            "family": "tenants",
            "mix": "chat",
            "seed": seed,
            "ratio": 1.1,
            "slo_points": -1.0,
            "right_sized": right,
            "load_reacting": oracle,
            "load_foreseeing": oracle | {"held": True},
        }

    line = study.bounds_summary([row(11, 1.4, True), row(12, 1.6, False)]).splitlines()[-1]
    assert line == (
        "| tenants | chat | 1.10 [1.10, 1.10]x, -1.0 [-1.0, -1.0] | 1.20 [1.20, 1.20]x, -3.0 [-3.0, -3.0] | - | - "
        "| 1.50 [1.40, 1.60]x, -5.0 [-8.0, -2.0] (misses on 1 of 2) | 1.50 [1.40, 1.60]x, -5.0 [-8.0, -2.0] |"
    )


def test_calibration_tuning_evaluation_and_generalization_seeds_are_disjoint() -> None:
    roles = [{definitions.CALIBRATION_SEED}, *map(set, (definitions.TUNING_SEEDS, definitions.EVALUATION_SEEDS))]
    roles.append(set(definitions.GENERALIZATION_SEEDS))
    assert all(a.isdisjoint(b) for i, a in enumerate(roles) for b in roles[i + 1 :])
    study_rates = {(f, m) for f in definitions.STUDY_FAMILIES for m in definitions.MIX_NAMES}
    assert set(definitions.RATES) == study_rates | {(f, "tail") for f in definitions.GENERALIZATION}


def test_each_family_is_judged_against_its_own_target() -> None:
    assert definitions.meets("steady", 0.98, -1.0) and not definitions.meets("steady", 1.5, -1.1)
    assert definitions.meets("diurnal", 1.3, -5.0) and not definitions.meets("diurnal", 1.29, 0.0)
    assert definitions.meets("bursty", 1.0, -4.9) and not definitions.meets("bursty", 0.99, 0.0)
    assert definitions.meets("swing-fast", 1.0, -5.0) and not definitions.meets("cold-start", 0.9, 0.0)


def test_the_table_sets_the_autoscaler_with_moves_beside_it_without() -> None:
    static = {"slo_attainment": 0.98}
    row = {"family": "bursty", "mix": "chat", "seed": 11, "rate_rps": 33.62, "best_static": "41:23"}
    row |= {"static": static, "autoscale": {"slo_attainment": 0.96}, "ratio": 1.1, "slo_points": -2.0}
    row["no_moves"] = {"slo_attainment": 0.9, "ratio": 0.9, "slo_points": -8.0}
    line = study.table([row]).splitlines()[-1]
    assert line == (
        "| bursty | chat | 33.62 | 41:23 | 98.0 % | >= 1x, -5 | 96.0 % | 1.10x | -2.0 | 1/1 | 90.0 % | 0.90x "
        "| -8.0 | 0/1 |"
    )


def test_the_generalization_shapes_are_what_they_say() -> None:
    swing = definitions.make_trace("swing-fast", "tail", 1, rate=40.0)
    trough, peak = (sum(1 for r in swing if start <= r.t < start + 120) for start in (0, 840))
    assert 6 * trough < peak < 9 * trough  # 8x from the trough to the peak 15 min later
    prompts = sorted(r.prompt_tokens for r in swing)
    assert 500 < prompts[len(prompts) // 2] < 700 and prompts[-1] > 6000  # median ~600, a tail to 8k


def test_the_burst_oracle_takes_the_burst_split_from_its_lead_before_a_burst_to_its_end() -> None:
    def at(t: float) -> ClusterObservation:
        return ClusterObservation(t, 1.0, 100, 10, PoolObservation(1), PoolObservation(1))

    reacting = study.BurstOracle([(100.0, 400.0)], (40, 24), (10, 6), lead_s=0.0)
    foreseeing = study.BurstOracle([(100.0, 400.0)], (40, 24), (10, 6), lead_s=75.0)
    sizes = {t: (reacting.decide(at(t)), foreseeing.decide(at(t))) for t in (0.0, 30.0, 105.0, 399.0, 400.0)}
    assert [(r.prefill, f.prefill) for r, f in sizes.values()] == [(10, 10), (10, 40), (40, 40), (40, 40), (10, 10)]
    assert sizes[30.0][1].reasons == ["oracle: burst 40:24"]


def test_the_load_oracle_sizes_each_pool_to_its_work_at_once_or_ahead() -> None:
    # 10 min at 10 req/s, then 10 min at 30 req/s (every request 1,000 prompt tokens, 100 output tokens).
    calm = [TraceRequest(i / 10, 1000, 100) for i in range(6000)]
    busy = [TraceRequest(600 + i / 30, 1000, 100) for i in range(18000)]
    trace = calm + busy
    reacting = study.LoadOracle(trace, (30, 20), 64, headroom=1.0, lead_s=0.0)
    foreseeing = study.LoadOracle(trace, (30, 20), 64, headroom=1.0, lead_s=75.0)
    assert reacting.sizes(0.0) == reacting.sizes(300.0) == (10, 7)  # a third of the busy load's split
    assert reacting.sizes(900.0) == (30, 20)  # the best split at the busy load (its 95th percentile)
    assert reacting.sizes(560.0) == (10, 7) and foreseeing.sizes(560.0) == (30, 20)  # ahead of the rise
    assert reacting.decide(ClusterObservation(900.0, 30.0, 1000, 100, PoolObservation(1), PoolObservation(1))).reasons
    shared = study.LoadOracle(trace, (30, 20), 64, headroom=2.0, lead_s=0.0)
    assert shared.sizes(900.0) == (39, 25)  # 60 + 40 wished, the budget shared 3:2 (rounded up, then the rest)
    root = study.LoadOracle(trace, (30, 20), 64, headroom=1.0, lead_s=0.0, sqrt=True)
    assert root.sizes(900.0) == (30, 20)  # square-root staffing gives the best split at the same load
    assert root.sizes(300.0)[0] > 10  # and more than a third of it at a third of the load


def test_the_best_headroom_is_searched_down_to_the_first_miss_or_up_to_the_first_hold() -> None:
    static = {"slo_attainment": 0.96, "goodput_per_engine_hour": 100.0}

    def fleet(attained: dict[float, float]):
        tried: list[float] = []

        def run(headroom: float) -> dict:
            tried.append(headroom)
            return {"slo_attainment": attained[headroom], "goodput_per_engine_hour": 100.0 / headroom}

        return run, tried

    run, tried = fleet({1.2: 0.95, 1.1: 0.94, 1.05: 0.93, 1.0: 0.90})
    best = study.best_headroom(run, static, -5.0, sqrt=True)
    assert (best["headroom"], best["held"], best["sqrt"]) == (1.05, True, True) and tried == [1.2, 1.1, 1.05, 1.0]
    run, tried = fleet({1.2: 0.85, 1.3: 0.89, 1.4: 0.92})
    assert study.best_headroom(run, static, -5.0)["headroom"] == 1.4 and tried == [1.2, 1.3, 1.4]
    run, tried = fleet(dict.fromkeys((1.2, *study.LOAD_HEADROOMS_ABOVE), 0.5))
    assert study.best_headroom(run, static, -5.0) | {"ratio": 0} == {
        "headroom": 2.0, "held": False, "ratio": 0, "slo_points": -46.0, "summary": run(2.0)}  # fmt: skip


def test_the_smallest_fleet_that_holds_the_slo_is_the_last_before_it_misses_then_half_a_step() -> None:
    static = {"slo_attainment": 0.98}
    attained = {60: 0.97, 56: 0.95, 52: 0.931, 50: 0.94, 48: 0.90, 44: 0.97}
    seen: list[int] = []

    def run(size: int) -> dict:
        seen.append(size)
        return {"slo_attainment": attained[size]}

    assert study.smallest_holding(60, run, static) == (50, {"slo_attainment": 0.94})
    assert seen == [60, 56, 52, 48, 50]  # stops at the first miss, then tries half a step below the last held
    attained[50] = 0.92
    assert study.smallest_holding(60, run, static) == (52, {"slo_attainment": 0.931})
    assert study.smallest_holding(48, run, static) is None


def test_set_overrides_only_the_autoscalers_knobs_and_validates_them() -> None:
    spec, _ = definitions.load({"burst_memory_s": 3600.0, "burst_guard": 1.0})
    assert (spec.autoscaling.burst_memory_s, spec.autoscaling.burst_guard) == (3600.0, 1.0)
    for wrong in ({"max_engines": 32.0}, {"targets": 1.0}, {"nonsense": 1.0}):
        with pytest.raises(ValueError, match="not one of the autoscaler's knobs"):
            definitions.load(wrong)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        definitions.load({"burst_guard": 3.0})


def test_the_screen_compares_the_autoscaler_with_the_fixed_split_and_reuses_its_run(monkeypatch) -> None:
    from lab import autoscale_screen as screen

    short = definitions.make_trace("steady", "chat", 1)[:600]  # ~9 s of the hour: the arithmetic, not the load
    monkeypatch.setattr(screen, "make_trace", lambda family, mix, seed: short)
    row = screen.screen_one("steady", 1, (46, 18), {}, None)
    assert row["fixed"]["requests"] == 600 and row["met"] == definitions.meets(
        "steady", row["ratio"], row["slo_points"]
    )
    # Given the fixed split's run (the cache), only the autoscaler runs, and the comparison is with it.
    again = screen.screen_one("steady", 1, (46, 18), {}, {**row["fixed"], "goodput_per_engine_hour": 1.0})
    assert again["ratio"] == pytest.approx(row["ratio"] * row["fixed"]["goodput_per_engine_hour"])


def test_merged_tenants_keep_every_request_in_arrival_order() -> None:
    base = traces.poisson(2.0, 100.0, seed=1)
    tenant = traces.bursty(0.1, 100.0, burst_factor=10, mean_burst_s=20, mean_gap_s=40, seed=2)
    merged = definitions.merge(base, tenant)
    assert len(merged) == len(base) + len(tenant)
    assert [r.t for r in merged] == sorted(r.t for r in merged)


def test_burst_windows_are_where_the_bursty_trace_runs_at_the_burst_rate() -> None:
    trace = traces.bursty(2.0, 3600.0, burst_factor=4.0, mean_burst_s=120, mean_gap_s=300, seed=7)
    windows = definitions.burst_windows(3600.0, mean_burst_s=120, mean_gap_s=300, seed=7)
    assert len(windows) >= 3 and all(0 < start < end <= 3600.0 for start, end in windows)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows))
    inside = sum(end - start for start, end in windows)
    in_bursts = sum(1 for r in trace if any(start <= r.t < end for start, end in windows))
    assert in_bursts / inside == pytest.approx(8.0, rel=0.15)  # 4 x 2 req/s
    assert (len(trace) - in_bursts) / (3600.0 - inside) == pytest.approx(2.0, rel=0.15)
