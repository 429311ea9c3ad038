"""The proxy's limits as a client meets them (``proxy.limits``, ``GenerationApi.check_length``).

Bodies over ``max_body_bytes`` are 413, whether announced by Content-Length
or sent chunked; bodies that do not all come within ``body_timeout_s`` (or
pause past ``body_idle_timeout_s``) are 408 and their connection closed; past
``max_concurrent_requests`` running (by default ``requests_per_engine`` for
each ready engine, following the pools) and ``max_queued_requests`` waiting,
429 with ``Retry-After``; a request that cannot fit the context is 400, from
the proxy when it knows ``max_model_len`` and from the engine (relayed)
otherwise.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from aiohttp import web

from orchestrator.spec import ClusterSpec
from proxy.limits import DEFAULT_REQUESTS_PER_ENGINE, AdmissionGate, pool_limit
from proxy.pool import Endpoint, EnginePool
from tests.stub_engine import Behaviour, error_body
from tests.unit.conftest import endpoint
from tests.unit.proxy_requests import (
    CHAT,
    CHAT_PATH,
    COMPLETION,
    COMPLETION_PATH,
    assert_openai_error,
    json_header,
    wait_until,
)

pytestmark = pytest.mark.timeout(15)

# --- body size --------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_before_it_is_read(make_client, prefill_engine):
    client = await make_client(max_body_bytes=2000)
    response = await client.post(CHAT_PATH, json=CHAT | {"padding": "x" * 3000}, headers={"X-Request-Id": "big-1"})

    error = assert_openai_error(response, 413, error_type="invalid_request_error", code="request_too_large")
    assert "2000" in error["message"]
    assert response.headers["x-request-id"] == "big-1"
    assert prefill_engine.requests == []


async def test_a_chunked_body_over_the_limit_is_413(make_client, prefill_engine):
    client = await make_client(max_body_bytes=2000)

    async def chunked():
        yield orjson.dumps(CHAT)[:-1]
        for _ in range(60):
            yield b', "pad": "' + b"x" * 40 + b'"'
        yield b"}"

    response = await client.post(CHAT_PATH, content=chunked(), headers=json_header())

    assert "content-length" not in response.request.headers  # really sent chunked
    assert_openai_error(response, 413, error_type="invalid_request_error", code="request_too_large")
    assert prefill_engine.requests == []


async def test_a_body_at_the_limit_is_served(make_client):
    body = orjson.dumps(CHAT | {"user": "u" * 2000})  # the smallest limit is 1 KiB
    client = await make_client(max_body_bytes=len(body))

    response = await client.post(CHAT_PATH, content=body, headers=json_header())

    assert response.status_code == 200, response.text


# --- body time --------------------------------------------------------------------------


class RawAnswer:
    """What came back on a raw connection: status, headers (lower-case names), body, and whether the
    server closed the connection after it."""

    def __init__(self, raw: bytes, closed: bool, elapsed_s: float) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        self.closed, self.elapsed_s = closed, elapsed_s

    def json(self) -> dict:
        return orjson.loads(self.body)


async def send_slowly(url: str, body: bytes, parts: list[tuple[float, int]], chunked: bool = False) -> RawAnswer:
    """POST ``body`` to the proxy at ``url`` by hand: the headers at once, then, for each ``(pause, size)``
    of ``parts``, ``size`` more bytes after ``pause`` seconds (then nothing more); the answer."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    writer.write(
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n{framing}\r\n"
        "X-Request-Id: slow-1\r\n\r\n".encode()
    )
    started = time.monotonic()

    async def sender() -> None:
        sent = 0
        for pause, size in parts:
            await asyncio.sleep(pause)
            piece, sent = body[sent : sent + size], sent + size
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked and sent >= len(body):
                writer.write(b"0\r\n\r\n")
            await writer.drain()

    sending = asyncio.create_task(sender())
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(RawAnswer(raw, False, 0).headers.get("content-length", "0"))
        raw += await reader.readexactly(length)
        elapsed = time.monotonic() - started
        try:
            closed = await asyncio.wait_for(reader.read(1), 1) == b""
        except TimeoutError:
            closed = False  # kept alive
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.close()
    return RawAnswer(raw, closed, elapsed)


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "stock-uvicorn"])
async def test_a_body_that_stops_coming_is_408_and_its_connection_closed(make_proxy, prefill_engine, fast_path):
    proxy = await make_proxy(body_timeout_s=10, body_idle_timeout_s=0.3, fast_path=fast_path)
    body = orjson.dumps(CHAT)

    answer = await send_slowly(proxy.url, body, [(0, 10)])  # 10 bytes of it, then nothing

    assert answer.status == 408 and answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "request_timeout", None)
    assert "nothing more of the request body came for 0.3 s" in error["message"]
    assert answer.headers["x-request-id"] == "slow-1"
    assert 0.3 <= answer.elapsed_s < 3 and answer.closed
    assert prefill_engine.requests == []


async def test_headers_and_then_no_body_at_all_is_408(make_proxy, prefill_engine):
    proxy = await make_proxy(body_timeout_s=10, body_idle_timeout_s=0.3)

    answer = await send_slowly(proxy.url, orjson.dumps(CHAT), [])

    assert answer.status == 408 and answer.json()["error"]["code"] == "request_timeout"
    assert answer.closed and prefill_engine.requests == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_trickled_body_is_408_once_its_whole_time_is_up(make_proxy, prefill_engine, chunked):
    # Both timers run: each byte moves the idle one on, the whole body's does not. The idle limit is 15 times the
    # gap between bytes, so a sender delayed on a loaded machine (a test run in parallel) does not trip it first.
    proxy = await make_proxy(body_timeout_s=2.0, body_idle_timeout_s=1.5)
    body = orjson.dumps(CHAT)

    answer = await send_slowly(proxy.url, body, [(0.1, 1)] * len(body), chunked)  # a byte every 0.1 s

    assert answer.status == 408, answer.body
    assert "did not all arrive within 2 s" in answer.json()["error"]["message"]
    assert 2.0 <= answer.elapsed_s < 5 and answer.closed
    assert prefill_engine.requests == []


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_slow_body_within_both_limits_is_served(make_proxy, chunked):
    proxy = await make_proxy(body_timeout_s=5, body_idle_timeout_s=1.0)
    body = orjson.dumps(CHAT)
    third = len(body) // 3 + 1

    answer = await send_slowly(proxy.url, body, [(0.2, third)] * 3, chunked)  # 0.6 s in all, pauses of 0.2 s

    assert answer.status == 200, answer.body
    assert not answer.closed


async def test_a_stalled_body_holds_no_admission_slot(make_proxy, pool):
    proxy = await make_proxy(
        body_timeout_s=10, body_idle_timeout_s=0.5, max_concurrent_requests=1, max_queued_requests=0
    )
    gate = proxy.app.state.flow.gate
    stalled = asyncio.create_task(send_slowly(proxy.url, orjson.dumps(CHAT), [(0, 5)]))
    await asyncio.sleep(0.1)

    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200  # the one slot was free
        assert (await stalled).status == 408
        assert (gate.running, gate.queued) == (0, 0)
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


# --- concurrency ------------------------------------------------------------------------


async def test_requests_past_the_running_and_queued_limits_are_429(make_proxy, decode_engine):
    proxy = await make_proxy(request_timeout_s=30, max_concurrent_requests=1, max_queued_requests=1)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        decode_engine.behaviour = Behaviour.HANG
        running = asyncio.create_task(client.post(CHAT_PATH, json=CHAT))
        await wait_until(lambda: len(decode_engine.requests) == 1)
        queued = asyncio.create_task(client.post(CHAT_PATH, json=CHAT))
        await wait_until(lambda: proxy.app.state.flow.gate.queued == 1, 10)  # waits in the proxy: no engine saw it

        refused = await client.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "busy-1"})

        error = assert_openai_error(refused, 429, error_type="requests", code="rate_limit_exceeded")
        assert "busy" in error["message"]
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-request-id"] == "busy-1"
        assert len(decode_engine.requests) == 1 and not queued.done()

        decode_engine.behaviour = Behaviour.OK
        await decode_engine.stop()  # ends the HANG: the running request gets its answer, then the queued one runs
        await decode_engine.start()
        assert (await running).status_code in (200, 502)
        assert (await queued).status_code == 200
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200  # every slot came back


async def test_no_queue_refuses_at_once(make_client, decode_engine):
    client = await make_client(request_timeout_s=30, max_concurrent_requests=1, max_queued_requests=0)
    decode_engine.behaviour = Behaviour.HANG
    running = asyncio.create_task(client.post(CHAT_PATH, json=CHAT | {"stream": True}))
    await wait_until(lambda: len(decode_engine.requests) == 1)

    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 429
    running.cancel()


async def test_a_stream_holds_its_slot_until_it_ends(make_client, decode_engine):
    client = await make_client(request_timeout_s=30, max_concurrent_requests=1, max_queued_requests=0)
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": True}) as streaming:
        assert streaming.status_code == 200
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 429
        decode_engine.behaviour = Behaviour.OK
        decode_engine.release()  # the rest of the stream
        assert b"[DONE]" in await streaming.aread()

    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


async def test_a_waiter_whose_client_leaves_gives_up_its_place():
    gate = AdmissionGate(max_running=1, max_queued=2)
    await gate.enter()
    first, second = asyncio.create_task(gate.enter()), asyncio.create_task(gate.enter())
    await asyncio.sleep(0)
    assert gate.queued == 2

    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert gate.queued == 1
    gate.leave()  # the slot goes to the one still waiting
    await second
    assert (gate.running, gate.queued) == (1, 0)
    gate.leave()
    assert gate.running == 0


@pytest.mark.parametrize(("running", "queued"), [(0, 0), (1, -1)])
def test_gate_rejects_impossible_limits(running, queued):
    with pytest.raises(ValueError, match="max_running"):
        AdmissionGate(running, queued)
    with pytest.raises(ValueError, match="max_running"):
        AdmissionGate(1).resize(0)


async def test_a_larger_limit_admits_those_waiting_at_once_and_a_smaller_one_lets_the_running_finish():
    gate = AdmissionGate(max_running=1, max_queued=5)
    await gate.enter()
    waiters = [asyncio.create_task(gate.enter()) for _ in range(3)]
    await asyncio.sleep(0)

    gate.resize(3)
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]
    assert (gate.running, gate.queued) == (3, 1)

    gate.resize(1)  # the three running finish; the one waiting waits until fewer than one run
    gate.leave()
    gate.leave()
    await asyncio.sleep(0)
    assert (gate.running, gate.queued) == (1, 1) and not waiters[2].done()
    gate.leave()
    await waiters[2]
    assert (gate.running, gate.queued) == (1, 0)
    assert not gate.admit()
    gate.leave()
    assert gate.admit() and gate.running == 1


def endpoints(role: str, count: int) -> list[Endpoint]:
    return [Endpoint(f"{role}-{i}", f"http://127.0.0.1:{8100 + i}") for i in range(count)]


def test_the_default_limit_is_what_the_ready_engines_run_and_never_0():
    pool = EnginePool()
    assert pool_limit(pool, 8) == 8  # no engine yet: one engine's worth
    pool.set_endpoints("prefill", endpoints("prefill", 2))
    pool.set_endpoints("decode", endpoints("decode", 3))
    assert pool_limit(pool, 8) == 40

    pool.drain("decode-0")
    assert pool_limit(pool, 8) == 32
    pool.set_healthy(pool.engine("prefill-1"), False)
    assert pool_limit(pool, 8) == 24
    for engine in pool.engines():
        pool.set_healthy(engine, False)
    assert pool_limit(pool, 8) == 8


async def test_the_proxys_limit_follows_the_pools_as_engines_come_drain_move_and_go(
    make_proxy, pool, prefill_engine, decode_engine, make_engine
):
    proxy = await make_proxy(requests_per_engine=3)
    gate = proxy.app.state.flow.gate
    assert gate.max_running == 6  # prefill-0 and decode-0

    second = await make_engine("decode-1")
    pool.add("decode", endpoint(second))
    assert gate.max_running == 9
    pool.drain("decode-0")  # a role move begins: out of decode's routing...
    assert gate.max_running == 6
    pool.set_endpoints("decode", [endpoint(second)])  # ...then it serves prefill
    pool.set_endpoints("prefill", [endpoint(prefill_engine), endpoint(decode_engine)])
    assert gate.max_running == 9
    pool.remove("decode-1")
    assert gate.max_running == 6


async def test_an_explicit_limit_stays_whatever_the_pools_do(make_proxy, pool, make_engine):
    proxy = await make_proxy(max_concurrent_requests=5, requests_per_engine=3)
    gate = proxy.app.state.flow.gate

    pool.add("decode", endpoint(await make_engine("decode-1")))
    pool.drain("decode-0")

    assert gate.max_running == 5


async def test_without_requests_per_engine_an_engine_counts_as_vllms_largest_default(make_proxy):
    proxy = await make_proxy()

    assert proxy.app.state.flow.gate.max_running == 2 * DEFAULT_REQUESTS_PER_ENGINE == 2048


async def test_past_the_derived_limit_requests_wait_then_429_and_a_new_engine_lets_them_in(
    make_proxy, pool, decode_engine, make_engine
):
    proxy = await make_proxy(request_timeout_s=30, requests_per_engine=1, max_queued_requests=1)  # 2 at once
    gate = proxy.app.state.flow.gate
    decode_engine.behaviour = Behaviour.HANG
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        running = [asyncio.create_task(client.post(CHAT_PATH, json=CHAT)) for _ in range(2)]
        await wait_until(lambda: len(decode_engine.requests) == 2)
        queued = asyncio.create_task(client.post(CHAT_PATH, json=CHAT))
        await wait_until(lambda: gate.queued == 1)

        refused = await client.post(CHAT_PATH, json=CHAT)
        assert_openai_error(refused, 429, error_type="requests", code="rate_limit_exceeded")
        assert refused.headers["retry-after"] == "1"

        second = await make_engine("decode-1")
        pool.add("decode", endpoint(second))  # room for one more: the one waiting runs at once
        assert (gate.max_running, gate.running, gate.queued) == (3, 3, 0)
        decode_engine.behaviour = Behaviour.OK
        decode_engine.release()
        assert [r.status_code for r in await asyncio.gather(*running, queued)] == [200, 200, 200]
    assert (gate.running, gate.queued) == (0, 0)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param({}, 128, id="cpu-default"),
        pytest.param({"decode": {"tensor_parallel_size": 2}}, 256, id="cpu-tp2"),
        pytest.param({"engine": {"extra_args": {"max_num_seqs": 64}}}, 64, id="max-num-seqs"),
        pytest.param({"engine": {"extra_args": {"max-num-seqs": "32"}}}, 32, id="max-num-seqs-flag"),
        pytest.param({"device": "cuda", "resources": {"gpus": 2}}, None, id="gpu-default"),
        pytest.param(
            {"proxy": {"requests_per_engine": 16}, "engine": {"extra_args": {"max_num_seqs": 64}}}, 16, id="set"
        ),
    ],
)
def test_a_clusters_proxy_counts_its_engines_max_num_seqs(make_spec, write_spec, spec, expected):
    config = ClusterSpec.from_file(write_spec(make_spec(**spec))).proxy_config()

    assert config.requests_per_engine == expected
    assert config.max_concurrent_requests is None  # derived from the pools


# --- context length ---------------------------------------------------------------------


async def vllm_context_check(request: web.Request, received) -> web.Response:
    """A decode engine with a 16-token context, answering as vLLM does."""
    max_tokens = received.body.get("max_tokens") or 0
    if max_tokens > 16:
        message = f"This model's maximum context length is 16 tokens. However, you requested {max_tokens + 2} tokens."
        return web.json_response(error_body(message, "BadRequestError", 400), status=400)
    return web.json_response({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})


async def test_without_max_model_len_the_engines_400_is_relayed(client, decode_engine):
    decode_engine.handler = vllm_context_check

    response = await client.post(COMPLETION_PATH, json=COMPLETION | {"max_tokens": 4096})

    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("This model's maximum context length is 16 tokens.")
    assert response.json()["error"]["type"] == "BadRequestError"
    assert len(decode_engine.requests) == 1


@pytest.mark.parametrize(
    ("path", "sent", "param"),
    [
        pytest.param(COMPLETION_PATH, COMPLETION | {"prompt": list(range(17))}, "prompt", id="token-ids"),
        pytest.param(COMPLETION_PATH, COMPLETION | {"prompt": [[1], list(range(20))]}, "prompt", id="token-id-batch"),
        pytest.param(COMPLETION_PATH, COMPLETION | {"prompt": [1, 2], "max_tokens": 15}, "max_tokens", id="ids+max"),
        pytest.param(CHAT_PATH, CHAT | {"max_tokens": 16}, "max_tokens", id="chat-max-tokens"),
        pytest.param(CHAT_PATH, CHAT | {"max_completion_tokens": 4096}, "max_completion_tokens", id="chat-max-compl"),
    ],
)
async def test_with_max_model_len_the_proxy_refuses_what_cannot_fit(make_client, prefill_engine, path, sent, param):
    client = await make_client(max_model_len=16)

    response = await client.post(path, json=sent)

    error = assert_openai_error(
        response, 400, error_type="invalid_request_error", code="context_length_exceeded", param=param
    )
    assert error["message"].startswith("This model's maximum context length is 16 tokens.")
    assert prefill_engine.requests == []


@pytest.mark.parametrize(
    "sent",
    [COMPLETION | {"prompt": list(range(16))}, COMPLETION | {"prompt": [1, 2], "max_tokens": 14}, COMPLETION],
    ids=["16-ids", "2+14", "text"],
)
async def test_with_max_model_len_what_fits_is_served(make_client, sent):
    client = await make_client(max_model_len=16)

    response = await client.post(COMPLETION_PATH, json=sent)

    assert response.status_code == 200, response.text
