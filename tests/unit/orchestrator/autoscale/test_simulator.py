"""The cluster simulator against queueing results with known answers, and its scaling mechanics.

One prefill engine serving one request per pass is a single-server queue: with
equal prompts (deterministic service) the mean wait is M/D/1's, with exponential
prompts M/M/1's. A decode batch whose step time grows linearly with its size
settles where Little's law says it must.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from orchestrator.autoscale import simulator as simulator_module
from orchestrator.autoscale import traces
from orchestrator.autoscale.policy import StaticPolicy
from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D
from orchestrator.autoscale.rules import new_replicas, retirement_order, take_back_order, warm_room, warm_to_stop
from orchestrator.autoscale.sim_cores import SPIN_S
from orchestrator.autoscale.sim_model import SharedCore, SimulationResult, SloTargets
from orchestrator.autoscale.simulator import SimOptions, Simulator, simulate
from orchestrator.autoscale.traces import TraceRequest
from testlib.profiles import INSTANT, TARGETS, Script, make_profile, poisson_trace


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_one_engine_with_fixed_prompts_waits_as_m_d_1():
    # Service 1 s (1000 tokens at 1 ms), arrivals 0.6/s: Wq = rho S / (2 (1 - rho)) = 0.75 s.
    trace = poisson_trace(0.6, 40_000, prompt=lambda rng: 1000)
    result = simulate(make_profile(), StaticPolicy(1, 1), trace, TARGETS, (1, 1))

    wait = mean(r.ttft_s for r in result.records) - 1.0 - INSTANT
    assert wait == pytest.approx(0.6 * 1.0 / (2 * 0.4), rel=0.05)
    assert len(result.records) == len(trace)


def test_one_engine_with_exponential_prompts_waits_as_m_m_1():
    # Mean service 1 s, arrivals 0.5/s: Wq = rho / (mu - lambda) = 1 s; time in system 1 / (mu - lambda) = 2 s.
    trace = poisson_trace(0.5, 40_000, prompt=lambda rng: max(1, round(rng.expovariate(1 / 1000))))
    result = simulate(make_profile(), StaticPolicy(1, 1), trace, TARGETS, (1, 1))

    assert mean(r.ttft_s for r in result.records) == pytest.approx(2.0, rel=0.06)
    # Utilisation: the engine computed lambda x S of every second.
    busy = sum(r.prompt_tokens * 0.001 for r in result.records) / result.duration_s
    assert busy == pytest.approx(0.5, rel=0.03)


def test_two_engines_share_the_load_least_loaded_first():
    trace = poisson_trace(0.6, 20_000, prompt=lambda rng: 1000)
    one = simulate(make_profile(), StaticPolicy(1, 1), trace, TARGETS, (1, 1))
    two = simulate(make_profile(), StaticPolicy(2, 1), trace, TARGETS, (2, 1))

    # M/D/2 at rho 0.3 barely queues (Wq ~ 0.04 s) where M/D/1 at rho 0.6 waits 0.75 s.
    assert mean(r.ttft_s for r in two.records) - 1.0 < 0.1 < mean(r.ttft_s for r in one.records) - 1.0


def test_prefill_passes_are_tallied_by_engine_and_bin_as_the_clusters_step_counters_read():
    # 1000-token prompts on one engine, 1 ms a token, 2 sequences a pass: one alone (1 s), two that came
    # during it together (2000 tokens in 2 s, each request's prefill 2 s), and one at 25 s, in another bin.
    profile = dataclasses.replace(make_profile(), engine=EngineLimits(2, 10**9, 10**9, 1, 0.0))
    trace = [TraceRequest(t, 1000, 1) for t in (0.0, 0.5, 0.5, 25.0)]
    result = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1))

    assert simulator_module.PASS_BIN_S == 10
    assert result.prefill_passes == {
        (0, 0): [2, 3000, 3, pytest.approx(3.0), pytest.approx(1.0 + 2 * 2.0)],
        (0, 20): [1, 1000, 1, pytest.approx(1.0), pytest.approx(1.0)],
    }


def test_decode_batch_settles_where_littles_law_says():
    # Step = 20 ms + 0.5 ms per extra sequence; lambda = 2/s, 100 tokens each.
    # Little: N = lambda x 100 x step(N)  =>  N = 2*100*0.0195 / (1 - 2*100*0.0005) = 39, step = 0.039 s.
    a, b = 0.020, 0.0005
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(a, b), max_num_seqs=10_000)
    trace = poisson_trace(2.0, 20_000, prompt=lambda rng: 10, output=lambda rng: 100)
    result = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1))

    expected_batch = 2 * 100 * (a - b) / (1 - 2 * 100 * b)
    assert mean(r.itl_s for r in result.records) == pytest.approx(a + b * (expected_batch - 1), rel=0.05)


def test_a_constant_step_gives_every_request_that_itl_and_output_x_step_in_decode():
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.03, 0.0), max_num_seqs=10_000)
    trace = poisson_trace(5.0, 2_000, prompt=lambda rng: 10, output=lambda rng: rng.randint(2, 300))
    result = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1))

    for r in result.records:
        assert r.itl_s == pytest.approx(0.03, rel=1e-6)
        # Its prompt's pass (10 x INSTANT), then it joins the batch when the step in progress ends.
        assert 0 <= r.done - r.arrival - r.output_tokens * 0.03 < 10 * INSTANT + 0.03 + 1e-9


def test_a_busy_decode_engine_loads_kv_and_takes_a_request_in_only_between_steps():
    base = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=100)
    profile = dataclasses.replace(base, engine=dataclasses.replace(base.engine, handoff_s=0.05))
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(1.02, 10, 5)]
    a, b = sorted(simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1)).records, key=lambda r: r.arrival)
    # Idle: A's KV arrives at 0.05 s and it joins at once; its steps end at 0.15, 0.25, ... s.
    assert a.ttft_s == pytest.approx(0.05 + 0.1, abs=1e-4)  # (and its 10 x INSTANT prefill)
    # B reaches the busy engine at 1.02 s: its load starts when the step ends (1.05 s), finishes at 1.10 s,
    # mid-step; it joins at 1.15 s, and its first step ends at 1.25 s.
    assert b.ttft_s == pytest.approx(1.25 - 1.02, abs=1e-4)
    assert b.itl_s == pytest.approx(0.1)


def test_slo_attainment_counts_requests_meeting_both_targets():
    trace = poisson_trace(0.6, 5_000, prompt=lambda rng: 1000)
    result = simulate(make_profile(), StaticPolicy(1, 1), trace, SloTargets(ttft_s=1.5, itl_s=1.0), (1, 1))
    summary = result.summary()

    meeting = sum(1 for r in result.records if r.ttft_s <= 1.5)
    assert summary["slo_attainment"] == pytest.approx(meeting / len(trace))
    assert summary["goodput_rps"] == pytest.approx(meeting / result.duration_s)
    # Two engines from t=0 to the last completion.
    assert summary["engine_hours"] == pytest.approx(2 * max(r.done for r in result.records) / 3600)
    assert summary["goodput_per_engine_hour"] == pytest.approx(meeting / summary["engine_hours"])


def test_same_seed_same_result_other_seed_other_result():
    profile = make_profile(decode_step=(0.02, 0.0001), max_num_seqs=64)

    def once(seed: int) -> dict:
        trace = traces.bursty(2.0, 600.0, mean_burst_s=60, mean_gap_s=120, seed=seed)
        return simulate(profile, StaticPolicy(2, 1), trace, SloTargets(3.0, 0.05), (2, 1)).to_json()

    assert once(1) == once(1)
    assert once(1) != once(2)
    assert traces.diurnal(1, 5, 600, period_s=600, seed=4) == traces.diurnal(1, 5, 600, period_s=600, seed=4)


def test_the_policy_sees_the_prefill_queue_as_vllms_waiting_gauge_shows_it():
    # Three 1000-token prompts (10 s each alone) arrive at once.
    trace = [TraceRequest(0.0, 1000, 1) for _ in range(3)]
    seen = {}
    for seqs in (1, 100):
        policy = Script([(1, 1)])
        profile = make_profile(prefill_s_per_token=0.01, max_num_seqs=seqs)
        Simulator(profile, policy, TARGETS, (1, 1), SimOptions(interval_s=5.0)).run(trace)
        seen[seqs] = [(round(o.t), o.prefill.queue_depth, o.prefill.queued_tokens) for o in policy.seen[:4]]
    # The first's pass began before the others arrived: vLLM's scheduler hears of them only when it ends.
    # Then, one sequence per pass: the second's pass leaves the third waiting.
    assert seen[1] == [(5, 0, 0), (10, 1, 1000), (15, 1, 1000), (20, 0, 0)]
    # Both fit the second pass: none waits.
    assert seen[100] == [(5, 0, 0), (10, 0, 0), (15, 0, 0), (20, 0, 0)]


def test_the_policy_sees_a_request_whose_kv_loads_as_waiting_for_decode_as_vllms_gauge_does():
    base = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=100)
    profile = dataclasses.replace(base, engine=dataclasses.replace(base.engine, handoff_s=12.0))
    policy = Script([(1, 1)])
    Simulator(profile, policy, TARGETS, (1, 1), SimOptions(interval_s=5.0)).run([TraceRequest(1.0, 10, 100)])
    # vLLM's scheduler keeps a request in its waiting queue until its KV is in (at 13 s); it runs until 23 s.
    seen = [(round(o.t), o.decode.queue_depth, o.decode.running) for o in policy.seen[:4]]
    assert seen == [(5, 1, 0), (10, 1, 0), (15, 0, 1), (20, 0, 1)]


def test_the_first_decision_comes_where_the_controllers_clock_ticks_into_the_trace():
    trace = poisson_trace(1.0, 30, prompt=lambda rng: 10)
    for first, times in ((None, [5, 10, 15]), (2.0, [2, 7, 12])):
        policy = Script([(1, 1)])
        Simulator(make_profile(), policy, TARGETS, (1, 1), SimOptions(interval_s=5.0, first_decision_s=first)).run(
            trace
        )
        assert [round(obs.t, 6) for obs in policy.seen[:3]] == times
    for bad in (0.0, 5.5):
        with pytest.raises(ValueError, match="first_decision_s must be in"):
            Simulator(
                make_profile(), Script([(1, 1)]), TARGETS, (1, 1), SimOptions(interval_s=5.0, first_decision_s=bad)
            )


def test_the_policy_sees_the_mean_lengths_as_a_clusters_counters_give_them():
    # A 1000-token prompt arrives at 1 s; its pass takes 10 s. vLLM counts its prompt tokens (and the
    # autoscaler its mean) when the prefill finishes, and its output tokens as they are generated (below).
    policy = Script([(1, 1)])
    profile = make_profile(prefill_s_per_token=0.01)
    Simulator(profile, policy, TARGETS, (1, 1), SimOptions(interval_s=5.0)).run([TraceRequest(1.0, 1000, 3)])
    seen = [(round(o.t), o.arrival_rate_rps, o.mean_prompt_tokens, o.mean_output_tokens) for o in policy.seen[:3]]
    assert seen == [(5, 0.2, 1.0, 1.0), (10, 0.0, 1.0, 1.0), (15, 0.0, 1000.0, 3.0)]


def test_the_mean_output_counts_the_tokens_generated_in_the_window_as_vllms_counter_does():
    # vLLM's vllm:generation_tokens_total grows at every step, running requests' tokens too; the autoscaler
    # divides its growth over a window by the requests finished in it. Steps of 0.1 s: A (120 tokens) runs
    # 0-12 s, B (20) 0-2 s, C (30) 6-9 s. Counted at the finish alone, the first window would read 20.
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=100)
    policy = Script([(1, 1)])
    trace = [TraceRequest(0.0, 10, 120), TraceRequest(0.0, 10, 20), TraceRequest(6.0, 10, 30)]
    Simulator(profile, policy, TARGETS, (1, 1), SimOptions(interval_s=5.0)).run(trace)
    means = [o.mean_output_tokens for o in policy.seen[:3]]
    assert means == pytest.approx([20 + 50, 50 + 30, 20], abs=1.0)  # B and A's first 50; A's next 50 and C; A's last
    assert sum(means) == pytest.approx(120 + 20 + 30, abs=1e-6)  # over the windows, every token once


def test_new_engines_serve_only_after_their_startup_time():
    policy = Script([(3, 1)])
    trace = poisson_trace(0.5, 200, prompt=lambda rng: 1000)
    result = simulate(make_profile(startup_s=45.0), policy, trace, TARGETS, (1, 1), SimOptions(interval_s=10.0))

    # Asked for at t=10; serving from t=55: the observations at 20..50 still count them as starting.
    by_t = {round(obs.t): obs.prefill for obs in policy.seen}
    assert (by_t[20].replicas, by_t[20].starting) == (1, 2)
    assert (by_t[60].replicas, by_t[60].starting) == (3, 0)
    assert result.timeline[0]["engines"] == 4


def test_removed_engines_finish_their_requests_before_stopping():
    # Long decodes (300 tokens x 0.1 s): the decode engine removed at t=10 still has requests running.
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=1000)
    trace = poisson_trace(2.0, 100, prompt=lambda rng: 10, output=lambda rng: 300)
    policy = Script([(1, 1)])
    result = simulate(profile, policy, trace, TARGETS, (1, 2), SimOptions(interval_s=10.0))

    assert len(result.records) == len(trace)
    assert max(r.itl_s for r in result.records) == pytest.approx(0.1)
    # Prefill and one decode engine ran to the end; the drained one until its last request, well before.
    end_h = max(r.done for r in result.records) / 3600
    assert 2 * end_h < result.engine_hours < 2.8 * end_h
    assert result.timeline[-1]["engines"] == 2


def test_scaling_follows_the_controllers_rules():
    """Newest retired first; a scale-up while an engine drains takes it back (it serves again at once),
    and starts a new engine, which serves only after its startup, for the rest (as ``Controller.scale``)."""
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=1000, startup_s=30.0)
    trace = poisson_trace(2.0, 100, prompt=lambda rng: 10, output=lambda rng: 300)
    # t=10: decode 2 -> 1 (decode-1 drains, busy for 30 s); t=20: 3 (decode-1 back, decode-2 starts)
    policy = Script([(1, 1), (1, 3)])
    sim = Simulator(profile, policy, TARGETS, (1, 2), SimOptions(interval_s=10.0))
    sim.run(trace)

    by_t = {round(obs.t): obs.decode for obs in policy.seen}
    assert (by_t[20].replicas, by_t[20].starting) == (1, 0)  # decode-1 draining
    assert (by_t[30].replicas, by_t[30].starting) == (2, 1)  # taken back at once; decode-2 starting
    assert (by_t[60].replicas, by_t[60].starting) == (3, 0)  # decode-2 serves after 30 s
    assert [(e.replica, e.state.value) for e in sim.decode] == [(0, "serving"), (1, "serving"), (2, "serving")]


def _kept_warm(sizes: list[tuple[int, int]], keep_warm_s: float, max_engines: int) -> tuple[Simulator, Script, float]:
    """Short decodes (10 tokens x 0.1 s) at 2 req/s for 100 s, decisions every 10 s, a 30-s start-up."""
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=1000, startup_s=30.0)
    trace = poisson_trace(2.0, 100, prompt=lambda rng: 10, output=lambda rng: 10)
    policy = Script(sizes)
    sim = Simulator(
        profile, policy, TARGETS, (1, 2), SimOptions(interval_s=10.0, keep_warm_s=keep_warm_s, max_engines=max_engines)
    )
    result = sim.run(trace)
    return sim, policy, result.engine_hours


def test_a_drained_engine_kept_warm_is_taken_back_without_a_start():
    """t=10: decode 2 -> 1; decode-1 drains in a second and is kept warm. t=40 (within keep_warm_s): 2 again,
    and decode-1 serves at once, where without keep_warm_s a new decode-1 serves only after its start-up."""
    sizes = [(1, 1), (1, 1), (1, 1), (1, 2)]
    sim, policy, _ = _kept_warm(sizes, keep_warm_s=60.0, max_engines=3)
    by_t = {round(obs.t): obs.decode for obs in policy.seen}
    assert (by_t[20].replicas, by_t[20].starting) == (1, 0)
    assert (by_t[50].replicas, by_t[50].starting) == (2, 0)  # taken back at t=40: serving at once
    assert [(e.replica, e.state.value) for e in sim.decode] == [(0, "serving"), (1, "serving")]

    sim, policy, _ = _kept_warm(sizes, keep_warm_s=0.0, max_engines=3)
    by_t = {round(obs.t): obs.decode for obs in policy.seen}
    assert (by_t[50].replicas, by_t[50].starting) == (1, 1)  # stopped once drained: started anew at t=40
    assert [(e.replica, e.state.value) for e in sim.decode] == [(0, "serving"), (1, "stopped"), (1, "serving")]


def test_an_engine_kept_warm_stops_after_keep_warm_s_and_its_hours_count():
    sim, _, hours = _kept_warm([(1, 1)], keep_warm_s=30.0, max_engines=3)
    _, _, hours_cold = _kept_warm([(1, 1)], keep_warm_s=0.0, max_engines=3)
    assert [e.state.value for e in sim.decode] == ["serving", "stopped"]
    warm = sim.decode[1]
    assert 40 < warm.stopped < 42  # drained within a second or two of t=10, then 30 s warm
    assert hours - hours_cold == pytest.approx(30 / 3600, abs=2 / 3600)


def test_an_engine_kept_warm_gives_its_room_to_a_scale_up_of_the_other_pool():
    """Budget 3: decode 2 -> 1 keeps decode-1 warm (1 + 1 targets, 1 warm); prefill 1 -> 2 at t=20 needs its
    room, so decode-1 stops then, not at t=70."""
    sim, _, _ = _kept_warm([(1, 1), (2, 1)], keep_warm_s=60.0, max_engines=3)
    assert sim.decode[1].stopped == pytest.approx(20.0)
    assert [e.state.value for e in sim.prefill] == ["serving", "serving"]
    sim, _, _ = _kept_warm([(1, 1)], keep_warm_s=60.0, max_engines=2)  # no room beyond the targets: not kept
    assert sim.decode[1].stopped < 12


def test_least_loaded_routes_as_the_proxy_scores_engines_and_rotates_ties():
    """The proxy's least_loaded (``proxy.policies.least_loaded``): the fewest of its legs on an engine plus the
    engine's waiting gauge (and, for decode, its KV use), ties going round. Two idle prefill engines share
    the calm minutes' requests, as a cluster's do (~55/45); every tie to the first would send ~75 % to
    prefill-0."""
    sim = Simulator(
        make_profile(), Script([(2, 2)]), TARGETS, (2, 2), SimOptions(routing=("least_loaded", "least_loaded"))
    )
    prefill_loads, decode_loads = simulator_module._prefill_loads, sim._decode_loads
    assert [sim._pick(sim.prefill, 0, prefill_loads).replica for _ in range(4)] == [0, 1, 0, 1]
    busy = sim.prefill[0]
    busy.queue.extend([object(), object()])  # a pass in flight and one behind it
    busy.gauge_waiting = (1, 100)
    assert (
        prefill_loads([busy]) == [3] and [sim._pick(sim.prefill, 0, prefill_loads).replica for _ in range(3)] == [1] * 3
    )
    sim.decode[0].transferring = 1  # a request whose KV loads: a leg, and in vLLM's waiting gauge
    assert decode_loads(sim.decode[:1]) == [2] and sim._pick(sim.decode, 1, decode_loads).replica == 1


def test_rules_retire_the_newest_and_the_not_yet_serving_first():
    engines = [("a", 0, True), ("b", 3, True), ("c", 1, False), ("d", 2, True)]
    order = retirement_order(engines, serving=lambda e: e[2], replica=lambda e: e[1])
    assert [e[0] for e in order] == ["c", "b", "d", "a"]
    assert new_replicas([0, 2, 3], 3) == [1, 4, 5]
    assert new_replicas([], 0) == []
    assert take_back_order([("b", 3), ("a", 1), ("c", 2)], replica=lambda e: e[1]) == [("a", 1), ("c", 2), ("b", 3)]
    assert warm_room(3, targets=2, warm=0) == 1 and warm_room(3, targets=3, warm=1) == -1
    assert warm_room(None, targets=2, warm=0) == 0  # no budget: nothing kept warm
    warm = [("late", 9.0), ("early", 2.0), ("middle", 5.0)]
    assert warm_to_stop(warm, since=lambda e: e[1], max_engines=4, targets=2) == [("early", 2.0)]
    assert warm_to_stop(warm, since=lambda e: e[1], max_engines=5, targets=2) == []


def test_trace_files_round_trip_and_bad_lines_are_named(tmp_path):
    trace = traces.poisson(3.0, 20.0, mix=traces.MIXES["long-output"], seed=2)
    path = tmp_path / "t.jsonl"
    traces.write_trace(trace, path)

    assert traces.read_trace(path) == trace
    path.write_text('{"t": 0, "prompt_tokens": 5, "output_tokens": 2}\n{"t": 1, "prompt": 5}\n')
    with pytest.raises(traces.TraceError, match=r"t.jsonl:2: expected"):
        traces.read_trace(path)


def test_length_mixes_have_their_advertised_means():
    rng_trace = traces.poisson(50.0, 400.0, mix=traces.MIXES["long-prompt"], seed=3)
    prompts = [r.prompt_tokens for r in rng_trace]
    # 75 % chat (mean 2000, clipped) + 25 % documents (mean 12000): about 4500.
    assert mean(prompts) == pytest.approx(0.75 * 2000 + 0.25 * 12000, rel=0.1)
    assert not math.isnan(mean(r.output_tokens for r in rng_trace))
    heavy = traces.poisson(50.0, 400.0, mix=traces.MIXES["heavy"], seed=3)
    prompts = sorted(r.prompt_tokens for r in heavy)
    assert max(prompts) == 8192 and max(r.output_tokens for r in heavy) == 2048  # clipped where promised
    assert prompts[int(0.99 * len(prompts))] > 8 * prompts[len(prompts) // 2]  # a heavy tail


def test_the_hand_off_adds_to_every_ttft_and_a_profile_without_it_reads_zero(tmp_path) -> None:
    import dataclasses

    import yaml

    from orchestrator.autoscale.profile import ProfileError, load_profile

    base = make_profile(prefill_s_per_token=0.001, decode_step=(0.02, 0.0), max_num_seqs=100)
    handed = dataclasses.replace(base, engine=dataclasses.replace(base.engine, handoff_s=0.25))
    trace = [TraceRequest(10.0 * i, 100, 4) for i in range(5)]  # far apart: nothing queues
    plain = simulate(base, StaticPolicy(1, 1), trace, TARGETS, (1, 1)).records
    slower = simulate(handed, StaticPolicy(1, 1), trace, TARGETS, (1, 1)).records
    for a, b in zip(plain, slower, strict=True):
        assert a.ttft_s == pytest.approx(0.1 + 0.02)  # prefill + first step
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.25) and b.itl_s == pytest.approx(a.itl_s)

    dataclasses.replace(handed, transfer=Grid1D([1.0, 2.0], [0.001, 0.001])).save(tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").engine.handoff_s == 0.25
    raw = yaml.safe_load((tmp_path / "p.yaml").read_text())
    del raw["engine"]["handoff_s"]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(raw))
    assert load_profile(tmp_path / "old.yaml").engine.handoff_s == 0.0  # profiles from before it: no hand-off
    raw["engine"]["handoff_s"] = -1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ProfileError, match="engine.handoff_s"):
        load_profile(tmp_path / "bad.yaml")


def test_engines_sharing_a_core_share_its_speed():
    profile = make_profile(prefill_s_per_token=0.001, decode_step=(0.03, 0.0), max_num_seqs=100)
    # A decodes 100 tokens; B's 5000-token prompt (5 s alone) starts while A decodes.
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(0.5, 5000, 1)]
    alone = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1)).records
    one_core = {"prefill-0": frozenset({0}), "decode-0": frozenset({0})}
    # Without the polling after a pass (spin_s=0): only work shares the core.
    shared = simulate(
        profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=one_core, spin_s=0.0)
    ).records
    two_cores = {"prefill-0": frozenset({0}), "decode-0": frozenset({1})}
    apart = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=two_cores)).records

    a, b = sorted(alone, key=lambda r: r.arrival)
    assert (a.done, b.ttft_s) == (pytest.approx(0.01 + 100 * 0.03), pytest.approx(5.0 + 0.03))
    assert sorted(apart, key=lambda r: r.arrival) == [a, b]  # cores of their own: as if alone
    a, b = sorted(shared, key=lambda r: r.arrival)
    # A's prefill and first 16.33 steps run alone; from 0.5 s its steps take 2x while B's pass runs
    # (B's pass, begun beside a busy decode engine, takes 2x: 10 s); B's one step runs alone again.
    steps_alone = (0.5 - 0.01) / 0.03
    assert a.done == pytest.approx(0.5 + (100 - steps_alone) * 0.06)
    assert b.ttft_s == pytest.approx(10.0 + 0.03)


def test_measured_slowdowns_beside_a_busy_neighbour_replace_the_even_split():
    profile = make_profile(prefill_s_per_token=0.001, decode_step=(0.03, 0.0), max_num_seqs=100)
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(0.5, 5000, 1)]  # as above
    one_core = {"prefill-0": frozenset({0}), "decode-0": frozenset({0})}
    measured = SharedCore(prefill=1.5, decode=3.5)
    a, b = sorted(
        simulate(
            profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=one_core, spin_s=0.0, shared=measured)
        ).records,
        key=lambda r: r.arrival,
    )
    # From 0.5 s A's steps take 3.5x while B's pass runs (1.5x: 7.5 s, ending at 8.0 s); then 1x again.
    steps_alone = (0.5 - 0.01) / 0.03
    steps_beside = 7.5 / (0.03 * 3.5)
    assert 7.5 + 0.03 <= b.ttft_s < 7.5 + 0.03 + 0.03 * 3.5  # and until A's step in progress ends
    assert a.done == pytest.approx(8.0 + (100 - steps_alone - steps_beside) * 0.03)
    with pytest.raises(ValueError, match="SharedCore.decode must be 1 or more"):
        SharedCore(decode=0.5)


def test_an_engine_on_its_own_core_slows_by_the_host_factor_while_one_elsewhere_computes():
    profile = make_profile(prefill_s_per_token=0.001, decode_step=(0.03, 0.0), max_num_seqs=100)
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(0.5, 5000, 1)]  # as above: A decodes while B prefills
    two_cores = {"prefill-0": frozenset({0}), "decode-0": frozenset({1})}
    host = SharedCore(host_prefill=1.2, host_decode=1.5)
    a, b = sorted(
        simulate(
            profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=two_cores, spin_s=0.0, shared=host)
        ).records,
        key=lambda r: r.arrival,
    )
    # B's pass begins beside A decoding on the other core: 1.2 x 5 s, to 6.5 s. A's steps take 1.5x from 0.5 s,
    # while B's pass runs, to its end; B's one step then runs beside nothing computing elsewhere.
    steps_alone = (0.5 - 0.01) / 0.03
    assert a.done == pytest.approx(0.5 + (100 - steps_alone) * 0.03 * 1.5)
    assert b.ttft_s == pytest.approx(6.0 + 0.03)


def start_beside_busy_decode(shared: SharedCore) -> tuple[Script, SimulationResult]:
    """decode-0 steps one request for 100 s (1000 tokens of 0.1 s); at t=10 prefill-1 (a 30-s start-up)
    starts on decode-0's core. The policy (what it saw) and the result."""
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=100, startup_s=30.0)
    cores = {"prefill-0": frozenset({0}), "decode-0": frozenset({1}), "prefill-1": frozenset({1})}
    policy = Script([(2, 1)])
    sim = Simulator(profile, policy, TARGETS, (1, 1), SimOptions(interval_s=10.0, cores=cores, shared=shared))
    return policy, sim.run([TraceRequest(0.0, 10, 1000)])


def test_a_start_beside_a_busy_engine_takes_longer_by_the_measured_slowdown():
    started = {}
    for name, shared in (("even", SharedCore()), ("measured", SharedCore(startup=1.75))):
        policy, _ = start_beside_busy_decode(shared)
        started[name] = min(round(obs.t) for obs in policy.seen if obs.prefill.replicas == 2)
    assert started == {"even": 40, "measured": 70}  # ready at 40 s, or at 10 + 30 x 1.75 = 62.5 s


def test_a_start_up_slows_the_decode_steps_beside_it_while_it_lasts():
    done = {}
    for name, shared in (("even", SharedCore()), ("measured", SharedCore(decode_beside_start=1.5))):
        _, result = start_beside_busy_decode(shared)  # prefill-1 serves from 40 s, idle
        (request,) = result.records
        done[name] = request.done
    # From 10 s to 40 s decode-0's steps take 0.15 s: 200 steps where 300 ran alone, so it ends 10 s later.
    assert done["measured"] == pytest.approx(done["even"] + 10.0)
    assert done["even"] == pytest.approx(1000 * 0.1, abs=0.01)
    with pytest.raises(ValueError, match="SharedCore.decode_beside_start must be 1 or more"):
        SharedCore(decode_beside_start=0.9)


def test_a_start_up_slows_the_prefill_passes_beside_it_while_it_lasts():
    # 60 prompts of 1 s each wait on prefill-0 (one a pass); at t=10 decode-1 starts on its core and is still
    # starting when the last pass ends (a start-up of 1000 s: it takes no work away from the core meanwhile).
    profile = make_profile(prefill_s_per_token=0.001, max_num_seqs=1, startup_s=1000.0)
    cores = {"prefill-0": frozenset({0}), "decode-0": frozenset({1}), "decode-1": frozenset({0})}
    last = {}
    for name, shared in (("even", SharedCore()), ("measured", SharedCore(prefill_beside_start=1.5))):
        sim = Simulator(
            profile,
            Script([(1, 2)]),
            TARGETS,
            (1, 1),
            SimOptions(interval_s=10.0, cores=cores, shared=shared, spin_s=0.0),
        )
        result = sim.run([TraceRequest(0.0, 1000, 1) for _ in range(60)])
        last[name] = max(r.ttft_s for r in result.records)
    # The pass begun at 10 s, as the start was asked for, runs alone; the 49 after it take 1.5 s each.
    assert last["even"] == pytest.approx(60.0, abs=0.01)
    assert last["measured"] == pytest.approx(11.0 + 49 * 1.5, abs=0.01)


def test_a_decode_step_beside_a_decode_engine_takes_its_own_slowdown():
    # Two decode engines on one core each step one request of 100 tokens (0.03 s a step alone).
    profile = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.03, 0.0), max_num_seqs=100)
    cores = {"prefill-0": frozenset({1}), "decode-0": frozenset({0}), "decode-1": frozenset({0})}
    trace = [TraceRequest(0.0, 10, 100), TraceRequest(0.0, 10, 100)]
    done = {}
    for name, shared in (
        ("even", SharedCore()),
        ("beside any", SharedCore(decode=3.0)),
        ("beside decode", SharedCore(decode=3.0, decode_beside_decode=1.25)),
    ):
        records = simulate(
            profile, StaticPolicy(1, 2), trace, TARGETS, (1, 2), SimOptions(cores=cores, spin_s=0.0, shared=shared)
        )
        done[name] = sorted(round(r.done, 3) for r in records.records)
    assert done == {"even": [6.0, 6.0], "beside any": [9.0, 9.0], "beside decode": [3.75, 3.75]}
    with pytest.raises(ValueError, match="SharedCore.decode_beside_decode must be 1 or more"):
        SharedCore(decode_beside_decode=0.9)


def test_an_engine_that_just_worked_keeps_its_share_of_the_core_while_it_polls():
    profile = make_profile(prefill_s_per_token=0.001, decode_step=(0.03, 0.0), max_num_seqs=100)
    trace = [TraceRequest(0.0, 10, 100)]  # a 0.01-s prefill pass, then 100 steps of 0.03 s alone
    one_core = {"prefill-0": frozenset({0}), "decode-0": frozenset({0})}
    (still,) = simulate(
        profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=one_core, spin_s=0.0)
    ).records
    assert still.done == pytest.approx(0.01 + 100 * 0.03)
    # vLLM's worker polls for SPIN_S after the pass: the decode steps take 2x until 1.01 s.
    (polled,) = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=one_core)).records
    assert SPIN_S == 1.0
    assert polled.done == pytest.approx(1.01 + (100 - 1.0 / 0.06) * 0.03)
    two_cores = {"prefill-0": frozenset({0}), "decode-0": frozenset({1})}
    (apart,) = simulate(profile, StaticPolicy(1, 1), trace, TARGETS, (1, 1), SimOptions(cores=two_cores)).records
    assert apart.done == pytest.approx(still.done)


def test_the_spec_gives_the_simulator_its_shared_cores(tmp_path: Path) -> None:
    import yaml

    from orchestrator.autoscale.runner import shared_cores
    from orchestrator.spec import ClusterSpec

    configs = Path(__file__).resolve().parents[4] / "configs"
    raw = yaml.safe_load((configs / "local-cpu-autoscale.yaml").read_text())
    raw["autoscaling"]["profile"] = str(configs / raw["autoscaling"]["profile"])
    raw["resources"]["cpus"] = 2
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    spec = ClusterSpec.from_file(tmp_path / "spec.yaml")
    assert shared_cores(spec) == {
        "prefill-0": frozenset({(0, 0)}),
        "decode-0": frozenset({(0, 1)}),
        "prefill-1": frozenset({(0, 1)}),
        "decode-1": frozenset({(0, 0)}),
    }
    raw["resources"]["share_cores"] = False
    raw["autoscaling"]["max_engines"] = 2
    raw["autoscaling"]["prefill"]["max"] = raw["autoscaling"]["decode"]["max"] = 1
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(raw))
    assert shared_cores(ClusterSpec.from_file(tmp_path / "own.yaml")) is None  # each engine on its own cores


def test_profile_holds_a_falling_last_segment_flat_above_the_grid() -> None:

    # measured: 2 sequences of 1024 tokens take less than 1 of 2048 (attention is quadratic)
    grid = Grid2D(rows=[1024.0, 2048.0], cols=[1.0, 2.0], seconds=[[5.9, 4.2], [13.1, 8.9]])
    assert grid(2048, 8) == pytest.approx(8.9)  # not 8.9 - 6 x 4.2 < 0
    assert grid(4096, 2) == pytest.approx(8.9 + (8.9 - 4.2) * 2)  # a rising segment still extends


def test_prefill_goes_in_turn_or_to_the_least_queued_as_the_proxys_routing_says():
    profile = make_profile(prefill_s_per_token=0.001, decode_step=(0.01, 0.0), max_num_seqs=100)
    # A 4-s prompt, then three 0.1-s ones while it computes.
    trace = [TraceRequest(0.0, 4000, 2), *(TraceRequest(0.1 * i, 100, 2) for i in (1, 2, 3))]

    def ttfts(routing: tuple[str, str]) -> list[float]:
        result = simulate(profile, StaticPolicy(2, 1), trace, TARGETS, (2, 1), SimOptions(routing=routing))
        return [r.ttft_s for r in sorted(result.records, key=lambda r: r.arrival)]

    # Least queued: the short prompts all go to the idle engine (each waits for the one before it at most).
    assert max(ttfts(("least_loaded", "least_loaded"))[1:]) < 0.5
    # In turn: the third request lands behind the long prompt on engine 0.
    in_turn = ttfts(("round_robin", "round_robin"))
    assert in_turn[2] == pytest.approx(4.0 - 0.2 + 0.1 + 0.01, abs=0.02)
    assert max(in_turn[1], in_turn[3]) < 0.5
