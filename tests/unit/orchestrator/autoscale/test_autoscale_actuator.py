"""The autoscaler's observe -> decide -> act loop, against /metrics pages served over real HTTP."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from orchestrator.autoscale.actuator import (
    Autoscaler,
    EngineReading,
    Observer,
    histogram_cv2,
    histogram_quantile,
    next_tick,
)
from orchestrator.autoscale.config import AutoscalingConfig, LatencyTargets, PoolLimits
from orchestrator.autoscale.profile import load_profile
from orchestrator.engine_metrics import parse_metrics
from proxy.metrics import TTFT_BUCKETS, ProxyMetrics

PROFILE = "configs/profiles/example-gpu.yaml"


VLLM_LENGTH_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]  # vLLM's 1-2-5 series


class EnginePage:
    """An engine's /metrics as vLLM names them: counters, gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("vllm:prompt_tokens", "", registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "", registry=self.registry)
        self.success = Counter("vllm:request_success", "", ("finished_reason",), registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "", registry=self.registry)
        self.running = Gauge("vllm:num_requests_running", "", registry=self.registry)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", registry=self.registry)
        self.prompt_lengths = Histogram(
            "vllm:request_prompt_tokens", "", buckets=VLLM_LENGTH_BUCKETS, registry=self.registry
        )

    def finish(self, n: int, prompt: int, output: int) -> None:
        self.success.labels("length").inc(n)
        self.prompt_tokens.inc(n * prompt)
        self.generation_tokens.inc(n * output)
        for _ in range(n):
            self.prompt_lengths.observe(prompt)

    def reading(self):
        return parse_metrics(generate_latest(self.registry).decode())


def proxy_page(ttfts: list[float], itls: list[float], received: int):
    metrics = ProxyMetrics(type("Pool", (), {"snapshot": lambda self: {}, "targets": {}})())
    model = metrics.of(None)
    model.received.inc(received)
    for t in ttfts:
        model.time_to_first_token.observe(t)
    for t in itls:
        model.inter_token_latency.observe(t)
    return parse_metrics(metrics.render().decode())


def test_histogram_quantile_interpolates_within_the_bucket_between_two_readings() -> None:
    registry = CollectorRegistry()
    h = Histogram("h", "", buckets=(1.0, 2.0, 4.0), registry=registry)
    for v in (0.5, 0.5):
        h.observe(v)
    before = parse_metrics(generate_latest(registry).decode()).buckets["h"]
    for v in [1.5] * 8 + [3.0] * 2:  # the window: 10 observations, 8 in (1, 2], 2 in (2, 4]
        h.observe(v)
    now = parse_metrics(generate_latest(registry).decode()).buckets["h"]
    assert histogram_quantile(0.5, now, before) == pytest.approx(1.0 + 5 / 8)
    assert histogram_quantile(0.9, now, before) == pytest.approx(2.0 + 2.0 * 1 / 2)
    assert histogram_quantile(0.9, now, now) is None  # nothing observed in between
    # everything above the largest edge: the largest edge, as histogram_quantile does
    h.observe(100.0)
    top = parse_metrics(generate_latest(registry).decode()).buckets["h"]
    assert histogram_quantile(0.99, top, now) == 4.0


def test_observer_turns_two_readings_into_rates_means_and_pools() -> None:
    observer = Observer()
    prefill, decode = EnginePage(), EnginePage()
    engines = lambda: [  # noqa: E731
        EngineReading("prefill-0", "prefill", "ready", prefill.reading()),
        EngineReading("decode-0", "decode", "ready", decode.reading()),
        EngineReading("decode-1", "decode", "starting", None),
    ]
    first = observer.observe(100.0, proxy_page([], [], received=5), engines())
    assert first.arrival_rate_rps == 0.0 and first.ttft_p90_s is None  # a baseline only

    prefill.finish(20, prompt=300, output=1)
    decode.finish(20, prompt=300, output=50)
    decode.waiting.set(3)
    decode.running.set(7)
    decode.kv.set(0.25)
    obs = observer.observe(110.0, proxy_page([0.3] * 10 + [3.0] * 10, [0.02] * 100, received=5 + 40), engines())
    assert obs.arrival_rate_rps == pytest.approx(4.0)  # 40 arrivals in 10 s
    assert obs.mean_prompt_tokens == pytest.approx(300)
    assert obs.mean_output_tokens == pytest.approx(50)
    # 20 TTFTs, half at 0.3 s and half at 3 s: the p90 lies in the (2.5, 5] bucket
    assert 2.5 < obs.ttft_p90_s <= 5.0
    assert 0.01 < obs.itl_p90_s <= 0.025
    assert (obs.decode.replicas, obs.decode.starting, obs.decode.queue_depth, obs.decode.running) == (1, 1, 3, 7)
    assert obs.decode.queued_tokens == 3 * 350
    assert obs.decode.kv_cache_usage == pytest.approx(0.25)
    assert (obs.prefill.replicas, obs.prefill.starting, obs.prefill.queue_depth) == (1, 0, 0)


def test_the_spread_of_prompt_lengths_comes_from_vllms_histogram() -> None:
    observer = Observer()
    prefill = EnginePage()
    reading = lambda: [EngineReading("prefill-0", "prefill", "ready", prefill.reading())]  # noqa: E731
    observer.observe(0.0, None, reading())
    prefill.finish(10, prompt=300, output=1)
    assert observer.observe(10.0, None, reading()).prompt_tokens_cv2 == pytest.approx(0.0)  # one length
    prefill.finish(10, prompt=150, output=1)  # bucket (100, 200]: 150
    prefill.finish(10, prompt=3000, output=1)  # bucket (2000, 5000]: 3500
    spread = (150**2 + 3500**2) / 2 / ((150 + 3500) / 2) ** 2 - 1
    assert observer.observe(20.0, None, reading()).prompt_tokens_cv2 == pytest.approx(spread)
    # a window without requests keeps the last spread
    assert observer.observe(30.0, None, reading()).prompt_tokens_cv2 == pytest.approx(spread)
    assert histogram_cv2({1.0: 0.0, math.inf: 0.0}, {}) is None


def test_observer_keeps_the_last_means_and_survives_an_engine_restart() -> None:
    observer = Observer()
    decode = EnginePage()
    decode.finish(10, prompt=100, output=40)
    reading = lambda page: [EngineReading("decode-0", "decode", "ready", page.reading())]  # noqa: E731
    observer.observe(0.0, None, reading(decode))
    decode.finish(10, prompt=100, output=40)
    assert observer.observe(10.0, None, reading(decode)).mean_output_tokens == pytest.approx(40)
    # no request finished: the last known mean holds
    assert observer.observe(20.0, None, reading(decode)).mean_output_tokens == pytest.approx(40)
    # the engine restarted: its counters start again from 0 and count as they are
    restarted = EnginePage()
    restarted.finish(2, prompt=100, output=10)
    assert observer.observe(30.0, None, reading(restarted)).mean_output_tokens == pytest.approx(10)


async def _serve(pages: dict[str, bytes]) -> tuple[web.AppRunner, str]:
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=pages[request.match_info["name"]], content_type="text/plain")

    app.router.add_get("/{name}/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def test_autoscaler_step_scales_up_under_load_and_records_why() -> None:
    async def scenario() -> None:
        proxy, decode = ProxyMetrics(type("Pool", (), {"snapshot": lambda self: {}, "targets": {}})()), EnginePage()
        prefill = EnginePage()
        pages = {}

        def publish() -> None:
            pages.update(
                proxy=proxy.render(),
                prefill=generate_latest(prefill.registry),
                decode=generate_latest(decode.registry),
            )

        publish()
        runner, base = await _serve(pages)
        scaled: list[tuple[dict[str, int], str]] = []

        async def scale(targets: dict[str, int], reason: str) -> dict:
            scaled.append((targets, reason))
            return {"plan": {}}

        config = AutoscalingConfig(
            prefill=PoolLimits(min=1, max=8), decode=PoolLimits(min=1, max=8), max_engines=12,
            targets=LatencyTargets(ttft_p90_s=2.0, itl_p90_s=0.06), interval_s=10.0, scale_up_cooldown_s=0.0,
        )  # fmt: skip
        engines = [
            ("prefill-0", "prefill", "ready", base + "/prefill"),
            ("decode-0", "decode", "ready", base + "/decode"),
        ]
        autoscaler = Autoscaler(config, load_profile(PROFILE), base + "/proxy", lambda: engines, scale)
        try:
            async with aiohttp.ClientSession() as session:
                await autoscaler._read(session)  # baseline
                proxy.of(None).received.inc(400)  # a heavy window: far beyond one engine per pool
                prefill.finish(400, prompt=2000, output=1)
                decode.finish(400, prompt=2000, output=200)
                publish()
                decision = await autoscaler.step(session)
        finally:
            await runner.cleanup()
        assert decision.prefill > 1 and decision.decode >= 1
        targets, reason = scaled[0]
        assert targets == {"prefill": decision.prefill, "decode": decision.decode}
        assert reason.startswith(f"autoscaler: prefill 1 -> {decision.prefill}")
        record = autoscaler.status()["decisions"][-1]
        assert autoscaler.status()["changes"] == [record]
        assert record["changed"]["prefill"] == [1, decision.prefill]
        assert record["observed"]["mean_prompt_tokens"] == 2000
        assert any(line.startswith("prefill:") for line in record["reasons"])

    asyncio.run(scenario())


def test_proxy_ttft_buckets_cover_the_targets_the_policy_reads() -> None:
    # the p90 TTFT the autoscaler measures can only be as fine as the proxy's buckets
    assert {0.5, 1.0, 2.5, 5.0} <= set(TTFT_BUCKETS)


def test_the_autoscaler_decides_at_a_fixed_rate_and_at_once_after_a_step_that_overran() -> None:
    # Steps that take 0.3 s of a 5-s interval do not move the decisions: 10, 15, 20 s, not 10, 15.3, 20.6 s.
    assert [next_tick(t, t + 0.3, 5.0) for t in (5.0, 10.0, 15.0)] == [10.0, 15.0, 20.0]
    assert next_tick(10.0, 17.5, 5.0) == 17.5  # a step that took 7.5 s: the next decision at once
