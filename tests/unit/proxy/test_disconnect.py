"""A client that goes away takes its request with it (``proxy.disconnect``).

Whether it leaves while the prefill or the decode engine works on a JSON
answer, or before a stream's first chunk, the stub engine sees its connection
closed (vLLM then aborts the request), the prefill engine is told to release
the KV it holds, and ``/metrics`` counts the request as 499. A prefill engine
whose KV can be released (its side channel known) is let answer instead, and
its KV released at once. Every log line about the request names it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import orjson
import pytest
from aiohttp import web

from proxy.app import ProxyConfig, create_app
from proxy.pool import Endpoint
from proxy.relay import BoundedSend, StreamCut
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


@pytest.mark.parametrize("http", ["ours", "httptools"])
async def test_leaving_during_a_releasable_prefill_lets_it_answer_and_releases_its_kv_at_once(
    pool, side_channel, prefill_engine, decode_engine, http
):
    """An engine that can be told to free its KV (its side channel known: the ``pdserve`` connector) may have
    finished when the client leaves, its answer on the way: an abort would free nothing, and its blocks would
    wait out their lease. Its call goes on to the answer, and the KV it names is released at once."""
    pool.set_endpoints("prefill", [Endpoint(prefill_engine.name, prefill_engine.url, (side_channel.endpoint,))])
    overrides = {} if http == "ours" else {"http": "httptools"}
    config = ProxyConfig(model_name=PROXY_MODEL, request_timeout_s=PATIENT_S, health_interval_s=0)
    server = await ProxyServer(create_app(config, pool), **overrides).start()
    prefill_engine.behaviour = Behaviour.HANG
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await leave_once(client, prefill_engine, CHAT, "gone-6")
            await asyncio.sleep(0.3)  # the proxy has seen the client leave
            assert not prefill_engine.requests[0].disconnected
            assert side_channel.messages == []  # nothing to release before the answer
            assert pool.engine(prefill_engine.name).in_flight == 1  # the engine still works for it

            prefill_engine.release()  # the prefill answers

            assert await released(side_channel) == ["PDRL gone-6"]
            assert not prefill_engine.requests[0].disconnected
            assert decode_engine.requests == []
            await wait_until(lambda: pool.engine(prefill_engine.name).in_flight == 0)
            await wait_until(lambda: pool.engine(decode_engine.name).in_flight == 0)
            metrics = (await client.get("/metrics")).text
    finally:
        await server.stop()
    assert 'route="/v1/chat/completions",status="499"} 1.0' in metrics


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


# --- a client that stays but stops reading --------------------------------------------------

BIG_EVENT = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "x" * 65536}]}) + b"\n\n"


async def stream_without_end(request: web.Request, received: object) -> web.StreamResponse:
    """An engine that generates for as long as it is read: 64-KiB events, 128 MiB at most (far more than the
    sockets and buffers between it and a client that reads nothing hold)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(2048):
        await response.write(BIG_EVENT)
    return response


async def send_and_stop_reading(url: str, body: dict) -> socket.socket:
    """A client on a connection with a small receive buffer that sends ``body`` and then reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    payload = orjson.dumps(body)
    head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    await loop.sock_sendall(sock, head.encode() + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


async def read_to_the_end(sock: socket.socket) -> None:
    """Read what the connection still holds until the proxy's close (FIN or reset) shows."""
    loop = asyncio.get_running_loop()
    try:
        while await loop.sock_recv(sock, 1 << 20):
            pass
    except ConnectionResetError:
        pass


@pytest.mark.parametrize("http", ["ours", "httptools"])
async def test_a_stream_whose_client_stops_reading_is_cut_after_the_write_timeout(
    pool, prefill_engine, decode_engine, http
):
    """The client stays connected but reads nothing: once the buffers between are full, the proxy's send waits;
    after ``stream_write_timeout_s`` the client's connection is closed, the engine's request cancelled and the
    admission slot and the engine's count given back."""
    decode_engine.handler = stream_without_end
    overrides = {} if http == "ours" else {"http": "httptools"}
    config = ProxyConfig(
        model_name=PROXY_MODEL, request_timeout_s=PATIENT_S, stream_write_timeout_s=0.5, health_interval_s=0,
        max_concurrent_requests=1, max_queued_requests=0,
    )  # fmt: skip
    server = await ProxyServer(create_app(config, pool), **overrides).start()
    flow = server.app.state.flow
    sock = await send_and_stop_reading(server.url, CHAT | {"stream": True})
    try:
        await wait_until(lambda: bool(decode_engine.requests), 5)
        assert flow.gate.running == 1

        await wait_until(lambda: decode_engine.requests[0].disconnected, 10)
        await wait_until(lambda: flow.gate.running == 0 and pool.engine(decode_engine.name).in_flight == 0)
        await asyncio.wait_for(read_to_the_end(sock), 5)
    finally:
        sock.close()
        await server.stop()


async def test_where_the_connection_cannot_be_reached_the_waiting_send_is_cut_with_stream_cut():
    """Under a server whose transport ``BoundedSend`` cannot reach, the send that waits too long is cancelled
    and raises ``StreamCut``; sends that do not wait are left alone."""
    client_reads = asyncio.Event()
    client_reads.set()

    async def send(message) -> None:
        await client_reads.wait()

    async def receive() -> dict:
        return {"type": "http.request"}

    bounded = BoundedSend(send, receive, 0.2, "cut-1")
    for _ in range(3):
        await bounded({"type": "http.response.body"})
        await asyncio.sleep(0.1)  # 0.3 s in all, no send waited
    client_reads.clear()  # the client stops reading
    started = time.monotonic()
    with pytest.raises(StreamCut):
        await bounded({"type": "http.response.body"})
    assert bounded.cut and 0.1 < time.monotonic() - started < 1.0
    assert asyncio.current_task().cancelling() == 0  # the cut's cancellation is not left on the task
    bounded.close()
