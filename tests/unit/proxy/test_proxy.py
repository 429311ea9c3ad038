"""The proxy as a client meets it: the OpenAI API in front of stub prefill and decode engines.

The proxy runs for real (uvicorn with the proxy's settings, its lifespan and
engine client) against the stub engines of ``tests/stub_engine.py``; each test
checks what the client gets back and what each engine received. ``proxy.pool``
and ``proxy.app.DirectRoute`` are tested at the end; ``proxy.bodies``' request
bodies and validation in ``test_bodies.py``; the requests and readers the proxy's tests share in
``proxy_requests.py``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from aiohttp import web
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from proxy.app import DirectRoute
from proxy.errors import NoHealthyEngine
from proxy.pool import Endpoint, EnginePool
from tests.stub_engine import ERROR_400_MESSAGE, Behaviour, answer_text
from tests.unit.conftest import PROXY_MODEL, PROXY_TIMEOUT_S, endpoint
from tests.unit.proxy_requests import (
    CHAT,
    CHAT_PATH,
    COMPLETION,
    COMPLETION_PATH,
    INVALID_REQUESTS,
    PREFILL_FIELDS,
    REQUESTS,
    answer_of,
    assert_openai_error,
    both_roles,
    both_routes,
    json_header,
    sse_events,
    streamed_text,
    wait_until,
)

pytestmark = pytest.mark.timeout(15)

# The slack allowed, on top of the proxy's timeout, for a hanging engine to become a 502.
TIMEOUT_SLACK_S = 2.0

# --- the two phases ---------------------------------------------------------------------


@both_routes
async def test_returns_the_decode_engines_answer(client, path, prefill_engine, decode_engine):
    response = await client.post(path, json=REQUESTS[path])

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert payload["object"] == ("chat.completion" if path == CHAT_PATH else "text_completion")
    assert answer_of(path, payload) == answer_text("decode-0", with_kv=True)
    assert payload["choices"][0]["finish_reason"] == "stop"
    assert [r.path for r in prefill_engine.requests] == [path]
    assert [r.path for r in decode_engine.requests] == [path]
    assert prefill_engine.requests[0].is_prefill and not decode_engine.requests[0].is_prefill


@both_routes
async def test_prefill_asks_for_one_token_and_remote_decode(client, path, prefill_engine):
    sent = REQUESTS[path] | {
        "max_tokens": 50,
        "temperature": 0.7,
        "stop": ["\n"],
        "seed": 7,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", path, json=sent) as response:
        await response.aread()
    assert response.status_code == 200

    (received,) = prefill_engine.requests
    expected = {k: v for k, v in sent.items() if k != "stream_options"} | PREFILL_FIELDS
    assert received.body == expected
    assert "stream_options" not in received.body
    assert "max_completion_tokens" not in received.body
    assert received.headers["content-type"] == "application/json"


async def test_prefill_caps_max_completion_tokens(client, prefill_engine, decode_engine):
    sent = CHAT | {"max_completion_tokens": 50}
    response = await client.post(CHAT_PATH, json=sent)

    assert response.status_code == 200, response.text
    prefill = prefill_engine.requests[0].body
    assert (prefill["max_completion_tokens"], prefill["max_tokens"]) == (1, 1)
    decode = decode_engine.requests[0].body
    assert decode["max_completion_tokens"] == 50 and "max_tokens" not in decode


@both_routes
async def test_decode_gets_the_clients_request_and_the_prefills_kv_transfer_params(
    client, path, prefill_engine, decode_engine
):
    sent = REQUESTS[path] | {
        "max_tokens": 3,
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["."],
        "seed": 1234,
        "n": 1,
        "stream": False,
        "user": "u-1",
        "ignore_eos": True,  # vLLM's own extensions pass through too
        "min_tokens": 2,
    }
    response = await client.post(path, json=sent)

    assert response.status_code == 200, response.text
    kv_params = prefill_engine.requests[0].answered_kv_transfer_params
    assert kv_params["do_remote_prefill"] is True and kv_params["remote_engine_id"] == "prefill-0"
    (received,) = decode_engine.requests
    assert received.body == sent | {"kv_transfer_params": kv_params}
    # The decode engine honoured max_tokens, so the client gets 3 words back.
    assert answer_of(path, response.json()) == "hello from decode-0"
    assert response.json()["choices"][0]["finish_reason"] == "length"


async def test_min_tokens_does_not_break_the_one_token_prefill(client, prefill_engine, decode_engine):
    # vLLM rejects min_tokens > max_tokens: the prefill's max_tokens=1 must not meet the client's min_tokens.
    response = await client.post(CHAT_PATH, json=CHAT | {"max_tokens": 10, "min_tokens": 5})

    assert response.status_code == 200, response.text
    assert prefill_engine.requests[0].body.get("min_tokens", 0) <= 1
    assert decode_engine.requests[0].body["min_tokens"] == 5


async def test_prefill_without_kv_transfer_params_still_decodes(client, prefill_engine, decode_engine):
    prefill_engine.behaviour = Behaviour.NO_KV  # e.g. an engine started without a KV connector
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200, response.text
    assert answer_of(CHAT_PATH, response.json()) == answer_text("decode-0", with_kv=False)
    assert decode_engine.requests[0].body == CHAT


# --- streaming --------------------------------------------------------------------------


@both_routes
async def test_streaming_relays_the_decode_engines_sse_chunks(client, path, prefill_engine, decode_engine):
    sent = REQUESTS[path] | {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=sent) as response:
        body = (await response.aread()).decode()

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    assert streamed_text(path, events) == answer_text("decode-0", with_kv=True)
    assert events[-2]["usage"]["completion_tokens"] == 5 and events[-2]["choices"] == []
    assert len(events) > 3  # relayed chunk by chunk, not as one answer
    assert prefill_engine.requests[0].body["stream"] is False
    decode = decode_engine.requests[0].body
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert decode["kv_transfer_params"] == prefill_engine.requests[0].answered_kv_transfer_params


async def test_stream_null_is_not_streaming(client, decode_engine):
    # OpenAI's and vLLM's ``stream`` is "boolean or null", defaulting to false.
    response = await client.post(CHAT_PATH, json=CHAT | {"stream": None, "n": None})

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert answer_of(CHAT_PATH, response.json()) == answer_text("decode-0", with_kv=True)


# --- headers ----------------------------------------------------------------------------


async def test_client_request_id_reaches_both_engines_and_the_response(client, prefill_engine, decode_engine):
    response = await client.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "req-42"})

    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-42"
    assert prefill_engine.requests[0].headers["x-request-id"] == "req-42"
    assert decode_engine.requests[0].headers["x-request-id"] == "req-42"


async def test_request_id_is_made_when_the_client_sends_none(client, prefill_engine, decode_engine):
    first = await client.post(CHAT_PATH, json=CHAT)
    second = await client.post(CHAT_PATH, json=CHAT)

    request_id = first.headers["x-request-id"]
    assert request_id.startswith("pdserve-") and len(request_id) > len("pdserve-")
    assert second.headers["x-request-id"] != request_id
    assert prefill_engine.requests[0].headers["x-request-id"] == request_id
    assert decode_engine.requests[0].headers["x-request-id"] == request_id


async def test_request_id_on_error_responses(client):
    response = await client.post(CHAT_PATH, json={"model": PROXY_MODEL}, headers={"X-Request-Id": "bad-1"})

    assert response.status_code == 400
    assert response.headers["x-request-id"] == "bad-1"


async def test_authorization_is_not_forwarded_by_default(client, prefill_engine, decode_engine):
    # The engines listen where only the proxy reaches them; the client's key is the proxy's business.
    response = await client.post(CHAT_PATH, json=CHAT, headers={"Authorization": "Bearer sk-client"})

    assert response.status_code == 200
    assert "authorization" not in prefill_engine.requests[0].headers
    assert "authorization" not in decode_engine.requests[0].headers


async def test_authorization_reaches_both_engines_when_forwarded(make_client, prefill_engine, decode_engine):
    # vLLM servers started with --api-key refuse requests without it.
    client = await make_client(forward_authorization=True)
    response = await client.post(CHAT_PATH, json=CHAT, headers={"Authorization": "Bearer sk-engine"})

    assert response.status_code == 200
    assert prefill_engine.requests[0].headers["authorization"] == "Bearer sk-engine"
    assert decode_engine.requests[0].headers["authorization"] == "Bearer sk-engine"


async def test_no_authorization_is_sent_when_the_client_sends_none(make_client, prefill_engine, decode_engine):
    client = await make_client(forward_authorization=True)
    await client.post(CHAT_PATH, json=CHAT)

    assert "authorization" not in prefill_engine.requests[0].headers
    assert "authorization" not in decode_engine.requests[0].headers


async def test_engines_are_called_on_kept_alive_connections(client, prefill_engine, decode_engine):
    for _ in range(3):
        assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200

    assert len({r.peer for r in prefill_engine.requests}) == 1
    assert len({r.peer for r in decode_engine.requests}) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_response_names_the_engines_that_served_it(client, stream):
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": stream}) as response:
        await response.aread()

    assert response.status_code == 200
    assert response.headers["x-pdserve-prefill"] == "prefill-0"
    assert response.headers["x-pdserve-decode"] == "decode-0"
    assert "x-request-id" in response.headers


# --- the pool ---------------------------------------------------------------------------


@both_roles
async def test_round_robin_alternates_between_two_engines(client, pool, make_engine, role):
    first = pool.endpoints(role)[0]
    second = await make_engine(f"{role}-1")
    pool.set_endpoints(role, [first, endpoint(second)])

    served = []
    for _ in range(4):
        response = await client.post(CHAT_PATH, json=CHAT)
        assert response.status_code == 200, response.text
        served.append(response.headers[f"x-pdserve-{role}"])

    assert served == [f"{role}-0", f"{role}-1", f"{role}-0", f"{role}-1"]
    assert len(second.requests) == 2
    if role == "decode":
        assert answer_of(CHAT_PATH, response.json()) == answer_text("decode-1", with_kv=True)


@both_roles
async def test_empty_pool_is_503_with_retry_after_when_degrading_is_off(
    make_proxy, pool, prefill_engine, decode_engine, role
):
    proxy = await make_proxy(degrade=False)
    pool.set_endpoints(role, [])
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 503, error_type="service_unavailable", code="no_healthy_engine")
    assert role in error["message"]
    assert response.headers["retry-after"] == "5"
    assert response.headers["x-request-id"]
    assert prefill_engine.requests == [] and decode_engine.requests == []


async def test_no_engine_at_all_is_503(client, pool, prefill_engine, decode_engine):
    pool.set_endpoints("prefill", [])
    pool.set_endpoints("decode", [])
    response = await client.post(CHAT_PATH, json=CHAT)
    assert_openai_error(response, 503, error_type="service_unavailable", code="no_healthy_engine")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_empty_prefill_pool_degrades_to_decode_only_and_says_so(
    client, pool, prefill_engine, decode_engine, stream
):
    pool.set_endpoints("prefill", [])
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": stream}) as response:
        await response.aread()

    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "decode-only; reason=no-prefill-engine"
    assert prefill_engine.requests == [] and "kv_transfer_params" not in decode_engine.requests[0].body
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_proxy_degraded_requests_total{model="m",reason="no-prefill-engine"} 1.0' in metrics


async def test_an_empty_decode_pool_is_served_whole_by_a_prefill_engine(client, pool, prefill_engine, decode_engine):
    pool.set_endpoints("decode", [])
    response = await client.post(CHAT_PATH, json=CHAT | {"max_tokens": 7})

    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "prefill-only; reason=no-decode-engine"
    assert response.headers["x-pdserve-decode"] == "prefill-0"
    (received,) = prefill_engine.requests
    assert received.body == CHAT | {"max_tokens": 7}  # the client's own request: no KV hand-over
    assert decode_engine.requests == []


async def test_engines_taken_out_and_put_back(client, pool, prefill_engine):
    endpoints = pool.endpoints("prefill")
    pool.set_endpoints("prefill", [])
    assert (await client.post(CHAT_PATH, json=CHAT)).headers["x-pdserve-path"].startswith("decode-only")
    pool.set_endpoints("prefill", list(endpoints))
    assert (await client.post(CHAT_PATH, json=CHAT)).headers["x-pdserve-path"] == "disaggregated"


# --- the client's errors ----------------------------------------------------------------


async def test_malformed_json_is_400(client, prefill_engine):
    response = await client.post(CHAT_PATH, content=b'{"model": "m", "messages": [', headers=json_header())

    error = assert_openai_error(response, 400, error_type="invalid_request_error")
    assert "JSON" in error["message"]
    assert prefill_engine.requests == []


async def test_json_that_is_not_an_object_is_400(client):
    response = await client.post(CHAT_PATH, json=[CHAT])

    assert_openai_error(response, 400, error_type="invalid_request_error")


async def test_non_json_content_type_is_400(client, prefill_engine):
    response = await client.post(CHAT_PATH, content=orjson.dumps(CHAT), headers={"Content-Type": "text/plain"})

    error = assert_openai_error(response, 400, error_type="invalid_request_error")
    assert "Content-Type" in error["message"]
    assert prefill_engine.requests == []


@pytest.mark.parametrize(("path", "sent", "param"), INVALID_REQUESTS)
async def test_invalid_request_is_400_naming_the_parameter(client, path, sent, param, prefill_engine):
    response = await client.post(path, json=sent)

    error = assert_openai_error(response, 400, error_type="invalid_request_error", param=param)
    assert error["message"].startswith(f"{param}: ")
    assert prefill_engine.requests == []


FORGED = {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_block_ids": [1]}
SMUGGLED = [
    ({"kv_transfer_params": FORGED}, "kv_transfer_params"),
    ({"kv_transfer_params": None}, "kv_transfer_params"),
    ({"ec_transfer_params": {"do_remote_encode": True}}, "ec_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": FORGED}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": "do_remote_prefill"}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": {"ec_transfer_params": 1}}, "vllm_xargs.ec_transfer_params"),
    ({"vllm_xargs": ["kv_transfer_params"]}, "vllm_xargs"),
]


@pytest.mark.parametrize(("smuggled", "param"), SMUGGLED, ids=[param for _, param in SMUGGLED])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETION_PATH])
@pytest.mark.parametrize("serving", ["pd", "decode-only", "prefill-only"])
async def test_a_client_cannot_send_transfer_params_to_an_engine_by_any_field_on_any_path(
    make_client, pool, path, smuggled, param, serving, prefill_engine, decode_engine
):
    """Every path into the connector is closed, on every serving path: the proxy attaches no parameters of its
    own on decode-only (no prefill engine) and prefill-only (no decode engine), where a client's would reach
    the engine as sent."""
    if serving == "decode-only":
        pool.set_endpoints("prefill", [])
    elif serving == "prefill-only":
        pool.set_endpoints("decode", [])
    client = await make_client()
    response = await client.post(path, json=(CHAT if path == CHAT_PATH else COMPLETION) | smuggled)

    error = assert_openai_error(response, 400, error_type="invalid_request_error", param=param)
    assert "never by a client" in error["message"] or "must be an object" in error["message"]
    assert prefill_engine.requests == [] and decode_engine.requests == []


async def test_other_vllm_xargs_still_reach_the_engines(client, decode_engine):
    response = await client.post(CHAT_PATH, json=CHAT | {"vllm_xargs": {"session_id": "s-1"}})

    assert response.status_code == 200
    assert decode_engine.requests[0].body["vllm_xargs"] == {"session_id": "s-1"}


async def test_unknown_model_is_404_model_not_found(client, prefill_engine):
    response = await client.post(CHAT_PATH, json=CHAT | {"model": "gpt-4"})

    error = assert_openai_error(
        response, 404, error_type="invalid_request_error", code="model_not_found", param="model"
    )
    assert "gpt-4" in error["message"] and "`m`" in error["message"]
    assert prefill_engine.requests == []


async def test_unknown_route_is_404_in_openai_format(client):
    response = await client.post("/v1/embeddings", json={"model": PROXY_MODEL, "input": "x"})

    assert_openai_error(response, 404, error_type="invalid_request_error", code="404")


async def test_wrong_method_is_405_in_openai_format(client):
    response = await client.get(CHAT_PATH)

    assert_openai_error(response, 405, error_type="invalid_request_error", code="405")


# --- the engines' errors ----------------------------------------------------------------


async def test_prefill_down_is_502(make_client, prefill_engine, decode_engine):
    client = await make_client(degrade=False)  # with degrade, the decode engine would serve it
    await prefill_engine.stop()  # connection refused
    response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "prefill engine prefill-0" in error["message"]
    assert response.headers["x-pdserve-prefill"] == "prefill-0"
    assert decode_engine.requests == []


async def test_prefill_back_up_serves_again(make_client, prefill_engine):
    client = await make_client(degrade=False)  # with degrade, the decode engine would serve it
    await prefill_engine.stop()
    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 502
    await prefill_engine.start()
    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200


async def test_prefill_500_is_502(make_client, prefill_engine, decode_engine):
    client = await make_client(degrade=False)  # with degrade, the decode engine would serve it
    prefill_engine.behaviour = Behaviour.ERROR_500
    response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "prefill" in error["message"] and "500" in error["message"]
    assert decode_engine.requests == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_prefill_hang_is_502_after_the_timeout(make_client, prefill_engine, decode_engine, stream):
    client = await make_client(degrade=False)  # with degrade, the decode engine would serve it
    prefill_engine.behaviour = Behaviour.HANG
    started = time.monotonic()
    response = await client.post(CHAT_PATH, json=CHAT | {"stream": stream})
    elapsed = time.monotonic() - started

    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "prefill" in error["message"]
    assert PROXY_TIMEOUT_S * 0.9 <= elapsed < PROXY_TIMEOUT_S + TIMEOUT_SLACK_S
    assert decode_engine.requests == []


@pytest.mark.parametrize("answer", [b"not json", b'["not", "an", "object"]'], ids=["not-json", "not-an-object"])
async def test_prefill_unreadable_answer_is_502(make_client, prefill_engine, decode_engine, answer):
    client = await make_client(degrade=False)  # with degrade, the decode engine would serve it

    async def unreadable(request, received):
        return web.Response(body=answer, content_type="application/json")

    prefill_engine.handler = unreadable
    response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "unreadable" in error["message"]
    assert decode_engine.requests == []


async def test_decode_500_is_502(client, decode_engine):
    decode_engine.behaviour = Behaviour.ERROR_500
    response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "decode engine decode-0" in error["message"]
    assert response.headers["x-pdserve-decode"] == "decode-0"


async def test_decode_500_on_a_stream_is_a_json_502(client, decode_engine):
    decode_engine.behaviour = Behaviour.ERROR_500
    response = await client.post(CHAT_PATH, json=CHAT | {"stream": True})

    assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")


async def test_decode_down_is_served_by_the_prefill_engine_alone_or_502(make_client, prefill_engine, decode_engine):
    await decode_engine.stop()
    response = await (await make_client(health_interval_s=0)).post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-path"] == "prefill-only; reason=decode-failed"
    assert response.headers["x-pdserve-migrated"] == "decode-0"
    assert response.json()["choices"][0]["message"]["content"] == answer_text("prefill-0", with_kv=False)

    response = await (await make_client(degrade=False, health_interval_s=0)).post(CHAT_PATH, json=CHAT)
    error = assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert "decode" in error["message"]
    assert len(prefill_engine.prefill_requests) == 2


async def test_decode_hang_is_502_after_the_timeout(client, decode_engine):
    decode_engine.behaviour = Behaviour.HANG
    started = time.monotonic()
    response = await client.post(CHAT_PATH, json=CHAT)
    elapsed = time.monotonic() - started

    assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")
    assert elapsed < PROXY_TIMEOUT_S + TIMEOUT_SLACK_S


async def test_decode_closing_the_connection_before_it_answers_moves_the_request_or_is_502(make_client, decode_engine):
    decode_engine.behaviour = Behaviour.DROP  # it died under the request: the prefill engine serves it alone
    response = await (await make_client()).post(CHAT_PATH, json=CHAT)
    assert response.status_code == 200 and response.headers["x-pdserve-migrated"] == "decode-0"

    response = await (await make_client(decode_retries=0)).post(CHAT_PATH, json=CHAT)
    assert_openai_error(response, 502, error_type="upstream_error", code="engine_failed")


@both_roles
@both_routes
async def test_engine_400_passes_through_with_the_engines_message(client, path, role, prefill_engine, decode_engine):
    engine = prefill_engine if role == "prefill" else decode_engine
    engine.behaviour = Behaviour.ERROR_400
    response = await client.post(path, json=REQUESTS[path], headers={"X-Request-Id": "long-1"})

    assert response.status_code == 400
    assert response.json() == {
        "error": {"message": ERROR_400_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}
    }
    assert response.headers["x-request-id"] == "long-1"
    assert len(decode_engine.requests) == (1 if role == "decode" else 0)


async def test_engine_4xx_without_an_openai_body_is_wrapped(client, decode_engine):
    async def plain_422(request, received):
        return web.Response(status=422, text="prompt too long")

    decode_engine.handler = plain_422
    response = await client.post(CHAT_PATH, json=CHAT)

    error = assert_openai_error(response, 422, error_type="invalid_request_error")
    assert error["message"] == "prompt too long"


@both_routes
async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event(client, path, decode_engine):
    decode_engine.behaviour = Behaviour.DROP
    async with client.stream("POST", path, json=REQUESTS[path] | {"stream": True}) as response:
        body = (await asyncio.wait_for(response.aread(), 5)).decode()

    assert response.status_code == 200  # the headers were sent before the engine died
    events = sse_events(body)
    assert "[DONE]" not in events
    assert streamed_text(path, events[:-1])  # the chunks sent before the failure came through
    error = events[-1]["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "engine_failed")
    assert "decode engine decode-0" in error["message"]


async def test_decode_stalling_mid_stream_ends_the_stream_after_the_timeout(client, decode_engine):
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    started = time.monotonic()
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": True}) as response:
        body = (await response.aread()).decode()
    elapsed = time.monotonic() - started

    events = sse_events(body)
    assert events[-1]["error"]["code"] == "engine_failed"
    assert elapsed < PROXY_TIMEOUT_S + TIMEOUT_SLACK_S


async def test_client_leaving_a_stream_releases_the_decode_request(make_proxy, decode_engine):
    # A long proxy timeout: the decode request must end because the client left, not because it timed out.
    proxy = await make_proxy(request_timeout_s=30)
    decode_engine.behaviour = Behaviour.STALL_MID_STREAM
    async with httpx.AsyncClient(base_url=proxy.url) as client:
        async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": True}) as response:
            async for _ in response.aiter_raw():
                break  # the first chunks arrived; hang up

    await wait_until(lambda: decode_engine.requests[0].disconnected, timeout_s=2)


# --- models and health ------------------------------------------------------------------


async def test_models_lists_the_served_model(client):
    response = await client.get("/v1/models")

    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [model["id"] for model in body["data"]] == [PROXY_MODEL]
    assert body["data"][0]["object"] == "model"


async def test_health_is_200_with_both_pools(client, prefill_engine, decode_engine):
    response = await client.get("/health")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    state = {"in_flight": 0, "healthy": True, "draining": False}
    # an anonymous caller learns which engines are healthy, not where they listen (URL, side channels)
    assert body["engines"] == {
        "prefill": [{"engine_id": "prefill-0"} | state],
        "decode": [{"engine_id": "decode-0"} | state],
    }


async def test_health_tells_an_admin_where_the_engines_listen(make_client, monkeypatch, prefill_engine):
    monkeypatch.setenv("PD_ADMIN_KEY", "admin-secret")
    client = await make_client(admin_key_env=("PD_ADMIN_KEY",))

    anonymous = (await client.get("/health")).json()["engines"]["prefill"][0]
    wrong = (await client.get("/health", headers={"X-Admin-Key": "guess"})).json()["engines"]["prefill"][0]
    admin = (await client.get("/health", headers={"X-Admin-Key": "admin-secret"})).json()["engines"]["prefill"][0]

    assert "url" not in anonymous and "kv_endpoints" not in anonymous and wrong == anonymous
    assert admin["url"] == prefill_engine.url and admin["kv_endpoints"] == []


@both_roles
async def test_health_is_degraded_when_a_pool_is_empty_and_503_without_degrading(client, make_proxy, pool, role):
    pool.set_endpoints(role, [])
    response = await client.get("/health")
    assert response.status_code == 200  # the other pool's engines serve requests alone
    assert response.json()["status"] == "degraded"
    assert response.json()["engines"][role] == []

    strict = await make_proxy(degrade=False)
    async with httpx.AsyncClient(base_url=strict.url) as other:
        response = await other.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


async def test_health_is_503_when_no_engine_is_left(client, pool):
    pool.set_endpoints("prefill", [])
    pool.set_endpoints("decode", [])
    response = await client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


async def test_many_concurrent_requests(make_client, pool, make_engine):
    # A patient proxy: this is about concurrency, and 20 requests in one event loop beside a busy xdist worker
    # once took longer than the fixtures' 0.5-s timeout (a 502 in a fresh clone's run).
    client = await make_client(request_timeout_s=10.0)
    pool.set_endpoints("decode", [*pool.endpoints("decode"), endpoint(await make_engine("decode-1"))])
    responses = await asyncio.gather(
        *(client.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": f"c-{i}"}) for i in range(20))
    )

    assert [r.status_code for r in responses] == [200] * 20, [(r.status_code, r.text[:300]) for r in responses]
    assert sorted(r.headers["x-request-id"] for r in responses) == sorted(f"c-{i}" for i in range(20))
    for response in responses:
        assert answer_of(CHAT_PATH, response.json()) == answer_text(response.headers["x-pdserve-decode"], True)


# --- proxy.pool -------------------------------------------------------------------------


def engines(role: str, count: int) -> list[Endpoint]:
    return [Endpoint(f"{role}-{i}", f"http://127.0.0.1:{8100 + i}") for i in range(count)]


def test_pool_starts_empty_and_pick_says_retry_later():
    pool = EnginePool()
    assert pool.snapshot() == {"prefill": [], "decode": []}
    with pytest.raises(NoHealthyEngine) as caught:
        pool.pick("decode")
    assert caught.value.status == 503
    assert caught.value.headers == {"Retry-After": "5"}
    assert "decode" in caught.value.message


def test_pool_round_robin_per_role():
    pool = EnginePool()
    pool.set_endpoints("prefill", engines("prefill", 3))
    pool.set_endpoints("decode", engines("decode", 2))

    prefill = [pool.pick("prefill").engine_id for _ in range(6)]
    decode = [pool.pick("decode").engine_id for _ in range(4)]

    assert prefill == ["prefill-0", "prefill-1", "prefill-2"] * 2
    assert decode == ["decode-0", "decode-1"] * 2


def test_pool_keeps_serving_after_the_endpoints_change():
    pool = EnginePool()
    pool.set_endpoints("decode", engines("decode", 3))
    pool.pick("decode")
    pool.set_endpoints("decode", engines("decode", 2))

    picked = {pool.pick("decode").engine_id for _ in range(4)}
    assert picked == {"decode-0", "decode-1"}


def test_pool_set_endpoints_copies_the_list():
    pool = EnginePool()
    endpoints = engines("prefill", 1)
    pool.set_endpoints("prefill", endpoints)
    endpoints.append(Endpoint("intruder", "http://127.0.0.1:1"))

    assert pool.endpoints("prefill") == tuple(engines("prefill", 1))


@pytest.mark.parametrize("role", ["prefil", "encode", "", "PREFILL"])
def test_pool_set_endpoints_rejects_unknown_roles(role):
    pool = EnginePool()
    with pytest.raises(ValueError, match="unknown role"):
        pool.set_endpoints(role, engines("prefill", 1))
    assert pool.snapshot() == {"prefill": [], "decode": []}


def test_pool_snapshot():
    pool = EnginePool()
    pool.set_endpoints("prefill", engines("prefill", 1))
    assert pool.snapshot() == {
        "prefill": [
            {"engine_id": "prefill-0", "url": "http://127.0.0.1:8100"}
            | {"in_flight": 0, "healthy": True, "draining": False, "kv_endpoints": []}
        ],
        "decode": [],
    }


# --- proxy.app.DirectRoute --------------------------------------------------------------


async def test_the_completion_routes_are_in_the_openapi_schema(client):
    paths = (await client.get("/openapi.json")).json()["paths"]

    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(paths)
    assert "post" in paths["/v1/chat/completions"] and "post" in paths["/v1/completions"]


async def test_direct_route_leaves_endpoints_that_declare_more_to_fastapi():
    router = APIRouter(route_class=DirectRoute)

    @router.get("/plain")
    async def plain(request: Request) -> Response:
        return Response(request.url.path)

    @router.get("/declared")
    async def declared(request: Request, count: int) -> Response:
        return Response(str(count * 2))

    app = FastAPI()
    app.include_router(router)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        assert (await client.get("/plain")).text == "/plain"
        assert (await client.get("/declared", params={"count": 4})).text == "8"
        missing = await client.get("/declared")

    assert missing.status_code == 422  # FastAPI's own handler validated the query
    assert "/plain" in app.openapi()["paths"]
