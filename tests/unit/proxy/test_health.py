"""``proxy.health`` and ``proxy.load``: ejection and readmission, probes and ``/metrics`` polls against stub engines."""

from __future__ import annotations

import pytest

from proxy.engine_client import EngineClient
from proxy.health import HealthMonitor, HealthTracker
from proxy.load import LoadPoller, parse_engine_load
from proxy.pool import EnginePool, EngineState
from tests.unit.conftest import endpoint

pytestmark = pytest.mark.timeout(15)


@pytest.fixture
def tracker(pool: EnginePool) -> HealthTracker:
    return HealthTracker(pool, unhealthy_after=3, healthy_after=2)


@pytest.fixture
async def engine_client():
    client = EngineClient(connect_timeout_s=0.5)
    yield client
    await client.close()


@pytest.fixture
def monitor(tracker: HealthTracker, engine_client: EngineClient) -> HealthMonitor:
    return HealthMonitor(tracker, engine_client, interval_s=0.01, timeout_s=0.5)


def decode_state(pool: EnginePool) -> EngineState:
    return pool.engine("decode-0")


# --- the tracker ------------------------------------------------------------------------


def test_ejected_after_n_failures_in_a_row(pool, tracker):
    engine = decode_state(pool)
    tracker.failed(engine, "refused")
    tracker.failed(engine, "refused")
    assert engine.healthy and pool.ready("decode")

    tracker.failed(engine, "refused")
    assert not engine.healthy and pool.ready("decode") == ()


def test_a_success_between_failures_resets_the_count(pool, tracker):
    engine = decode_state(pool)
    for _ in range(2):
        tracker.failed(engine, "refused")
    tracker.probe_succeeded(engine)
    for _ in range(2):
        tracker.failed(engine, "refused")

    assert engine.healthy


def test_readmitted_after_m_good_probes_in_a_row(pool, tracker):
    engine = decode_state(pool)
    for _ in range(3):
        tracker.failed(engine, "refused")
    tracker.probe_succeeded(engine)
    tracker.failed(engine, "refused")  # the streak starts over
    tracker.probe_succeeded(engine)
    assert not engine.healthy

    tracker.probe_succeeded(engine)
    assert engine.healthy and pool.ready("decode") == (engine,)


# --- probes against stub engines ---------------------------------------------------------


async def test_an_engine_that_stops_answering_health_is_ejected_then_readmitted(pool, monitor, decode_engine):
    engine = decode_state(pool)
    decode_engine.health_status = 503
    for _ in range(3):
        assert await monitor.probe(engine) is False
    assert not engine.healthy and pool.ready("decode") == ()

    decode_engine.health_status = 200
    assert await monitor.probe(engine) is True
    assert not engine.healthy  # one good probe is not enough
    assert await monitor.probe(engine) is True
    assert engine.healthy and pool.ready("decode") == (engine,)
    assert decode_engine.health_probes == 5


async def test_an_engine_that_is_down_is_ejected_and_readmitted_when_it_is_back(pool, monitor, decode_engine):
    engine = decode_state(pool)
    await decode_engine.stop()
    await monitor.sweep()
    await monitor.sweep()
    await monitor.sweep()
    assert not engine.healthy
    assert pool.engine("prefill-0").healthy  # its neighbour answered every probe

    await decode_engine.start()
    await monitor.sweep()
    await monitor.sweep()
    assert engine.healthy


async def test_a_probe_that_hangs_fails_after_the_timeout(pool, tracker, engine_client, decode_engine):
    decode_engine.health_delay_s = 3600
    quick = HealthMonitor(tracker, engine_client, interval_s=1, timeout_s=0.1)

    assert await quick.probe(decode_state(pool)) is False
    assert decode_state(pool).failures == 1


# --- /metrics ---------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
"""


def test_parse_engine_load_sums_the_queues_and_averages_the_cache():
    assert parse_engine_load(VLLM_METRICS) == (5.0, 0.375)


def test_parse_engine_load_reads_unlabelled_series_and_the_old_cache_name():
    assert parse_engine_load("vllm:num_requests_waiting 7\nvllm:gpu_cache_usage_perc 0.5 1712000000\n") == (7.0, 0.5)


def test_parse_engine_load_without_vllm_gauges_is_none():
    assert parse_engine_load("# nothing\nprocess_cpu_seconds_total 3.0\n") is None


async def test_load_poller_stores_what_each_engine_reports(pool, engine_client, prefill_engine, decode_engine):
    decode_engine.waiting, decode_engine.kv_cache_usage = 4, 0.75
    poller = LoadPoller(pool, engine_client, interval_s=1, timeout_s=0.5)
    await poller.sweep()

    decode = decode_state(pool)
    assert (decode.waiting, decode.kv_cache_usage) == (4.0, 0.75)
    assert decode.load == 4.75
    assert pool.engine("prefill-0").load == 0.0

    await decode_engine.stop()
    assert await poller.poll(decode) is False
    assert decode.waiting == 4.0  # the last values stay


async def test_monitor_probes_every_engine_of_both_roles(pool, monitor, make_engine, prefill_engine, decode_engine):
    pool.set_endpoints("decode", [*pool.endpoints("decode"), endpoint(await make_engine("decode-1"))])
    await monitor.sweep()

    assert prefill_engine.health_probes == decode_engine.health_probes == 1
    assert all(e.healthy for e in pool.engines())
