"""The proxy's routing as a client meets it: policies, prefill retries, decode-only, ejection, in-flight counts.

The proxy runs for real against stub engines (``tests/unit/conftest.py``);
each test checks what the client got (status, headers) and which stub got
the request.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import Request

from proxy.app import create_app
from tests.stub_engine import Behaviour, answer_text
from tests.unit.conftest import PROXY_MODEL, ProxyServer, endpoint, released
from tests.unit.proxy.test_metrics import scrape
from tests.unit.proxy_factories import proxy_config
from tests.unit.proxy_requests import (
    CHAT,
    CHAT_PATH,
    answer_of,
    assert_openai_error,
    sse_events,
    streamed_text,
    wait_until,
)

pytestmark = pytest.mark.timeout(20)

LONG = {"model": PROXY_MODEL, "prompt": "Tell me a story about a lighthouse keeper. " * 10}  # ~108 tokens
SHORT = {"model": PROXY_MODEL, "prompt": "Hi"}


@pytest.fixture
async def two_prefill(pool, make_engine):
    """prefill-0 and prefill-1 in the pool."""
    second = await make_engine("prefill-1")
    pool.set_endpoints("prefill", [*pool.endpoints("prefill"), endpoint(second)])
    return second


@pytest.fixture
async def two_decode(pool, make_engine):
    """decode-0 and decode-1 in the pool."""
    second = await make_engine("decode-1")
    pool.set_endpoints("decode", [*pool.endpoints("decode"), endpoint(second)])
    return second


async def post(proxy: ProxyServer, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        return await client.post(path, json=body, **kwargs)


async def tier_lookups(proxy: ProxyServer, outcome: str) -> float:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        labels = (("model", PROXY_MODEL), ("outcome", outcome))
        return (await scrape(client)).get(("pdserve_proxy_tier_lookups_total", labels), 0.0)


def in_flight(pool) -> dict[str, int]:
    return {e["engine_id"]: e["in_flight"] for role in pool.snapshot().values() for e in role}


# --- prefill retries --------------------------------------------------------------------


@pytest.mark.parametrize("failure", [Behaviour.ERROR_500, Behaviour.DROP], ids=["500", "connection-closed"])
async def test_a_failed_prefill_is_retried_on_another_engine(
    make_proxy, prefill_engine, two_prefill, decode_engine, failure
):
    proxy = await make_proxy()
    prefill_engine.behaviour = failure
    response = await post(proxy, LONG)  # round robin starts on prefill-0

    assert response.status_code == 200
    assert response.headers["x-pdserve-prefill"] == "prefill-1"
    assert prefill_engine.requests and len(two_prefill.requests) == 1
    assert answer_of("/v1/completions", response.json()) == answer_text("decode-0", with_kv=True)
    kv_params = decode_engine.requests[0].body["kv_transfer_params"]
    assert kv_params["remote_engine_id"] == "prefill-1"


async def test_a_prefill_4xx_is_not_retried(make_proxy, prefill_engine, two_prefill, decode_engine):
    proxy = await make_proxy()
    prefill_engine.behaviour = two_prefill.behaviour = Behaviour.ERROR_400
    response = await post(proxy, LONG)

    assert response.status_code == 400
    assert len(prefill_engine.requests) + len(two_prefill.requests) == 1
    assert decode_engine.requests == []


async def test_retries_stop_after_prefill_retries(make_proxy, make_engine, pool, prefill_engine, decode_engine):
    others = [await make_engine(f"prefill-{i}") for i in (1, 2)]
    pool.set_endpoints("prefill", [endpoint(e) for e in (prefill_engine, *others)])
    for engine in (prefill_engine, *others):
        engine.behaviour = Behaviour.ERROR_500
    proxy = await make_proxy(prefill_retries=1, degrade=False)
    response = await post(proxy, LONG)

    assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert sum(len(e.requests) for e in (prefill_engine, *others)) == 2  # the first try and one retry
    assert decode_engine.requests == []


async def test_no_retry_with_prefill_retries_0(make_proxy, prefill_engine, two_prefill):
    prefill_engine.behaviour = two_prefill.behaviour = Behaviour.ERROR_500
    proxy = await make_proxy(prefill_retries=0, degrade=False)

    assert (await post(proxy, LONG)).status_code == 502
    assert len(prefill_engine.requests) + len(two_prefill.requests) == 1


async def test_the_only_prefill_engine_is_not_tried_twice(make_proxy, prefill_engine):
    prefill_engine.behaviour = Behaviour.ERROR_500
    proxy = await make_proxy(degrade=False)

    assert (await post(proxy, LONG)).status_code == 502
    assert len(prefill_engine.requests) == 1


# --- decode-only ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_short_prompt_is_served_by_the_decode_engine_alone(make_proxy, prefill_engine, decode_engine, stream):
    proxy = await make_proxy(decode_only_below_tokens=32)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=SHORT | {"stream": stream}) as response:
            await response.aread()

    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "decode-only; reason=short-prompt"
    assert response.headers["x-pdserve-decode"] == "decode-0"
    assert "x-pdserve-prefill" not in response.headers
    assert prefill_engine.requests == []
    (received,) = decode_engine.requests
    assert received.body == SHORT | {"stream": stream}
    assert "kv_transfer_params" not in received.body
    if not stream:
        assert answer_of("/v1/completions", response.json()) == answer_text("decode-0", with_kv=False)


async def test_a_long_prompt_is_disaggregated(make_proxy, prefill_engine, decode_engine):
    proxy = await make_proxy(decode_only_below_tokens=32)
    response = await post(proxy, LONG)

    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "disaggregated"
    assert response.headers["x-pdserve-prefill"] == "prefill-0"
    assert len(prefill_engine.requests) == 1
    assert decode_engine.requests[0].body["kv_transfer_params"]["remote_engine_id"] == "prefill-0"


async def test_every_response_says_how_it_was_served_errors_too(client, decode_engine):
    ok = await client.post(CHAT_PATH, json=CHAT)
    decode_engine.behaviour = Behaviour.ERROR_500
    failed = await client.post(CHAT_PATH, json=CHAT)
    invalid = await client.post(CHAT_PATH, json={"model": PROXY_MODEL})

    assert ok.headers["x-pdserve-path"] == "disaggregated"
    assert failed.status_code == 502 and failed.headers["x-pdserve-path"] == "disaggregated"
    assert invalid.status_code == 400 and "x-pdserve-path" not in invalid.headers  # not known: never routed


async def test_a_prompt_the_decode_engine_was_just_sent_goes_decode_only(make_proxy, prefill_engine, decode_engine):
    proxy = await make_proxy(decode_only_if_cached=True, prefix_block_chars=16)
    first, second = await post(proxy, LONG), await post(proxy, LONG)

    assert first.headers["x-pdserve-path"] == "disaggregated"
    assert second.headers["x-pdserve-path"] == "decode-only; reason=cached"
    assert len(prefill_engine.requests) == 1 and len(decode_engine.requests) == 2


async def test_a_prompt_the_shared_tier_holds_goes_decode_only_though_this_proxy_never_saw_it(
    make_proxy, prefill_engine, decode_engine
):
    proxy = await make_proxy(decode_only_if_cached=True, prefix_block_chars=16, tier_pools=("prefill", "decode"))
    decode_engine.tier_fraction = prefill_engine.tier_fraction = 0.9  # another proxy's, or a past run's, prompt

    response = await post(proxy, LONG)

    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "decode-only; reason=cached"
    assert not prefill_engine.requests and len(decode_engine.requests) == 1
    lookups = prefill_engine.tier_lookups + decode_engine.tier_lookups
    assert lookups == [{"body": LONG}]
    assert await tier_lookups(proxy, "ok") == 1


async def test_prefix_aware_sends_prompts_where_the_engines_kv_events_say_they_are_held(
    make_proxy, prefill_engine, two_prefill, decode_engine
):
    for engine in (prefill_engine, two_prefill, decode_engine):
        engine.prompt_blocks = [11, 12, 13, 14]  # every prompt's blocks, as the engine asked hashes them
    prefill_engine.held_blocks, two_prefill.held_blocks, decode_engine.held_blocks = [], [11, 12, 13, 14], []
    proxy = await make_proxy(prefill_policy="prefix_aware", prefix_block_chars=16)
    await wait_until(lambda: proxy.app.state.router.residency.live("prefill-1"), 10)

    prompts = [{"model": PROXY_MODEL, "prompt": f"Story {n}: " + "a lighthouse keeper. " * 10} for n in range(4)]
    responses = [await post(proxy, body) for body in prompts]

    assert [r.headers["x-pdserve-prefill"] for r in responses] == ["prefill-1"] * 4  # not spread by load
    assert len(prefill_engine.tier_lookups + two_prefill.tier_lookups + decode_engine.tier_lookups) == 4


async def test_without_an_answer_from_the_tier_in_time_a_request_is_routed_as_without_it(
    make_proxy, prefill_engine, decode_engine
):
    proxy = await make_proxy(
        decode_only_if_cached=True, prefix_block_chars=16, tier_pools=("decode",), tier_lookup_timeout_s=0.2
    )
    decode_engine.tier_fraction, decode_engine.tier_delay_s = 1.0, 2.0

    response = await post(proxy, LONG)

    assert response.status_code == 200 and response.headers["x-pdserve-path"] == "disaggregated"
    assert len(prefill_engine.requests) == 1
    assert await tier_lookups(proxy, "failed") == 1


async def test_the_serving_path_is_on_the_request_state_for_middleware(pool, prefill_engine, decode_engine):
    app = create_app(proxy_config(PROXY_MODEL, request_timeout_s=5.0, decode_only_below_tokens=32), pool)
    seen: list[str | None] = []

    @app.middleware("http")
    async def record(request: Request, call_next):
        response = await call_next(request)
        seen.append(getattr(request.state, "serving_path", None))
        return response

    proxy = await ProxyServer(app).start()
    try:
        await post(proxy, SHORT)
        await post(proxy, LONG)
    finally:
        await proxy.stop()
    assert seen == ["decode-only", "disaggregated"]


# --- policies end to end ----------------------------------------------------------------


async def test_prefix_aware_sends_a_shared_prefix_to_one_prefill_engine(make_proxy, make_engine, pool):
    pool.set_endpoints("prefill", [endpoint(await make_engine(f"prefill-{i}")) for i in range(3)])
    proxy = await make_proxy(prefill_policy="prefix_aware", prefix_block_chars=16)
    system = "You are a terse assistant for lighthouse keepers. " * 4

    same = [await post(proxy, {"model": PROXY_MODEL, "prompt": system + f"Q{i}?"}) for i in range(4)]
    different = [await post(proxy, {"model": PROXY_MODEL, "prompt": f"{i}" * 200}) for i in range(3)]

    assert len({r.headers["x-pdserve-prefill"] for r in same}) == 1
    assert len({r.headers["x-pdserve-prefill"] for r in different}) == 3


async def test_least_loaded_avoids_the_engine_with_a_queue(make_proxy, pool, decode_engine, two_decode):
    decode_engine.waiting = 5  # reported on its /metrics
    proxy = await make_proxy(decode_policy="least_loaded", metrics_interval_s=0.02)
    await wait_until(lambda: pool.engine("decode-0").waiting == 5)

    responses = [await post(proxy, LONG) for _ in range(4)]
    assert {r.headers["x-pdserve-decode"] for r in responses} == {"decode-1"}


async def test_least_loaded_counts_the_proxys_own_requests(make_proxy, pool, decode_engine, two_decode):
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM  # holds its stream open
    proxy = await make_proxy(request_timeout_s=10, decode_policy="least_loaded", metrics_interval_s=0)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as held:
            # All equal at first: the tie goes to the first engine.
            assert held.headers["x-pdserve-decode"] == "decode-0"
            assert in_flight(pool)["decode-0"] == 1
            later = [await client.post("/v1/completions", json=LONG) for _ in range(3)]

    assert {r.headers["x-pdserve-decode"] for r in later} == {"decode-1"}
    await wait_until(lambda: set(in_flight(pool).values()) == {0})


# --- ejection ---------------------------------------------------------------------------


async def test_an_unreachable_prefill_engine_is_ejected_then_503_when_none_is_left(
    make_proxy, pool, prefill_engine, two_prefill
):
    proxy = await make_proxy(unhealthy_after=2, health_interval_s=60, degrade=False)
    await prefill_engine.stop()  # connection refused
    served = [await post(proxy, LONG) for _ in range(4)]

    assert [r.status_code for r in served] == [200] * 4  # retried on prefill-1
    assert not pool.engine("prefill-0").healthy
    await two_prefill.stop()
    assert (await post(proxy, LONG)).status_code == 502
    assert (await post(proxy, LONG)).status_code == 502
    response = await post(proxy, LONG)

    error = assert_openai_error(response, 503, error_type="service_unavailable", code="no_healthy_engine")
    assert "prefill" in error["message"] and response.headers["retry-after"] == "5"
    health = await httpx.AsyncClient(base_url=proxy.url).get("/health")
    assert health.status_code == 503
    assert [e["healthy"] for e in health.json()["engines"]["prefill"]] == [False, False]


async def first_sweep_done(*engines) -> None:
    """The proxy's first health sweep runs as it starts: wait until it found ``engines`` up, or an engine a
    test stops next could be ejected by that sweep before its request tries it."""
    await wait_until(lambda: all(e.health_probes for e in engines))
    await asyncio.sleep(0.2)  # the sweep's answers reach the tracker


async def test_once_every_prefill_engine_is_ejected_requests_go_decode_only(
    make_proxy, pool, prefill_engine, two_prefill, decode_engine
):
    proxy = await make_proxy(unhealthy_after=1, health_interval_s=60)
    await first_sweep_done(prefill_engine, two_prefill, decode_engine)
    await prefill_engine.stop()
    await two_prefill.stop()
    failed = await post(proxy, LONG)  # both tried, both fail, both are ejected: the decode engine serves it
    assert failed.status_code == 200
    assert failed.headers["x-pdserve-path"] == "decode-only; reason=prefill-failed"
    assert "x-pdserve-prefill" not in failed.headers
    degraded = await post(proxy, LONG)
    assert degraded.status_code == 200
    assert degraded.headers["x-pdserve-path"] == "decode-only; reason=no-prefill-engine"
    assert "kv_transfer_params" not in decode_engine.requests[-1].body


async def test_an_engine_failing_its_health_checks_is_ejected_and_readmitted(
    make_proxy, pool, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=0.02, unhealthy_after=2, healthy_after=2)
    two_decode.health_status = 503
    await wait_until(lambda: not pool.engine("decode-1").healthy)

    while_ejected = [await post(proxy, LONG) for _ in range(3)]
    two_decode.health_status = 200
    await wait_until(lambda: pool.engine("decode-1").healthy)
    after = [await post(proxy, LONG) for _ in range(2)]

    assert {r.headers["x-pdserve-decode"] for r in while_ejected} == {"decode-0"}
    assert {r.headers["x-pdserve-decode"] for r in after} == {"decode-0", "decode-1"}


async def test_a_drained_engine_gets_no_new_requests(make_proxy, pool, decode_engine, two_decode):
    proxy = await make_proxy()
    pool.drain("decode-0")
    responses = [await post(proxy, LONG) for _ in range(3)]

    assert {r.headers["x-pdserve-decode"] for r in responses} == {"decode-1"}
    assert decode_engine.requests == []


# --- in-flight counts -------------------------------------------------------------------


async def test_in_flight_counts_are_zero_after_success_and_failure(make_proxy, pool, prefill_engine, decode_engine):
    proxy = await make_proxy()
    assert (await post(proxy, LONG)).status_code == 200
    assert (await post(proxy, LONG | {"stream": True})).status_code == 200
    decode_engine.behaviour = Behaviour.ERROR_500
    assert (await post(proxy, LONG)).status_code == 502
    decode_engine.behaviour = Behaviour.DROP
    assert (await post(proxy, LONG | {"stream": True})).status_code == 200  # dies mid-stream
    prefill_engine.behaviour = Behaviour.ERROR_500
    assert (await post(proxy, LONG)).status_code == 502

    await wait_until(lambda: set(in_flight(pool).values()) == {0})


async def test_in_flight_counts_a_running_stream_and_return_to_zero_when_the_client_leaves(
    make_proxy, pool, decode_engine
):
    proxy = await make_proxy(request_timeout_s=30)
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        async with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as response:
            async for _ in response.aiter_raw():
                break
            assert in_flight(pool) == {"prefill-0": 0, "decode-0": 1}

    await wait_until(lambda: decode_engine.requests[0].disconnected)
    await wait_until(lambda: in_flight(pool)["decode-0"] == 0)


async def test_in_flight_counts_a_prefill_under_way_and_return_to_zero_when_it_times_out(
    make_proxy, pool, prefill_engine
):
    prefill_engine.behaviour = Behaviour.HANG
    proxy = await make_proxy(request_timeout_s=0.5, degrade=False)
    request = asyncio.create_task(post(proxy, LONG))
    await wait_until(lambda: in_flight(pool)["prefill-0"] == 1)

    assert (await request).status_code == 502
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0}


@pytest.mark.parametrize("bound", [False, True], ids=["kv-unbound", "kv-bound-to-the-failed-engine"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_decode_engine_that_cannot_be_reached_is_replaced_by_another_that_computes_the_prompt(
    make_proxy, pool, side_channel, prefill_engine, decode_engine, two_decode, bound, stream
):
    """The failed engine may have read the KV (vLLM's NixlConnector then frees it at the prefill, with no lease):
    bound to it or not, its transfer parameters go to no other engine; they are released, and decode-1 computes
    the prompt."""
    proxy = await make_proxy(health_interval_s=60, bind_reader=bound)
    await first_sweep_done(prefill_engine, decode_engine, two_decode)
    await decode_engine.stop()  # round robin picks decode-0 first

    served = await post(proxy, LONG | {"stream": stream}, headers={"X-Request-Id": "req-9"})

    assert served.status_code == 200
    assert served.headers["x-pdserve-decode"] == "decode-1"
    path = "/v1/completions"
    text = streamed_text(path, sse_events(served.text)) if stream else answer_of(path, served.json())
    assert text == answer_text("decode-1", with_kv=False)
    assert "kv_transfer_params" not in two_decode.requests[-1].body
    assert served.headers["x-pdserve-path"] == "decode-only; reason=decode-failed"
    assert await released(side_channel) == ["PDRL req-9"]
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}


async def test_a_decode_engine_that_answers_500_is_not_replaced(
    make_proxy, pool, side_channel, prefill_engine, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=60)
    decode_engine.behaviour = Behaviour.ERROR_500  # it may have begun: another would compute it again

    failed = await post(proxy, LONG, headers={"X-Request-Id": "req-10"})

    assert_openai_error(failed, 502, error_type="upstream_error", code="engine_failed")
    assert two_decode.requests == []
    assert await released(side_channel) == ["PDRL req-10"]


async def test_decode_retries_0_gives_502_when_the_decode_engine_is_down(
    make_proxy, pool, side_channel, prefill_engine, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=60, decode_retries=0)
    await first_sweep_done(prefill_engine, decode_engine, two_decode)
    await decode_engine.stop()

    failed = await post(proxy, LONG, headers={"X-Request-Id": "req-11"})

    assert failed.status_code == 502
    assert two_decode.requests == []
    assert await released(side_channel) == ["PDRL req-11"]


async def test_a_decode_engine_that_dies_under_a_request_hands_it_to_another_within_the_bounds(
    make_proxy, pool, prefill_engine, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=0, bind_reader=True)
    decode_engine.behaviour = Behaviour.DROP  # kill -9 while it generates: the connection breaks, no answer

    served = await post(proxy, LONG | {"seed": 7}, headers={"X-Request-Id": "req-11"})

    assert served.status_code == 200, served.text
    assert served.headers["x-pdserve-decode"] == "decode-1" and served.headers["x-pdserve-migrated"] == "decode-0"
    assert served.headers["x-pdserve-path"] == "decode-only; reason=decode-failed"  # its KV was decode-0's
    assert answer_of("/v1/completions", served.json()) == answer_text("decode-1", with_kv=False)
    assert two_decode.requests[-1].body["seed"] == 7  # the request as the client sent it
    two_decode.behaviour = Behaviour.DROP  # both die: two moves at most, none left to go to
    failed = await post(proxy, LONG)
    assert failed.status_code == 200 and failed.headers["x-pdserve-migrated"] == "decode-0, decode-1"
    assert failed.headers["x-pdserve-path"] == "prefill-only; reason=decode-failed"
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        samples = await scrape(client)
    moved = "pdserve_proxy_decode_migrations_total"
    assert samples[(moved, (("model", PROXY_MODEL), ("outcome", "served")))] == 2
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}

    off = await make_proxy(health_interval_s=0, decode_retries=1, degrade=False)
    refused = await post(off, LONG)
    assert refused.status_code == 502  # one move, to decode-1, which died too
    async with httpx.AsyncClient(base_url=off.url, timeout=10) as client:
        samples = await scrape(client)
    assert samples[(moved, (("model", PROXY_MODEL), ("outcome", "failed")))] == 1
