"""``orchestrator.engine_metrics``: one parse of a ``/metrics`` page, and the views of it the
autoscaler, the drain check, ``pdserve profile`` and the benchmarks read."""

from __future__ import annotations

import pytest

from orchestrator.engine_metrics import engine_gauges, parse_metrics, sum_samples

pytestmark = pytest.mark.timeout(15)

PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE pdserve:kv_transfer_seconds histogram
pdserve:kv_transfer_seconds_bucket{engine="0",le="0.01"} 4.0
pdserve:kv_transfer_seconds_bucket{engine="0",le="+Inf"} 5.0
pdserve:kv_transfer_seconds_bucket{engine="1",le="0.01"} 1.0
pdserve:kv_transfer_seconds_bucket{engine="1",le="+Inf"} 1.0
pdserve:kv_transfer_seconds_sum{engine="0"} 0.25
pdserve:kv_transfer_seconds_count{engine="0"} 5.0
pdserve:kv_transfer_seconds_count{engine="1"} 1.0
"""


def test_samples_add_up_over_label_sets_and_buckets_keep_their_edges():
    reading = parse_metrics(PAGE)

    assert reading.get("vllm:num_requests_running") == 5.0
    assert reading.get("pdserve:kv_transfer_seconds_count") == 6.0
    assert reading.buckets["pdserve:kv_transfer_seconds"] == {0.01: 5.0, float("inf"): 6.0}
    assert reading.get("absent") == 0.0


def test_a_reading_of_one_model_keeps_its_samples_and_those_no_model_labels():
    page = """\
# TYPE pdserve_proxy_requests_received_total counter
pdserve_proxy_requests_received_total{model="a"} 3.0
pdserve_proxy_requests_received_total{model="b"} 5.0
# TYPE pdserve_proxy_time_to_first_token_seconds histogram
pdserve_proxy_time_to_first_token_seconds_bucket{le="+Inf",model="a"} 2.0
pdserve_proxy_time_to_first_token_seconds_bucket{le="+Inf",model="b"} 7.0
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 1.5
"""
    reading = parse_metrics(page, {"model": "b"})

    assert reading.get("pdserve_proxy_requests_received_total") == 5.0
    assert reading.buckets["pdserve_proxy_time_to_first_token_seconds"] == {float("inf"): 7.0}
    assert reading.get("process_cpu_seconds_total") == 1.5
    assert parse_metrics(page).get("pdserve_proxy_requests_received_total") == 8.0


def test_sum_samples_reads_the_named_samples_and_zero_for_the_absent():
    totals = sum_samples(PAGE, ("pdserve:kv_transfer_seconds_sum", "vllm:num_requests_waiting"))

    assert totals == {"pdserve:kv_transfer_seconds_sum": 0.25, "vllm:num_requests_waiting": 0.0}


async def test_engine_gauges_reads_a_live_engine_and_none_when_it_is_gone(make_engine):
    engine = await make_engine("prefill-0", waiting=3, kv_cache_usage=0.5)

    gauges = await engine_gauges(engine.url)
    await engine.stop()

    assert gauges is not None
    assert (gauges["vllm:num_requests_waiting"], gauges["vllm:kv_cache_usage_perc"]) == (3.0, 0.5)
    assert await engine_gauges(engine.url, timeout_s=1.0) is None
