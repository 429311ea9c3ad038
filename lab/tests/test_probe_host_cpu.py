"""The host CPU probe's arithmetic: tokens streamed in a window, and the per-token fit."""

from __future__ import annotations

import json

import pytest

from lab.probe_host_cpu import COLD_PROFILE, fit, per_unit, simulate_probe, steady, streamed_per_s


def test_tokens_are_counted_by_the_share_of_each_stream_inside_the_window():
    answers = [
        # first token at 10 s, last at 20 s: 100 chunks spread over 10 s, half of them inside [15, 25)
        {"sent_at": 9.5, "ttft_s": 0.5, "ended_at": 20.0, "chunks": 100},
        # entirely inside
        {"sent_at": 16.0, "ttft_s": 1.0, "ended_at": 19.0, "chunks": 30},
        {"failed": "refused"},
    ]
    tokens, requests = streamed_per_s(answers, 15.0, 25.0)
    assert tokens == pytest.approx((50 + 30) / 10)
    assert requests == pytest.approx(1 / 10)


def test_the_fit_is_cpu_seconds_per_token_over_the_idle_use():
    tokens = [100.0, 200.0, 300.0]
    assert fit(tokens, [0.0002 * t for t in tokens]) == pytest.approx(0.0002)


def test_an_api_servers_use_is_counted_beyond_its_idle_use():
    rows = [{"tokens_per_s": t, "cores": {"api@1": 0.1 + 0.0005 * t}} for t in (100.0, 200.0, 300.0)]
    assert per_unit(rows, {"api@1": 0.1}, "api@1", "tokens_per_s") == pytest.approx(0.0005)


def test_a_steady_load_is_poisson_at_its_rate():
    trace = steady(5.0, 200.0, 64, 120, seed=1)
    assert 900 < len(trace) < 1100
    assert all(r.prompt_tokens == 64 and r.output_tokens == 120 for r in trace)
    assert [r.t for r in trace] == sorted(r.t for r in trace)


def test_the_simulator_replays_each_load_of_a_probe_beside_the_cluster(tmp_path):
    probe = {
        "config": "configs/local-cpu-autoscale.yaml",
        "prompt": 64,
        "output": 120,
        "window": 40.0,
        "loads": [{"rate": 1.0, "ttft_p50_s": 0.2, "itl_p50_s": 0.03}],
    }
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))

    [row] = simulate_probe(str(path), COLD_PROFILE)

    assert row["rate"] == 1.0 and set(row) == {"rate", "ttft_p50_s", "itl_p50_s"}  # only what the cluster measured
    ttft = row["ttft_p50_s"]
    assert 0.1 < ttft["simulator"] < 0.5 and ttft["ratio"] == round(ttft["simulator"] / 0.2, 2)
