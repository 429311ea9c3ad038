"""``proxy.engine_client``: the proxy's keep-alive HTTP/1.1 client, against stub engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from proxy.engine_client import READ_HIGH_WATER, EngineClient
from proxy.errors import EngineConnectionError
from tests.stub_engine import Behaviour, StubEngine, answer_text

pytestmark = pytest.mark.timeout(15)

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}
HEADERS = {"Content-Type": "application/json", "X-Request-Id": "r-1"}


@pytest.fixture
async def engine_client() -> AsyncIterator[EngineClient]:
    client = EngineClient()
    yield client
    await client.close()


async def post(client: EngineClient, engine: StubEngine, body: dict = CHAT, timeout_s: float = 5.0):
    return await client.post(engine.url + CHAT_PATH, orjson.dumps(body), HEADERS, timeout_s)


async def test_post_returns_status_headers_and_body(engine_client, decode_engine):
    response = await post(engine_client, decode_engine)
    payload = orjson.loads(await response.read(5))

    assert response.status == 200
    assert response.header(b"content-type").startswith(b"application/json")
    assert payload["choices"][0]["message"]["content"] == answer_text("decode-0", with_kv=False)
    (received,) = decode_engine.requests
    assert received.body == CHAT
    assert received.headers["x-request-id"] == "r-1"
    assert received.headers["host"] == decode_engine.url.removeprefix("http://")


async def test_requests_reuse_one_connection(engine_client, decode_engine):
    for _ in range(3):
        await (await post(engine_client, decode_engine)).read(5)

    assert len({r.peer for r in decode_engine.requests}) == 1


async def test_concurrent_requests_open_connections_and_keep_them(engine_client, decode_engine):
    async def one() -> None:
        await (await post(engine_client, decode_engine)).read(5)

    await asyncio.gather(*(one() for _ in range(4)))
    first_peers = {r.peer for r in decode_engine.requests}
    await asyncio.gather(*(one() for _ in range(4)))

    assert len(first_peers) == 4
    assert {r.peer for r in decode_engine.requests[4:]} <= first_peers


async def test_a_connection_idle_too_long_is_not_reused(decode_engine):
    client = EngineClient(idle_timeout_s=0.05)
    try:
        await (await post(client, decode_engine)).read(5)
        await asyncio.sleep(0.1)
        await (await post(client, decode_engine)).read(5)
    finally:
        await client.close()

    first, second = decode_engine.requests
    assert first.peer != second.peer


async def test_a_connection_the_engine_closed_is_replaced(engine_client, decode_engine):
    await (await post(engine_client, decode_engine)).read(5)
    await decode_engine.stop()  # closes its side of the kept-alive connection
    await decode_engine.start()

    response = await post(engine_client, decode_engine)

    assert response.status == 200 and await response.read(5)
    first, second = decode_engine.requests
    assert first.peer != second.peer


async def test_a_post_lost_on_a_reused_connection_is_not_sent_again(engine_client, decode_engine):
    # The engine read the request, then the connection died: sending it again would run it twice.
    served = []

    async def closes_reused_connections(request: web.Request, received) -> web.Response:
        if received.peer in served:
            request.transport.abort()
            return web.Response(status=500)  # never sent
        served.append(received.peer)
        return web.json_response({"ok": True})

    decode_engine.handler = closes_reused_connections
    await (await post(engine_client, decode_engine)).read(5)

    with pytest.raises(EngineConnectionError):
        await post(engine_client, decode_engine)

    first, lost = decode_engine.requests
    assert first.peer == lost.peer


async def test_a_kept_connection_the_engine_closed_while_idle_is_never_written_to(decode_engine):
    # The engine's FIN is waiting on the socket (the event loop has not seen it yet): the request goes
    # out on a new connection, once.
    client = EngineClient(idle_timeout_s=60)
    try:
        await (await post(client, decode_engine)).read(5)
        (kept,) = next(iter(client._pools.values()))
        kept._transport.pause_reading()  # the loop does not read the FIN: only the check before reuse can
        await decode_engine.stop()
        await decode_engine.start()
        await asyncio.sleep(0.1)

        response = await post(client, decode_engine)

        assert response.status == 200 and await response.read(5)
        assert len(decode_engine.requests) == 2 and decode_engine.requests[0].peer != decode_engine.requests[1].peer
    finally:
        await client.close()


async def test_a_fresh_connection_that_fails_is_not_retried(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.DROP

    with pytest.raises(EngineConnectionError):
        await post(engine_client, decode_engine)

    assert len(decode_engine.requests) == 1


async def test_connection_refused_is_an_engine_connection_error(engine_client, decode_engine):
    await decode_engine.stop()

    with pytest.raises(EngineConnectionError, match="cannot connect"):
        await post(engine_client, decode_engine)


async def test_an_engine_that_says_nothing_times_out(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.HANG
    started = time.monotonic()

    with pytest.raises(TimeoutError):
        await post(engine_client, decode_engine, timeout_s=0.2)

    assert 0.18 <= time.monotonic() - started < 2
    await asyncio.sleep(0.05)
    assert decode_engine.requests[0].disconnected  # the connection was closed, not kept


async def test_an_engine_that_drops_the_connection_is_an_engine_connection_error(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.DROP

    with pytest.raises(EngineConnectionError, match="closed the connection"):
        await post(engine_client, decode_engine)


async def test_an_error_status_is_an_answer(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.ERROR_500
    response = await post(engine_client, decode_engine)

    assert response.status == 500
    assert orjson.loads(await response.read(5))["error"]["code"] == 500


async def test_streamed_answer_arrives_chunk_by_chunk(engine_client, decode_engine):
    response = await post(engine_client, decode_engine, CHAT | {"stream": True})
    chunks = [chunk async for chunk in response.chunks(5)]

    assert response.status == 200
    body = b"".join(chunks).decode()
    assert body.endswith("data: [DONE]\n\n")
    assert body.count("data: ") == len(answer_text("decode-0", False).split()) + 2  # role chunk, words, [DONE]
    assert len(chunks) > 1
    await (await post(engine_client, decode_engine)).read(5)
    assert decode_engine.requests[0].peer == decode_engine.requests[1].peer  # read to its end: kept


async def test_a_stream_left_before_its_end_closes_its_connection(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    response = await post(engine_client, decode_engine, CHAT | {"stream": True})
    async for _ in response.chunks(5):
        break
    response.release()

    deadline = time.monotonic() + 2
    while not decode_engine.requests[0].disconnected:
        assert time.monotonic() < deadline, "the engine never saw the connection close"
        await asyncio.sleep(0.01)
    decode_engine.behaviour = Behaviour.OK
    await (await post(engine_client, decode_engine)).read(5)
    assert decode_engine.requests[0].peer != decode_engine.requests[1].peer


async def test_a_stream_that_stalls_times_out_between_chunks(engine_client, decode_engine):
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    response = await post(engine_client, decode_engine, CHAT | {"stream": True})
    received = []

    with pytest.raises(TimeoutError, match="0.2 s"):
        async for chunk in response.chunks(0.2):
            received.append(chunk)

    assert b"".join(received).count(b"data: ") >= 1


async def test_a_large_stream_read_slowly_arrives_whole(engine_client, decode_engine):
    piece = bytes(range(256)) * 256  # 64 KiB
    pieces = 4 * READ_HIGH_WATER // len(piece)

    async def large(request: web.Request, received) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(pieces):
            await response.write(piece)
        await response.write_eof()
        return response

    decode_engine.handler = large
    response = await post(engine_client, decode_engine)
    total = bytearray()
    async for chunk in response.chunks(5):
        total += chunk
        await asyncio.sleep(0.001)  # a slow client: the engine must be paused, not buffered without end

    assert bytes(total) == piece * pieces


async def test_a_header_with_a_line_break_is_refused(engine_client, decode_engine):
    with pytest.raises(ValueError, match="line break"):
        await engine_client.post(decode_engine.url + CHAT_PATH, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}, 5)

    assert decode_engine.requests == []


async def test_a_closed_client_refuses_new_requests(decode_engine):
    client = EngineClient()
    await client.close()

    with pytest.raises(EngineConnectionError, match="closed"):
        await post(client, decode_engine)
