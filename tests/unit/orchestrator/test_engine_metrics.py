"""``orchestrator.engine_metrics``: one parse of a ``/metrics`` page, and the views of it the
autoscaler, the drain check, ``pdserve status``, ``pdserve profile`` and the benchmarks read."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from orchestrator.engine_metrics import (
    QUARANTINED_BLOCKS,
    SampleReader,
    engine_gauges,
    parse_metrics,
    sum_samples,
)

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


def quarantine_page(blocks_by_engine: dict[str, float]) -> str:
    """The counter as vLLM's API server exports it: one sample per engine index, a ``_created`` gauge beside."""
    registry = CollectorRegistry()
    counter = Counter(
        QUARANTINED_BLOCKS.removesuffix("_total"), "Decode KV blocks kept out of use.", ["engine"], registry=registry
    )
    for engine, blocks in blocks_by_engine.items():
        counter.labels(engine).inc(blocks)
    return generate_latest(registry).decode()


async def test_a_status_reads_each_engines_quarantined_blocks_and_none_where_it_has_none(make_engine):
    counting = await make_engine("decode-0", extra_metrics=lambda: quarantine_page({"0": 12, "1": 4}))
    unquarantined = await make_engine("decode-1", extra_metrics=lambda: quarantine_page({"0": 0}))
    vllm_nixl = await make_engine("decode-2")  # a connector that does not count them: no such sample
    gone = await make_engine("decode-3")
    await gone.stop()
    urls = {e.name: e.url for e in (counting, unquarantined, vllm_nixl, gone)}

    blocks = await SampleReader(QUARANTINED_BLOCKS).read(urls)

    assert blocks == {"decode-0": 16.0, "decode-1": 0.0, "decode-2": None, "decode-3": None}


async def test_an_engine_that_does_not_answer_in_time_reads_none_and_the_others_do_not_wait(make_engine):
    answering = await make_engine("decode-0", extra_metrics=lambda: quarantine_page({"0": 3}))
    stuck = await make_engine("decode-1", extra_metrics=lambda: quarantine_page({"0": 5}), metrics_delay_s=60)

    started = time.monotonic()
    blocks = await SampleReader(QUARANTINED_BLOCKS, timeout_s=0.5).read({"a": answering.url, "b": stuck.url})

    assert blocks == {"a": 3.0, "b": None}
    assert time.monotonic() - started < 2.0


async def test_a_reading_is_kept_max_age_s_and_an_engine_at_a_new_address_is_read_at_once(make_engine):
    blocks = {"0": 1.0}
    first = await make_engine("decode-0", extra_metrics=lambda: quarantine_page(blocks))
    second = await make_engine("decode-1", extra_metrics=lambda: quarantine_page({"0": 7}))
    now = [100.0]
    reader = SampleReader(QUARANTINED_BLOCKS, max_age_s=5.0, clock=lambda: now[0])

    assert await reader.read({"decode-0": first.url}) == {"decode-0": 1.0}
    blocks["0"] = 9.0
    now[0] += 4.0
    assert await reader.read({"decode-0": first.url}) == {"decode-0": 1.0}  # the CLI's waits: no scrape
    assert await reader.read({"decode-0": second.url}) == {"decode-0": 7.0}  # restarted elsewhere
    now[0] += 5.0
    assert await reader.read({"decode-0": first.url}) == {"decode-0": 9.0}


async def test_a_page_that_is_not_prometheus_text_reads_none(make_engine):
    engine = await make_engine("decode-0", extra_metrics=lambda: f"{QUARANTINED_BLOCKS} twelve\n")

    assert await SampleReader(QUARANTINED_BLOCKS).read({"decode-0": engine.url}) == {"decode-0": None}
