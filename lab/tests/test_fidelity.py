"""lab/fidelity.py: the cluster-against-simulator comparison (its replay runs in
tests/integration/test_profile.py) and the mean of the profiles before and after a replay
(tests: test_validate_simulator.py)."""

from __future__ import annotations

import pytest

from lab import fidelity
from orchestrator.autoscale import traces
from tests.unit.test_simulator import make_profile


def test_fidelity_compares_quantiles_and_judges_the_tolerance():
    from types import SimpleNamespace

    measured = [{"ttft_s": float(i), "itl_s": 0.1} for i in range(1, 11)]
    simulated = [SimpleNamespace(ttft_s=1.1 * i, itl_s=0.125) for i in range(1, 11)]

    rows = fidelity.compare(measured, simulated)

    assert list(rows) == ["TTFT p50", "TTFT p90", "ITL p50", "ITL p90"]
    assert rows["TTFT p50"] == {"cluster_s": 6.0, "simulator_s": 6.6, "ratio": 1.1}
    assert rows["TTFT p90"]["cluster_s"] == 10.0 and rows["ITL p90"]["ratio"] == 1.25
    assert not fidelity.within(rows)  # ITL 25 % over
    assert fidelity.within(rows, tolerance=0.25)


def test_fidelity_capacity_is_engines_over_the_mixes_mean_prefill_time():
    profile = make_profile(prefill_s_per_token=0.002)
    mix = traces.LengthMix("fixed", ((1.0, traces.LengthDist(250, 0.0, 250, 250), traces.LengthDist(8, 0.0, 8, 8)),))

    assert fidelity.prefill_capacity_rps(profile, 1, mix) == pytest.approx(2.0)  # 0.5 s per prompt
    assert fidelity.prefill_capacity_rps(profile, 3, mix) == pytest.approx(6.0)
