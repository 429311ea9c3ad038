"""The proxy's limits as a client meets them (``proxy.limits``, ``proxy.bodies.check_context_length``).

Bodies over ``max_body_bytes`` are 413, whether announced by Content-Length
or sent chunked; past ``max_concurrent_requests`` running and
``max_queued_requests`` waiting, 429 with ``Retry-After``; a request that
cannot fit the context is 400, from the proxy when it knows
``max_model_len`` and from the engine (relayed) otherwise.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from aiohttp import web

from proxy.limits import AdmissionGate
from tests.stub_engine import Behaviour, error_body
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
