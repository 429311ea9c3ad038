"""The autoscaling policy, decision by decision: bursts, flapping, the budget, min/max, cooldowns.

Every test drives ``AutoscalePolicy.decide`` with observations built by ``observe``
and checks the target counts an actuator would apply, and that the reasons say why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orchestrator.autoscale.config import AutoscalingConfig, LatencyTargets, PoolLimits
from orchestrator.autoscale.demand import LENGTH_QUANTILES, TTFT_TAIL, wait_budgets, wait_tail
from orchestrator.autoscale.observation import ClusterObservation, PoolObservation
from orchestrator.autoscale.policy import AutoscalePolicy, StaticPolicy
from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D, PerformanceProfile

CONFIG = AutoscalingConfig(
    prefill=PoolLimits(min=1, max=40),
    decode=PoolLimits(min=1, max=40),
    max_engines=64,
    targets=LatencyTargets(ttft_p90_s=2.0, itl_p90_s=0.05),
    interval_s=30.0,
    scale_up_cooldown_s=30.0,
    scale_down_cooldown_s=300.0,
    hysteresis=0.1,
    target_utilization=0.8,
)


def linear_profile() -> PerformanceProfile:
    """Prefill 10,000 tokens/s; decode step 20 ms + 0.1 ms per sequence; KV moves at 10 GB/s."""
    return PerformanceProfile(
        name="linear",
        provenance="test",
        engine=EngineLimits(256, 8192, 400_000, 100_000, 60.0),
        prefill=Grid2D([1.0, 100_000.0], [1.0, 64.0], [[0.0001, 0.0001], [10.0, 10.0]]),
        decode=Grid2D([1.0, 257.0], [1.0, 100_000.0], [[0.0201, 0.0201], [0.0457, 0.0457]]),
        transfer=Grid1D([1.0, 1e10], [0.0, 1.0]),
    )


@pytest.fixture
def policy() -> Callable[..., AutoscalePolicy]:
    def make(moves: bool = False, cold_start: bool = False, **overrides: Any) -> AutoscalePolicy:
        config = AutoscalingConfig.model_validate({**CONFIG.model_dump(), **overrides})
        return AutoscalePolicy(config, linear_profile(), moves=moves, cold_start=cold_start)

    return make


def observe(
    t: float, rate: float, prefill: int = 2, decode: int = 2, prompt: float = 2000, output: float = 200, **more: Any
) -> ClusterObservation:
    return ClusterObservation(
        t=t,
        arrival_rate_rps=rate,
        mean_prompt_tokens=prompt,
        mean_output_tokens=output,
        prefill=more.pop("prefill_pool", PoolObservation(replicas=prefill)),
        decode=more.pop("decode_pool", PoolObservation(replicas=decode)),
        **more,
    )


def run(policy: AutoscalePolicy, rates: list[float], start: tuple[int, int] = (2, 2), dt: float = 30.0):
    """Feed one rate per interval, applying each decision as an actuator would (engines serve at once)."""
    prefill, decode = start
    decisions = []
    for i, rate in enumerate(rates):
        decision = policy.decide(observe(i * dt, rate, prefill, decode))
        prefill, decode = decision.prefill, decision.decode
        decisions.append(decision)
    return decisions


def erlang_c_wait_tail(servers: int, rate: float, service_s: float, wait_s: float, cv2: float = 1.0) -> float:
    """P(wait > ``wait_s``) in an M/G/c queue: ``wait_tail`` with one budget."""
    return wait_tail(servers, rate, service_s, [wait_s], cv2)


def test_erlang_c_matches_the_m_m_1_formula():
    # M/M/1: P(wait > t) = rho * exp(-(mu - lambda) t).
    assert erlang_c_wait_tail(1, 0.5, 1.0, 2.0) == pytest.approx(0.5 * 2.718281828 ** (-1.0))
    assert erlang_c_wait_tail(4, 10.0, 1.0, 0.0) == 1.0  # unstable
    assert erlang_c_wait_tail(3, 0.0, 1.0, 0.0) == 0.0
    # Service times spread as exponential ones (cv^2 = 1): M/M/c itself; deterministic ones (0) halve the
    # tail's time constant, heavy tails (cv^2 = 3) double it.
    assert erlang_c_wait_tail(1, 0.5, 1.0, 2.0, 1.0) == erlang_c_wait_tail(1, 0.5, 1.0, 2.0)
    assert erlang_c_wait_tail(1, 0.5, 1.0, 2.0, 0.0) == pytest.approx(0.5 * 2.718281828 ** (-2.0))
    assert erlang_c_wait_tail(1, 0.5, 1.0, 2.0, 3.0) == pytest.approx(0.5 * 2.718281828 ** (-0.5))


def test_prefill_is_sized_for_the_wait_each_prompt_length_affords_not_the_mean_prompts(policy):
    # 4000-token prompts on average (0.4 s of an engine), log-normal with cv^2 1: the longest take ~1.4 s and
    # may wait ~0.6 s of the 2 s target, the mean one ~1.6 s. Sized by the mean prompt's budget alone, the
    # long prompts would be the late ones: each length's budget counts.
    p = policy()
    decision = p.decide(observe(0.0, rate=20.0, prefill=1, prompt=4000, prompt_tokens_cv2=1.0))
    budgets = wait_budgets(p.config, p.profile, 4000, 1.0)
    assert len(budgets) == LENGTH_QUANTILES and budgets == sorted(budgets, reverse=True)
    mean_budget = wait_budgets(p.config, p.profile, 4000, 0.0)[0]  # no spread: every length is the mean
    assert budgets[-1] < 0.7 < 1.5 < mean_budget < budgets[0]
    by_mean = next(n for n in range(1, 64) if erlang_c_wait_tail(n, 20.0, 0.4, mean_budget) <= TTFT_TAIL)
    assert decision.prefill > by_mean
    assert any(f"P(wait > its budget) <= {TTFT_TAIL:.0%} over 20 prompt lengths" in line for line in decision.reasons)


def test_prompts_too_long_for_the_target_even_unqueued_do_not_size_the_pool(policy):
    # 40k-token prompts: an idle engine alone needs 4 s for the mean one, over the 2 s target.
    decision = policy().decide(observe(0.0, rate=0.5, prefill=1, prompt=40000, prompt_tokens_cv2=0.01))
    assert any("every prompt length around 40000 tokens; sizing for no waiting at all" in r for r in decision.reasons)


def test_heavy_tailed_prompts_get_more_prefill_engines_than_their_mean_says(policy):
    # 8000-token prompts take 0.8 s of an engine and may wait 1.1 s: the spread decides the tail.
    even = policy().decide(observe(0.0, rate=4.0, prefill=1, prompt=8000, prompt_tokens_cv2=1.0))
    heavy = policy().decide(observe(0.0, rate=4.0, prefill=1, prompt=8000, prompt_tokens_cv2=4.0))
    assert heavy.prefill > even.prefill and heavy.decode == even.decode
    assert any("prompt cv^2 4.00" in line for line in heavy.reasons)


def test_demand_follows_the_profile_arithmetic_and_says_so(policy):
    decision = policy().decide(observe(0.0, rate=20.0))

    # Prefill: 20 req/s x 2000 tokens = 40,000 tok/s at 10,000 tok/s/engine: 4 engines of load, a few more to wait.
    assert 5 <= decision.prefill <= 7
    # Decode: 20 req/s x 200 tokens x step(batch) / batch; the batch is bounded by 0.8 x 50 ms steps.
    assert 1 <= decision.decode <= 3
    text = "\n".join(decision.reasons)
    assert "40000 tok/s at 10000 tok/s/engine" in text
    assert "sequences at once" in text


def test_a_burst_grows_both_pools_in_one_decision(policy):
    p = policy()
    quiet = run(p, [10.0] * 3)[-1]
    burst = p.decide(observe(90.0, rate=60.0, prefill=quiet.prefill, decode=quiet.decode))

    assert burst.prefill >= 3 * quiet.prefill - 1
    assert burst.decode > quiet.decode
    assert any("trend" in line for line in burst.reasons)


def test_a_cluster_just_started_is_not_shrunk_on_its_first_window(policy):
    p = policy()
    first = p.decide(observe(30.0, rate=1.0, prefill=8, decode=8))
    assert (first.prefill, first.decode) == (8, 8)
    assert any("since the last change or the first window" in line for line in first.reasons)
    later = None
    for t in range(60, 400, 30):
        later = p.decide(observe(float(t), rate=1.0, prefill=8, decode=8))
        if later.prefill < 8:
            break
    assert later is not None and later.prefill < 8 and t >= 300  # a whole cooldown of low wishes first


def test_a_prefill_backlog_adds_engines_to_clear_it(policy):
    backlog = PoolObservation(replicas=2, queue_depth=500, queued_tokens=1_000_000)
    without = policy().decide(observe(0.0, 10.0, 2, 2))
    with_backlog = policy().decide(observe(0.0, 10.0, 4, 2, prefill_pool=backlog))

    # 1,000,000 tokens / (10,000 tok/s x (30 s + 60 s startup)) = 2 more.
    assert with_backlog.prefill == without.prefill + 2
    assert any("500 queued requests" in line for line in with_backlog.reasons)


def test_arrivals_beyond_the_serving_engines_count_as_backlog_until_new_ones_start(policy):
    # 30 req/s of 2000 tokens on 2 engines of 10,000 tok/s (10 req/s): for the 60 s new engines
    # take to start, 20 req/s x 2000 tokens queue up = 2.4M tokens, cleared over 30 + 60 s: 3 more.
    decision = policy().decide(observe(0.0, 30.0, 2, 2))

    line = next(r for r in decision.reasons if "queue up before new engines serve" in r)
    assert "2400000 more tokens" in line and ": 3 more" in line
    # on engines that keep up, nothing queues
    assert not any("queue up" in r for r in policy().decide(observe(0.0, 30.0, 20, 2)).reasons)


def test_a_cold_start_clears_its_backlog_within_an_interval_of_the_new_engines_serving(policy):
    # The same 2.4M tokens as above, on pools at the spec's sizes: in its first scale_down_cooldown_s the policy
    # clears them within one interval (30 s) of the new engines serving, not over a start-up more: 8 more, not 3.
    cold = policy(cold_start=True)
    first = cold.decide(observe(0.0, 30.0, 2, 2))
    line = next(r for r in first.reasons if "queue up before new engines serve" in r)
    assert ": 8 more to clear them within 30s of serving (a start under load: first 300s)" in line
    assert first.prefill == policy().decide(observe(0.0, 30.0, 2, 2)).prefill + 5
    # once it has watched for a cooldown, a backlog is a burst's: cleared over a start-up again
    later = cold.decide(observe(330.0, 90.0, first.prefill, 2))
    assert any("more to clear them in 90s" in r for r in later.reasons)


def test_a_cold_start_sizes_decode_for_the_backlog_prefill_clears_into_it(policy):
    # The 1,200 prompts that queue before new engines serve, cleared within 30 s, reach decode at 40 req/s on top
    # of the 30 arriving: decode gets the engines to hold them (2 more), where a warm policy sizes it for the rate.
    cold = policy(cold_start=True).decide(observe(0.0, 30.0, 2, 2))
    warm = policy().decide(observe(0.0, 30.0, 2, 2))
    line = next(r for r in cold.reasons if "as prefill clears them" in r)
    assert "the backlog's 1200 prompts reach decode at 40.0 req/s" in line
    assert (cold.prefill, cold.decode) == (7 + 8, warm.decode + 2)
    # Where the budget cannot hold both, its engines beyond the rate's needs are split between clearing the
    # backlog and decoding what it releases (in the proportion the two need), not all given to prefill.
    tight = policy(cold_start=True, max_engines=12).decide(observe(0.0, 30.0, 2, 2))
    assert "of the 3 engines beyond both pools' needs, prefill 2 and decode 1" in " ".join(tight.reasons)
    assert (tight.prefill, tight.decode) == (7 + 2, warm.decode + 1)
    # a backlog after the cold start's first cooldown is a burst's: decode is sized for the rate
    later = policy(cold_start=True)
    later.decide(observe(0.0, 30.0, 2, 2))
    burst = later.decide(observe(330.0, 30.0, 2, 2))
    assert any("more to clear them in 90s" in r for r in burst.reasons)
    assert not any("as prefill clears them" in r for r in burst.reasons) and burst.decode == warm.decode


def test_a_rise_forecast_holds_while_the_ramp_goes_on_and_ends_when_it_falls(policy):
    p = policy()
    run(p, [20.0] * 3)
    rising = p.decide(observe(90.0, 40.0, 4, 2))  # a trend: 20 -> 40
    assert any(r.startswith("trend: 20.00 -> 40.00") for r in rising.reasons)
    # the next window rises less than the noise, but the ramp goes on: the forecast holds
    still = p.decide(observe(120.0, 43.0, rising.prefill, rising.decode))
    assert any(r.startswith("trend: still rising") for r in still.reasons)
    assert still.prefill >= rising.prefill
    # the rate falls: the forecast is dropped
    falling = p.decide(observe(150.0, 25.0, still.prefill, still.decode))
    assert not any(r.startswith("trend") for r in falling.reasons)


def test_load_that_flaps_every_interval_does_not_make_the_pools_flap(policy):
    decisions = run(policy(), [40.0, 5.0] * 20)

    sizes = [(d.prefill, d.decode) for d in decisions]
    changes = sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if a != b)
    # up once (maybe in two steps; the first also sized for what queues while engines start),
    # at most one correction once that is over, and never back down between peaks
    assert changes <= 3
    assert len(set(sizes[14:])) == 1


def test_after_a_burst_the_pools_shrink_only_after_the_cooldown(policy):
    p = policy()
    decisions = run(p, [60.0] * 2 + [10.0] * 20)
    peak = max(d.prefill for d in decisions[:2])
    grown_at = next(d.t for d in decisions if d.prefill == peak)

    # The load drops at t=60; nothing shrinks for scale_down_cooldown_s (300 s) after the last change.
    held = [d.prefill for d in decisions if grown_at <= d.t < grown_at + 300.0]
    assert held == [peak] * len(held) and len(held) == 10
    assert decisions[-1].prefill < peak
    shrink = next(d for d in decisions if d.prefill < peak and d.t > grown_at)
    assert shrink.t >= grown_at + 300.0
    assert any("largest wish of the last 300s" in line for line in shrink.reasons)


def test_small_drops_stay_inside_the_hysteresis_band(policy):
    p = policy(hysteresis=0.5)
    decisions = run(p, [40.0] + [30.0] * 20)

    assert {d.prefill for d in decisions} == {decisions[0].prefill}
    assert any("hysteresis band" in line for line in decisions[-1].reasons)


def test_scale_up_cooldown_holds_a_second_increase(policy):
    p = policy(scale_up_cooldown_s=120.0)
    first = p.decide(observe(0.0, 20.0, 2, 2))
    second = p.decide(observe(30.0, 60.0, first.prefill, first.decode))

    assert second.prefill == first.prefill
    assert any("scale-up cooldown" in line for line in second.reasons)
    third = p.decide(observe(120.0, 60.0, first.prefill, first.decode))
    assert third.prefill > first.prefill


def test_min_and_max_bound_each_pool(policy):
    p = policy(prefill=PoolLimits(min=3, max=5), decode=PoolLimits(min=2, max=3))
    idle = p.decide(observe(0.0, 0.0, 3, 2))
    flooded = policy(prefill=PoolLimits(min=3, max=5), decode=PoolLimits(min=2, max=3)).decide(
        observe(0.0, 500.0, 3, 2)
    )

    assert (idle.prefill, idle.decode) == (3, 2)
    assert (flooded.prefill, flooded.decode) == (5, 3)
    assert any("clamped to [3, 5]" in line for line in flooded.reasons)


def test_the_budget_is_shared_in_proportion_to_demand(policy):
    decision = policy(max_engines=20).decide(observe(0.0, 400.0, 2, 2, output=2000))

    assert decision.prefill + decision.decode == 20
    assert decision.prefill >= 1 and decision.decode >= 1
    assert any("max_engines 20" in line for line in decision.reasons)


def test_the_budget_is_shared_by_what_the_rate_needs_before_the_pools_max_clamps_it(policy):
    """Prefill needs 61 engines for the rate (its max is 40), decode 31, 48 fit: shared 61:31, not 40:31. By the
    clamped wishes decode would get 21 of the 48, though it serves only what prefill lets through."""
    decision = policy(max_engines=48).decide(observe(0.0, 300.0, 30, 10, output=400))

    assert (decision.prefill, decision.decode) == (round(48 * 61 / 92), 48 - round(48 * 61 / 92)) == (32, 16)
    assert any("needs 61" in line for line in decision.reasons)  # uncapped: more than max_engines may need
    shared = "shared in proportion to what the arrival rate needs (61:31): 32+16"
    assert any(shared in line for line in decision.reasons)


def test_a_queue_does_not_take_the_other_pools_share_of_the_budget(policy):
    """A prefill queue of 30,000 requests asks for hundreds of engines to clear it, requests waiting for decode
    for more decode engines: shared by those wishes, prefill would take nearly the whole budget and leave decode
    too few engines for the rate, and every request prefilled would then wait for decode. What each pool needs
    for the arrival rate shares the budget; the queues are served by it."""
    calm = policy(max_engines=48).decide(observe(0.0, 300.0, 30, 10, output=400))
    queued = PoolObservation(replicas=30, queue_depth=30_000, queued_tokens=60_000_000)
    waiting = PoolObservation(replicas=10, queue_depth=500, kv_cache_usage=0.95)
    behind = policy(max_engines=48).decide(observe(0.0, 300.0, output=400, prefill_pool=queued, decode_pool=waiting))

    assert (behind.prefill, behind.decode) == (calm.prefill, calm.decode) == (32, 16)
    assert any("30000 queued requests" in line for line in behind.reasons)
    assert any("500 requests wait for a decode slot" in line for line in behind.reasons)


def test_the_budget_holds_while_one_pool_waits_out_its_cooldown(policy):
    p = policy(max_engines=30, prefill=PoolLimits(min=1, max=30), decode=PoolLimits(min=1, max=30))
    run(p, [200.0])  # prefill grows and its last change is now
    # The load moves to decode (long outputs) while prefill may not shrink yet.
    decision = p.decide(observe(30.0, 30.0, 25, 2, prompt=200, output=4000))

    assert decision.prefill + decision.decode <= 30


def test_measured_latency_over_target_blames_the_right_pool(policy):
    waiting_for_decode = PoolObservation(replicas=2, queue_depth=30)
    slow_ttft = policy().decide(observe(0.0, 1.0, 4, 2, ttft_p90_s=5.0, decode_pool=waiting_for_decode))
    slow_prefill = policy().decide(observe(0.0, 1.0, 4, 2, ttft_p90_s=5.0))
    slow_itl = policy().decide(observe(0.0, 1.0, 4, 2, itl_p90_s=0.2))

    assert slow_ttft.decode >= 3 and any("decode is the wait" in r for r in slow_ttft.reasons)
    assert slow_prefill.prefill >= 5 and any("prefill is the wait" in r for r in slow_prefill.reasons)
    assert slow_itl.decode >= 3 and any("p90 ITL 200.0 ms" in r for r in slow_itl.reasons)


def test_a_ttft_breach_is_decodes_only_when_its_waiting_requests_wait_a_real_share_of_the_target(policy):
    # Long outputs at 66 req/s: a few requests always wait for a decode slot, for ~0.1 s; a breach of the
    # 2-s target is then prefill's. 200 waiting wait ~3 s: decode's.
    def breach(waiting: int):
        decode_pool = PoolObservation(replicas=30, queue_depth=waiting)
        return policy().decide(observe(0.0, 66.0, 30, 30, output=700, ttft_p90_s=2.5, decode_pool=decode_pool))

    few, many = breach(6), breach(200)

    assert any("6 waiting for a decode slot, ~0.09s by Little's law: prefill is the wait" in r for r in few.reasons)
    assert few.prefill >= 31
    assert any("200 waiting for a decode slot, ~3.03s by Little's law: decode is the wait" in r for r in many.reasons)
    assert many.decode >= 31


def test_same_observations_give_the_same_decisions(policy):
    rates = [5.0, 30.0, 60.0, 10.0, 10.0, 45.0] * 5
    first = [(d.prefill, d.decode, d.reasons) for d in run(policy(), rates)]
    second = [(d.prefill, d.decode, d.reasons) for d in run(policy(), rates)]

    assert first == second


def test_static_policy_keeps_its_split_and_refuses_an_empty_pool():
    assert StaticPolicy(40, 24).decide(observe(0.0, 100.0)).target("prefill") == 40
    with pytest.raises(ValueError, match="at least one engine per pool"):
        StaticPolicy(0, 64)


def test_after_a_burst_the_guard_keeps_part_of_its_rise_until_the_memory_ends(policy):
    """Demand jumps from quiet to a burst and back: past the cooldown the pool shrinks only to the quiet
    demand plus half the jump; once the jump is older than burst_memory_s, to the quiet demand."""
    p = policy(burst_memory_s=900.0)
    decisions = run(p, [5.0] * 12 + [40.0] * 4 + [5.0] * 40)
    quiet = decisions[11].prefill
    peak = max(d.prefill for d in decisions)
    rise = max(b.prefill - a.prefill for a, b in zip(decisions, decisions[1:], strict=False))
    after_cooldown = [d for d in decisions if 16 * 30 + 300 <= d.t < 12 * 30 + 900]
    assert after_cooldown and all(d.prefill >= quiet + rise // 2 for d in after_cooldown)
    assert any("burst guard" in line for d in after_cooldown for line in d.reasons)
    assert decisions[-1].prefill == quiet < peak
    without = run(policy(burst_guard=0.0), [5.0] * 12 + [40.0] * 4 + [5.0] * 40)
    assert [d.prefill for d in without][33] == quiet  # the guard off: back to the quiet demand at t=990


def test_a_pool_scaled_by_hand_is_not_shrunk_again_before_the_scale_down_cooldown(policy):
    steady = [10.0] * 12  # 330 s of one load: the pools settle and the first window is long past
    p, q = policy(), policy()
    settled = run(p, steady)[-1]
    run(q, steady)
    t = len(steady) * 30.0
    grown = observe(t, 10.0, settled.prefill + 3, settled.decode)

    p.scaled_by_hand(["prefill"])  # `pdserve scale prefill=N`: the controller tells the policy
    held = p.decide(grown)
    assert held.prefill == settled.prefill + 3
    assert any(f"prefill: scaled by hand to {settled.prefill + 3}" in line for line in held.reasons)
    assert q.decide(grown).prefill == settled.prefill  # unmarked, the same pool shrinks at once
    assert p.decide(observe(t + 270.0, 10.0, settled.prefill + 3, settled.decode)).prefill == settled.prefill + 3
    assert p.decide(observe(t + 300.0, 10.0, settled.prefill + 3, settled.decode)).prefill == settled.prefill


def test_a_ramp_too_gradual_for_one_window_is_read_from_the_slope_and_the_fleet_grows_ahead(policy):
    # +1.5 req/s a window from 20: each rise is under one window's noise (~4 req/s), the slope of the last
    # windows is not. The forecast is the line's rate a startup plus an interval ahead; nothing shrinks.
    p = policy()
    rates = [20.0 + 1.5 * i for i in range(12)]
    decisions = run(p, rates)
    assert not any(r.startswith("trend: ") and "->" in r for d in decisions for r in d.reasons)  # no step seen
    slope = [r for r in decisions[-1].reasons if r.startswith("trend: the last 8 windows rise 3.00 req/s per minute")]
    assert slope and "41.00 req/s expected in 90s" in slope[0]  # 36.5 now + 0.05 req/s/s x 90 s
    flat = policy()
    assert decisions[-1].prefill > run(flat, [rates[-1]] * 12)[-1].prefill
    sizes = [d.prefill for d in decisions]
    assert sizes == sorted(sizes)  # never shrunk on the way up


def test_a_ramp_too_slow_for_two_minutes_of_windows_is_read_from_the_longer_span(policy):
    # +0.25 req/s a window from 20 (a diurnal swing's climb): over 8 windows the slope is under 2 standard
    # errors, over 16 it is 5. The longer span forecasts it, and nothing shrinks on the way up.
    p = policy()
    rates = [20.0 + 0.25 * i for i in range(20)]
    decisions = run(p, rates)
    assert not any("the last 8 windows" in r for d in decisions for r in d.reasons)
    slope = [r for r in decisions[-1].reasons if r.startswith("trend: the last 16 windows rise 0.50 req/s per minute")]
    assert slope and "25.50 req/s expected in 90s" in slope[0]  # 24.75 now + 0.0083 req/s/s x 90 s
    sizes = [d.prefill for d in decisions]
    assert sizes == sorted(sizes)


def test_a_slope_is_dropped_when_the_last_window_falls_below_its_line(policy):
    p = policy()
    run(p, [20.0 + 1.5 * i for i in range(11)])
    fallen = p.decide(observe(330.0, 20.0, 6, 2))
    assert not any(r.startswith("trend") for r in fallen.reasons)


def test_with_moves_a_growing_pool_takes_the_others_surplus_at_once(policy):
    # Prompt-heavy load, then the load turns to short prompts and long outputs: decode must grow, prefill's
    # demand falls. Without moves prefill waits out its scale-down cooldown while decode starts engines; with
    # them prefill gives decode its surplus in the same decision, down to the largest of its last
    # MOVE_MEMORY wishes (9: for the prompt-heavy load), and decode's growth beyond that is starts.
    turned = {}
    for moves in (False, True):
        p = policy(moves=moves)
        first = run(p, [40.0] * 4, start=(10, 2))[-1]
        assert (first.prefill, first.decode) == (10, 2)
        turned[moves] = p.decide(observe(120.0, 40.0, 10, 2, prompt=200, output=2000))
    assert (turned[False].prefill, turned[False].decode) == (10, 20)
    assert (turned[True].prefill, turned[True].decode) == (9, 20)
    assert "move: decode grows by 18; prefill gives 1 of its 10 (it wishes at most 9" in "\n".join(turned[True].reasons)


def test_a_move_never_leaves_the_giving_pool_below_its_min_or_its_recent_wish(policy):
    for low, kept in ((1, 9), (10, 10)):
        p = policy(moves=True, prefill=PoolLimits(min=low, max=40))
        run(p, [40.0] * 2, start=(12, 2))
        turned = p.decide(observe(60.0, 5.0, 12, 2, prompt=50, output=20000))
        assert turned.prefill == kept  # its wish for 40 req/s of 2000-token prompts was 9


def test_at_the_budget_a_growth_within_the_growing_pools_band_moves_nothing_unless_a_breach_asks(policy):
    # Decode's wish wanders an engine above its 24 with the window's output lengths (its band is 3); a move
    # would take that engine from prefill, which would then wait out its own band to take it back. A measured
    # breach is not noise: it moves the engine.
    def grown(itl_p90_s: float | None):
        p = policy(moves=True, max_engines=30, prefill=PoolLimits(min=1, max=30), decode=PoolLimits(min=1, max=30))
        first = p.decide(observe(0.0, 40.0, 6, 24, prompt=1000, output=2000))
        assert (first.prefill, first.decode) == (6, 24)  # prefill wishes 5
        return p.decide(observe(30.0, 40.0, 6, 24, prompt=1000, output=2100, itl_p90_s=itl_p90_s))

    calm, breached = grown(None), grown(0.2)

    assert (calm.prefill, calm.decode) == (6, 24)
    assert "move: none (decode grows by 1, within its hysteresis band of 3" in "\n".join(calm.reasons)
    assert (breached.prefill, breached.decode) == (5, 25)
    assert "move: decode grows by 1; prefill gives 1 of its 6" in "\n".join(breached.reasons)


def test_with_moves_load_that_flaps_between_the_pools_does_not_move_engines_back_and_forth(policy):
    # Windows alternate between prompt-heavy and output-heavy load: the memory of the last wishes keeps the
    # pools from trading engines every interval.
    p = policy(moves=True)
    prefill, decode, sizes = 8, 8, []
    for i in range(30):
        prompt, output = (4000, 100) if i % 2 else (200, 1500)
        d = p.decide(observe(30.0 * i, 20.0, prefill, decode, prompt=prompt, output=output))
        prefill, decode = d.prefill, d.decode
        sizes.append((prefill, decode))
    changes = sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if a != b)
    assert changes <= 4
    assert len(set(sizes[10:])) == 1


def test_a_pool_that_just_changed_gives_no_engine_back_by_a_move_unless_a_breach_asks(policy):
    # The 3-engine CPU demo near a pool's edge: a breach gives prefill the shared engine, then a few requests
    # waiting for a decode slot ask decode for one more. Moving it back at once would undo the breach's move
    # (and, window after window, trade the engine back and forth); within prefill's scale-down cooldown it
    # stays. A breach of decode still moves it.
    def after_a_breach(itl_p90_s: float | None):
        p = policy(moves=True, max_engines=3, prefill=PoolLimits(min=1, max=2), decode=PoolLimits(min=1, max=2))
        first = p.decide(observe(0.0, 0.5, 1, 2, prompt=2000, output=200, ttft_p90_s=30.0))
        assert (first.prefill, first.decode) == (2, 1), first.reasons  # the breach moved an engine to prefill
        waiting = PoolObservation(replicas=1, queue_depth=8, kv_cache_usage=0.9)  # for a slot: the KV is full
        return p.decide(observe(30.0, 0.5, 2, 1, prompt=2000, output=200, decode_pool=waiting, itl_p90_s=itl_p90_s))

    calm, breached = after_a_breach(None), after_a_breach(5.0)

    assert (calm.prefill, calm.decode) == (2, 1), calm.reasons
    assert any(
        r.startswith("move: none (prefill changed 30s ago, within its scale-down cooldown") for r in calm.reasons
    )
    # A breach of decode is not held back by prefill's cooldown (prefill's own recent wish still keeps it here).
    assert not any("within its scale-down cooldown" in r for r in breached.reasons), breached.reasons
    assert any(r.startswith("feedback: measured p90 ITL") for r in breached.reasons), breached.reasons


def test_a_scale_down_cooldown_of_zero_keeps_the_last_wish_for_moves(policy):
    p = policy(moves=True, scale_down_cooldown_s=0)
    run(p, [40.0] * 3, start=(10, 2))
    turned = p.decide(observe(90.0, 40.0, 10, 2, prompt=200, output=2000))  # the last wish stays: moves read it
    assert turned.decode > 2


def test_requests_waiting_for_decode_admission_size_the_decode_pool(policy):
    # Prefilled requests waiting for a decode slot: vLLM's decode engines count them in
    # vllm:num_requests_waiting, which the observation carries as the decode queue.
    waiting = PoolObservation(replicas=2, queue_depth=400, kv_cache_usage=0.95)
    calm = policy().decide(observe(0.0, 10.0, 4, 2))
    backed_up = policy().decide(observe(0.0, 10.0, 4, 2, decode_pool=waiting))
    assert backed_up.decode > calm.decode
    assert any("400 requests wait for a decode slot" in r for r in backed_up.reasons)
    # Every seat taken: the same.
    seated = PoolObservation(replicas=2, queue_depth=400, running=2 * 256)
    assert policy().decide(observe(0.0, 10.0, 4, 2, decode_pool=seated)).decode == backed_up.decode


def test_requests_waiting_beside_free_decode_slots_are_loading_their_kv_and_add_no_engine(policy):
    # The CPU demo started under load: 2-5 requests in decode-0's waiting gauge, 0-3 running, its KV 3-6 % used:
    # their KV is loading. Counted as waiting for a slot, they would ask for a second decode engine, whose start
    # takes the prefill engine's core for a minute.
    loading = PoolObservation(replicas=1, queue_depth=5, running=3, kv_cache_usage=0.06)
    calm = policy().decide(observe(0.0, 10.0, 4, 1))
    decided = policy().decide(observe(0.0, 10.0, 4, 1, decode_pool=loading))
    assert decided.decode == calm.decode
    assert any("5 waiting with room to spare (3 running, KV 6%): loading their KV" in r for r in decided.reasons)
