"""A request's legs count on their engines from the moment they are routed (``Exchange.routed``,
``Exchange.leg_starts``), so that a drain issued while a prefill runs waits for the decode leg after it.

First the counting itself, on an ``Exchange`` and ``EngineState``s alone; then the proxy for real
against stub engines: every way a request can end gives every count back (no leak, no double count),
and a drain between routing and the decode leg's start waits for that request, as the controller's
``_wait_drained`` does (it reads ``in_flight`` from the pool's snapshot); a drain waits for a ``/tokenize``
too, which takes an admission slot like any request.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from aiohttp import web

from contract import wire
from proxy.pool import EngineState
from proxy.routing import SHORT_PROMPT, Route
from tests.stub_engine import Behaviour, error_body
from tests.unit.conftest import PROXY_MODEL, ProxyServer, endpoint
from tests.unit.proxy_factories import make_exchange
from tests.unit.proxy_requests import wait_until

pytestmark = pytest.mark.timeout(20)

LONG = {"model": PROXY_MODEL, "prompt": "Tell me a story about a lighthouse keeper. " * 10}
SHORT = {"model": PROXY_MODEL, "prompt": "Hi"}


def in_flight(pool) -> dict[str, int]:
    return {e["engine_id"]: e["in_flight"] for role in pool.snapshot().values() for e in role}


def engine(engine_id: str) -> EngineState:
    return EngineState(engine_id, f"http://{engine_id}:8000", engine_id.split("-")[0])


async def post(proxy: ProxyServer, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        return await client.post(path, json=body, **kwargs)


# --- the counting, on an exchange ---------------------------------------------------------


def test_routing_counts_both_engines_and_each_leg_takes_its_count_over():
    exchange, prefill, decode = make_exchange(), engine("prefill-0"), engine("decode-0")

    exchange.routed(Route(prefill, decode, ()))
    assert (prefill.in_flight, decode.in_flight) == (1, 1)  # both, before either leg starts

    exchange.leg_starts(prefill)
    assert prefill.in_flight == 1  # taken over, not counted twice
    prefill.end_leg()
    assert (prefill.in_flight, decode.in_flight) == (0, 1)  # the decode count holds after the prefill

    exchange.leg_starts(decode)
    assert decode.in_flight == 1
    decode.end_leg()
    exchange.close(200)
    assert (prefill.in_flight, decode.in_flight) == (0, 0)


@pytest.mark.parametrize("prefill_started", [False, True], ids=["before-the-prefill", "after-the-prefill"])
def test_closing_gives_back_the_counts_of_legs_that_never_started(prefill_started):
    exchange, prefill, decode = make_exchange(), engine("prefill-0"), engine("decode-0")
    exchange.routed(Route(prefill, decode, ()))
    if prefill_started:
        exchange.leg_starts(prefill)
        prefill.end_leg()  # it failed, or the client went away during it

    exchange.close(499)
    exchange.close(499)  # a second close counts nothing back

    assert (prefill.in_flight, decode.in_flight) == (0, 0)


def test_a_retrys_engine_counts_from_its_leg_and_the_routed_one_is_not_counted_twice():
    exchange, prefill, decode = make_exchange(), engine("prefill-0"), engine("decode-0")
    other_prefill, other_decode = engine("prefill-1"), engine("decode-1")
    exchange.routed(Route(prefill, decode, ()))
    exchange.leg_starts(prefill)
    prefill.end_leg()  # failed: tried again on prefill-1

    exchange.leg_starts(other_prefill)
    assert (prefill.in_flight, other_prefill.in_flight, decode.in_flight) == (0, 1, 1)
    other_prefill.end_leg()
    exchange.leg_starts(decode)
    decode.end_leg()  # unreachable: replaced by decode-1
    exchange.leg_starts(other_decode)
    assert (decode.in_flight, other_decode.in_flight) == (0, 1)
    other_decode.end_leg()
    exchange.close(200)

    assert [e.in_flight for e in (prefill, other_prefill, decode, other_decode)] == [0, 0, 0, 0]


def test_a_decode_only_request_counts_its_one_engine():
    exchange, decode = make_exchange(), engine("decode-0")

    exchange.routed(Route(None, decode, (), SHORT_PROMPT))
    assert decode.in_flight == 1
    exchange.close(503)

    assert decode.in_flight == 0


# --- the proxy: every ending gives every count back ---------------------------------------


async def answer_400(request: web.Request, received) -> web.Response:
    return web.json_response(error_body("bad request", "BadRequestError", 400), status=400)


ENDINGS = [
    pytest.param(Behaviour.OK, Behaviour.OK, LONG, {}, 200, id="served"),
    pytest.param(Behaviour.OK, Behaviour.OK, LONG | {"stream": True}, {}, 200, id="served-stream"),
    pytest.param(Behaviour.OK, Behaviour.OK, SHORT, {"decode_only_below_tokens": 8}, 200, id="decode-only"),
    pytest.param(Behaviour.ERROR_500, Behaviour.OK, LONG, {}, 200, id="prefill-500-degraded"),
    pytest.param(Behaviour.ERROR_500, Behaviour.OK, LONG, {"degrade": False}, 502, id="prefill-500"),
    pytest.param(Behaviour.DROP, Behaviour.OK, LONG, {"degrade": False}, 502, id="prefill-dropped"),
    pytest.param(Behaviour.HANG, Behaviour.OK, LONG, {"degrade": False}, 502, id="prefill-timeout"),
    pytest.param(Behaviour.ERROR_400, Behaviour.OK, LONG, {}, 400, id="prefill-400"),
    pytest.param(Behaviour.OK, Behaviour.ERROR_500, LONG, {}, 502, id="decode-500"),
    pytest.param(Behaviour.OK, Behaviour.ERROR_400, LONG, {}, 400, id="decode-400"),
    pytest.param(Behaviour.OK, Behaviour.DROP, LONG, {}, 200, id="decode-dropped-moved-to-the-prefill-engine"),
    pytest.param(Behaviour.OK, Behaviour.DROP, LONG, {"degrade": False}, 502, id="decode-dropped"),
    pytest.param(Behaviour.OK, Behaviour.DROP, LONG | {"stream": True}, {}, 200, id="decode-dropped-mid-stream"),
    pytest.param(Behaviour.OK, Behaviour.HANG, LONG, {}, 502, id="decode-timeout"),
    pytest.param(Behaviour.OK, Behaviour.OK, {"model": PROXY_MODEL}, {}, 400, id="refused-before-routing"),
]


@pytest.mark.parametrize(("prefill", "decode", "body", "settings", "status"), ENDINGS)
async def test_every_ending_gives_every_count_back(
    make_proxy, pool, prefill_engine, decode_engine, prefill, decode, body, settings, status
):
    prefill_engine.behaviour, decode_engine.behaviour = prefill, decode
    proxy = await make_proxy(health_interval_s=0, **settings)

    response = await post(proxy, body)

    assert response.status_code == status, response.text
    await wait_until(lambda: set(in_flight(pool).values()) == {0})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_client_gone_during_either_leg_gives_every_count_back(
    make_proxy, pool, prefill_engine, decode_engine, leg, stream
):
    proxy = await make_proxy(request_timeout_s=30)
    hanging = prefill_engine if leg == "prefill" else decode_engine
    hanging.behaviour = Behaviour.HANG
    call = asyncio.create_task(post(proxy, LONG | {"stream": stream}))
    await wait_until(lambda: bool(hanging.requests))
    assert in_flight(pool) == {"prefill-0": int(leg == "prefill"), "decode-0": 1}  # each engine once

    call.cancel()
    await asyncio.gather(call, return_exceptions=True)

    await wait_until(lambda: hanging.requests[0].disconnected)
    await wait_until(lambda: set(in_flight(pool).values()) == {0})


async def test_after_many_requests_ending_every_way_at_once_every_count_is_zero(
    make_proxy, pool, prefill_engine, decode_engine, make_engine
):
    """Each request says, in its ``user`` field, how each engine treats it; some clients leave mid-way."""
    second_decode = await make_engine("decode-1")
    pool.set_endpoints("decode", [endpoint(decode_engine), endpoint(second_decode)])

    async def by_user(request: web.Request, received) -> web.StreamResponse | None:
        role = "prefill" if received.is_prefill else "decode"
        fate = dict(part.split("=") for part in received.body.get("user", "").split(",") if part).get(role)
        if fate == "500":
            return web.json_response(error_body("engine failed", "InternalServerError", 500), status=500)
        if fate == "400":
            return await answer_400(request, received)
        if fate == "hang":
            await asyncio.sleep(30)
        return None  # as the stub's behaviour says: OK

    for stub in (prefill_engine, decode_engine, second_decode):
        stub.handler = by_user
    proxy = await make_proxy(request_timeout_s=0.5, health_interval_s=0)
    fates = ["", "prefill=500", "prefill=400", "prefill=hang", "decode=500", "decode=400", "decode=hang"]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        calls = [
            asyncio.create_task(client.post("/v1/completions", json=LONG | {"user": fate, "stream": i % 2 == 1}))
            for i in range(4)
            for fate in fates
        ]
        leaving = [
            asyncio.create_task(client.post("/v1/completions", json=LONG | {"user": f"{role}=hang"}))
            for role in ("prefill", "decode")
            for _ in range(3)
        ]
        await asyncio.sleep(0.2)
        for call in leaving:
            call.cancel()
        statuses = [r.status_code for r in await asyncio.gather(*calls)]
        await asyncio.gather(*leaving, return_exceptions=True)

    assert set(statuses) <= {200, 400, 502} and statuses.count(200) >= 8
    await wait_until(lambda: set(in_flight(pool).values()) == {0}, 5)


# --- a drain between routing and the decode leg -------------------------------------------


async def wait_drained(pool, engine_id: str, role: str, poll_s: float = 0.02) -> float:
    """What the controller does before it moves or stops a draining engine: wait until the proxy has
    nothing in flight on it (``orchestrator.pool_changes.PoolChanges._busy``). When it ended (``time.monotonic``)."""
    while any(e["engine_id"] == engine_id and e["in_flight"] for e in pool.snapshot()[role]):
        await asyncio.sleep(poll_s)
    return time.monotonic()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_drain_issued_while_the_prefill_runs_waits_for_the_decode_leg(
    make_proxy, pool, prefill_engine, decode_engine, stream
):
    decode_started: list[float] = []

    async def note_the_time(request: web.Request, received) -> None:
        decode_started.append(time.monotonic())

    decode_engine.handler = note_the_time
    proxy = await make_proxy(request_timeout_s=30)
    prefill_engine.behaviour = Behaviour.HANG
    call = asyncio.create_task(post(proxy, LONG | {"stream": stream}, headers={"X-Request-Id": "moved-1"}))
    await wait_until(lambda: bool(prefill_engine.requests))
    assert decode_engine.requests == []  # routed to decode-0, whose leg has not started

    pool.drain("decode-0")  # a role move or a scale-down takes decode-0 out of routing
    drained = asyncio.create_task(wait_drained(pool, "decode-0", "decode"))
    await asyncio.sleep(0.3)
    assert not drained.done(), "the drain saw nothing in flight on the engine a request was routed to"

    prefill_engine.behaviour = Behaviour.OK
    prefill_engine.release()
    response = await call
    drained_at = await asyncio.wait_for(drained, 5)

    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-decode"] == "decode-0"  # served where it was routed
    assert [r.path for r in decode_engine.decode_requests] == ["/v1/completions"]
    assert drained_at > decode_started[0]  # the drain ended only after the decode leg had begun (and ended)
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0}


async def test_a_drain_through_the_admin_api_waits_for_a_routed_decode_leg(
    make_proxy, monkeypatch, pool, prefill_engine, decode_engine
):
    monkeypatch.setenv("PD_ADMIN_KEY", "admin-secret")
    proxy = await make_proxy(request_timeout_s=30, admin_key_env=("PD_ADMIN_KEY",))
    prefill_engine.behaviour = Behaviour.HANG
    call = asyncio.create_task(post(proxy, LONG))
    await wait_until(lambda: bool(prefill_engine.requests))

    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as admin:
        drained = await admin.post("/admin/engines/decode-0/drain", headers={"X-Admin-Key": "admin-secret"})
    decode_entry = drained.json()["decode"][0]

    assert decode_entry["draining"] is True and decode_entry["in_flight"] == 1
    prefill_engine.behaviour = Behaviour.OK
    prefill_engine.release()
    assert (await call).status_code == 200
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0}


# --- /tokenize and /detokenize: one engine, counted and admitted like any request ----------

ENGINE_ONLY = {wire.TOKENIZE_PATH: {"model": PROXY_MODEL, "prompt": "one two"}, wire.DETOKENIZE_PATH: {"tokens": [1]}}


@pytest.mark.parametrize("path", [wire.TOKENIZE_PATH, wire.DETOKENIZE_PATH])
async def test_a_drain_waits_for_a_tokenize_under_way(make_proxy, pool, prefill_engine, decode_engine, path):
    proxy = await make_proxy(request_timeout_s=30, health_interval_s=0)
    prefill_engine.behaviour = decode_engine.behaviour = Behaviour.HANG
    call = asyncio.create_task(post(proxy, ENGINE_ONLY[path], path=path))
    await wait_until(lambda: sum(in_flight(pool).values()) == 1)
    busy = next(engine_id for engine_id, count in in_flight(pool).items() if count)

    pool.drain(busy)
    drained = asyncio.create_task(wait_drained(pool, busy, busy.split("-")[0]))
    await asyncio.sleep(0.3)
    assert not drained.done(), f"the drain saw nothing in flight on {busy}, which answers a {path}"

    prefill_engine.release()
    decode_engine.release()
    response = await call
    await asyncio.wait_for(drained, 5)  # and the drain ends with it

    assert response.status_code == 200, response.text
    assert in_flight(pool) == {"prefill-0": 0, "decode-0": 0}


@pytest.mark.parametrize("path", [wire.TOKENIZE_PATH, wire.DETOKENIZE_PATH])
async def test_a_tokenize_takes_an_admission_slot(make_proxy, prefill_engine, decode_engine, path):
    proxy = await make_proxy(request_timeout_s=30, max_concurrent_requests=1, max_queued_requests=0)
    prefill_engine.behaviour = decode_engine.behaviour = Behaviour.HANG
    running = asyncio.create_task(post(proxy, ENGINE_ONLY[path], path=path))
    await wait_until(lambda: proxy.app.state.flow.gate.running == 1)

    assert (await post(proxy, LONG)).status_code == 429  # the tokenize holds the one slot
    assert (await post(proxy, ENGINE_ONLY[path], path=path)).status_code == 429

    prefill_engine.behaviour = decode_engine.behaviour = Behaviour.OK
    prefill_engine.release()
    decode_engine.release()
    assert (await running).status_code == 200
    assert (await post(proxy, ENGINE_ONLY[path], path=path)).status_code == 200  # its slot came back
