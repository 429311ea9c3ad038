"""The proxy's ``GET /metrics`` (``proxy.metrics``), scraped as Prometheus would."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stub_engine import Behaviour
from tests.unit.conftest import PROXY_MODEL
from tests.unit.proxy_requests import CHAT, CHAT_PATH, COMPLETION, COMPLETION_PATH

pytestmark = pytest.mark.timeout(15)


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) → value."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def requests_total(route: str, status: str, path: str = "disaggregated") -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = (("model", PROXY_MODEL), ("path", path), ("route", route), ("status", status))
    return ("pdserve_proxy_requests_total", labels)


def count(name: str) -> tuple[str, tuple]:
    return (name + "_count", (("model", PROXY_MODEL),))


async def test_requests_are_counted_by_route_status_and_path(client, decode_engine):
    for _ in range(2):
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200
    assert (await client.post(COMPLETION_PATH, json=COMPLETION)).status_code == 200
    assert (await client.post(CHAT_PATH, json={"model": PROXY_MODEL})).status_code == 400
    decode_engine.behaviour = Behaviour.ERROR_500
    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 502

    samples = await scrape(client)

    assert samples[requests_total(CHAT_PATH, "200")] == 2
    assert samples[requests_total(COMPLETION_PATH, "200")] == 1
    assert samples[requests_total(CHAT_PATH, "400")] == 1
    assert samples[requests_total(CHAT_PATH, "502")] == 1
    assert samples[count("pdserve_proxy_e2e_request_latency_seconds")] == 5
    assert samples[count("pdserve_proxy_time_to_first_token_seconds")] == 0  # no stream yet


async def test_a_stream_times_its_first_token_and_the_gaps_between_chunks(client, decode_engine):
    decode_engine.token_delay_s = 0.02  # each SSE event comes on its own
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": True}) as response:
        body = await response.aread()
    assert response.status_code == 200 and body.endswith(b"data: [DONE]\n\n")

    samples = await scrape(client)

    assert samples[requests_total(CHAT_PATH, "200")] == 1
    assert samples[count("pdserve_proxy_time_to_first_token_seconds")] == 1
    assert samples[count("pdserve_proxy_e2e_request_latency_seconds")] == 1
    events = body.count(b"data: ")
    assert samples[count("pdserve_proxy_inter_token_latency_seconds")] >= events - 2  # (a first one, [DONE])
    assert samples[("pdserve_proxy_inter_token_latency_seconds_sum", (("model", PROXY_MODEL),))] >= 0.02 * (events - 3)
    assert 0 < samples[("pdserve_proxy_time_to_first_token_seconds_sum", (("model", PROXY_MODEL),))] < 5


async def test_serving_path_label_comes_from_the_router(make_proxy):
    server = await make_proxy(decode_only_below_tokens=10_000)  # every prompt here is shorter: decode-only
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.post(CHAT_PATH, json=CHAT)
        assert response.status_code == 200 and response.headers["x-pdserve-path"] == "decode-only; reason=short-prompt"
        samples = await scrape(client)

    assert samples[requests_total(CHAT_PATH, "200", "decode-only")] == 1
    assert requests_total(CHAT_PATH, "200") not in samples


async def test_engine_in_flight_is_read_from_the_pool_when_scraped(pool, make_proxy):
    server = await make_proxy()
    for _ in range(3):
        pool.engine("decode-0").start_leg()
    pool.engine("prefill-0").start_leg()
    async with httpx.AsyncClient(base_url=server.url) as client:
        samples = await scrape(client)

    in_flight = "pdserve_proxy_engine_in_flight"
    assert samples[(in_flight, (("engine_id", "decode-0"), ("model", PROXY_MODEL), ("role", "decode")))] == 3
    assert samples[(in_flight, (("engine_id", "prefill-0"), ("model", PROXY_MODEL), ("role", "prefill")))] == 1


async def test_pool_sizes_and_the_controllers_targets_are_read_when_scraped(pool, make_proxy):
    server = await make_proxy()
    async with httpx.AsyncClient(base_url=server.url) as client:
        standalone = await scrape(client)
        pool.targets.update(prefill=2, decode=1)  # what the cluster's controller publishes with the engines
        pool.drain("prefill-0")
        samples = await scrape(client)

    engines, target = "pdserve_proxy_pool_engines", "pdserve_proxy_pool_target"
    assert not any(name == target for name, _ in standalone)  # a proxy without a controller wants nothing
    assert samples[(engines, (("model", PROXY_MODEL), ("role", "prefill"), ("state", "draining")))] == 1
    assert samples[(engines, (("model", PROXY_MODEL), ("role", "prefill"), ("state", "ready")))] == 0
    assert samples[(engines, (("model", PROXY_MODEL), ("role", "decode"), ("state", "ready")))] == 1
    assert samples[(target, (("model", PROXY_MODEL), ("role", "prefill")))] == 2
    assert samples[(target, (("model", PROXY_MODEL), ("role", "decode")))] == 1


async def test_each_app_counts_its_own_requests(make_client):
    first, second = await make_client(), await make_client()
    assert (await first.post(CHAT_PATH, json=CHAT)).status_code == 200

    assert (await scrape(first))[requests_total(CHAT_PATH, "200")] == 1
    assert requests_total(CHAT_PATH, "200") not in await scrape(second)
