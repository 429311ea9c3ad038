"""scripts/autoscale_study.py: its split search and its seeds (the simulations themselves: test_simulator)."""

from __future__ import annotations

from scripts import autoscale_study as study


def test_the_split_search_finds_the_peak_of_a_rise_then_fall_in_few_runs() -> None:
    for peak in (1, 2, 17, 32, 45, 63):
        runs: list[int] = []

        def score(p: int, peak=peak, runs=runs) -> float:
            runs.append(p)
            return -abs(p - peak)

        assert study.search_split(64, score) == peak
        assert len(set(runs)) <= 8 + 6 + 4  # of 63


def test_a_flat_top_picks_the_split_nearest_the_middle() -> None:
    assert study.search_split(64, lambda p: min(p, 40)) == 40
    assert study.search_split(64, lambda p: 1.0) == 32


def test_calibration_tuning_and_evaluation_seeds_are_disjoint() -> None:
    roles = [{study.CALIBRATION_SEED}, set(study.TUNING_SEEDS), set(study.EVALUATION_SEEDS)]
    assert all(a.isdisjoint(b) for i, a in enumerate(roles) for b in roles[i + 1 :])
    assert set(study.RATES) == {(f, m) for f in study.FAMILIES for m in study.MIX_NAMES}
