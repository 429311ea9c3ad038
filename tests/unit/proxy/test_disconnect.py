"""A client that goes away takes its request with it (``proxy.disconnect``).

Whether it leaves while the prefill or the decode engine works on a JSON
answer, or before a stream's first chunk, the stub engine sees its connection
closed (vLLM then aborts the request), the prefill engine is told to release
the KV it holds, and ``/metrics`` counts the request as 499. Every log line
about the request names it.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from aiohttp import web

from proxy.app import ProxyConfig, create_app
from tests.stub_engine import Behaviour
from tests.unit.conftest import PROXY_MODEL, ProxyServer, released
from tests.unit.proxy_requests import CHAT, CHAT_PATH, wait_until

pytestmark = pytest.mark.timeout(15)

# The proxy waits far longer than the tests: a request must end because its client left, not on a timeout.
PATIENT_S = 30.0


async def leave_once(client, engine, request: dict, request_id: str) -> None:
    """Send ``request``, wait until ``engine`` has it, then hang up."""
    call = asyncio.create_task(client.post(CHAT_PATH, json=request, headers={"X-Request-Id": request_id}))
    await wait_until(lambda: bool(engine.requests) or call.done())
    assert not call.done(), call.result().text
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_leaving_during_prefill_cancels_the_prefill_request(make_client, prefill_engine, decode_engine):
    client = await make_client(request_timeout_s=PATIENT_S)
    prefill_engine.behaviour = Behaviour.HANG

    await leave_once(client, prefill_engine, CHAT, "gone-1")

    await wait_until(lambda: prefill_engine.requests[0].disconnected)
    assert decode_engine.requests == []
    metrics = (await client.get("/metrics")).text
    counted = 'pdserve_proxy_requests_total{model="m",path="disaggregated",route="/v1/chat/completions",status="499"}'
    assert counted + " 1.0" in metrics


async def test_under_uvicorns_own_protocol_a_watcher_notices(pool, prefill_engine):
    """Our protocol reports a disconnect itself; under another (``pdserve`` apps served by someone
    else's uvicorn) a task per request watches ``receive()`` for it."""
    server = await ProxyServer(
        create_app(ProxyConfig(model_name=PROXY_MODEL, request_timeout_s=PATIENT_S), pool), http="httptools"
    ).start()
    prefill_engine.behaviour = Behaviour.HANG
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await leave_once(client, prefill_engine, CHAT, "gone-9")
            await wait_until(lambda: prefill_engine.requests[0].disconnected)
    finally:
        await server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse-before-first-chunk"])
async def test_leaving_during_decode_cancels_it_and_releases_the_kv(
    make_client, side_channel, prefill_engine, decode_engine, stream
):
    client = await make_client(request_timeout_s=PATIENT_S)
    decode_engine.behaviour = Behaviour.HANG

    await leave_once(client, decode_engine, CHAT | {"stream": stream}, "gone-2")

    await wait_until(lambda: decode_engine.requests[0].disconnected)
    assert await released(side_channel) == ["PDRL gone-2"]
    assert not prefill_engine.requests[0].disconnected  # it had answered


async def test_leaving_while_a_reported_stream_waits_for_its_first_chunk_ends_the_leg_and_releases_the_kv(
    make_client, pool, side_channel, report_ranks, decode_engine
):
    """With a side channel to ask (``pdserve`` connector), a stream's headers wait for its first chunk."""
    client = await make_client(request_timeout_s=PATIENT_S)
    headers_sent = asyncio.Event()

    async def headers_then_nothing(request: web.Request, received: object) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        headers_sent.set()
        await asyncio.sleep(3600)
        return response

    decode_engine.handler = headers_then_nothing
    call = asyncio.create_task(client.post(CHAT_PATH, json=CHAT | {"stream": True}, headers={"X-Request-Id": "gone-5"}))
    await asyncio.wait_for(headers_sent.wait(), 5)
    await asyncio.sleep(0.1)  # the proxy now waits for the first chunk
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    await wait_until(lambda: decode_engine.requests[0].disconnected)
    assert await released(side_channel) == ["PDRL gone-5"]
    await wait_until(lambda: pool.engine(decode_engine.name).in_flight == 0)
    assert [rank.messages for rank in report_ranks] == [[], []]  # no first chunk: no report asked


async def test_the_engines_serve_the_next_request_after_a_cancelled_one(make_client, prefill_engine, decode_engine):
    client = await make_client(request_timeout_s=PATIENT_S)
    decode_engine.behaviour = Behaviour.HANG
    await leave_once(client, decode_engine, CHAT, "gone-3")
    await wait_until(lambda: decode_engine.requests[0].disconnected)

    decode_engine.behaviour = Behaviour.OK
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200, response.text
    # The cancelled call's connection was closed, not handed to the next request.
    assert decode_engine.requests[1].peer != decode_engine.requests[0].peer


async def test_log_lines_about_a_request_name_it(make_client, side_channel, decode_engine, caplog):
    client = await make_client(request_timeout_s=PATIENT_S)
    decode_engine.behaviour = Behaviour.HANG
    with caplog.at_level(logging.DEBUG, logger="proxy"):
        await leave_once(client, decode_engine, CHAT, "gone-4")
        await wait_until(lambda: decode_engine.requests[0].disconnected)
        assert await released(side_channel) == ["PDRL gone-4"]
        decode_engine.behaviour = Behaviour.ERROR_500
        assert (await client.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "bad-5"})).status_code == 502
        await wait_until(lambda: len(side_channel.messages) == 2)

    lines = [record.getMessage() for record in caplog.records if record.name.startswith("proxy")]
    assert any("client went away" in line for line in lines)
    assert any("released" in line for line in lines)
    assert all("gone-4" in line or "bad-5" in line for line in lines), lines
    assert any("decode engine decode-0" in line and "bad-5" in line for line in lines)
