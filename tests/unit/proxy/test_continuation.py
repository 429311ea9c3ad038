"""A stream whose decode engine dies goes on on another engine (``proxy.continuation``, ``ModelFlow``'s
stream mover): the client's stream is unbroken, no token twice or missing, its usage the whole request's; a stream
that cannot be continued faithfully ends with an error event that says why.

The stubs (``tests.stub_engine``) stream one word a token, token ids as vLLM's ``return_token_ids`` gives them,
and continue their answer from a token-id prompt; a ``DROP`` engine dies after two events."""

from __future__ import annotations

import httpx
import pytest

from proxy.continuation import StreamLedger
from tests.stub_engine import FIRST_ID, PROMPT_IDS, Behaviour
from tests.unit.conftest import PROXY_MODEL, ProxyServer, endpoint
from tests.unit.proxy.test_metrics import scrape
from tests.unit.proxy_factories import APIS
from tests.unit.proxy_requests import CHAT_PATH, COMPLETION_PATH, sse_events, streamed_text

pytestmark = pytest.mark.timeout(20)

GREEDY = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"model": PROXY_MODEL, "messages": [{"role": "user", "content": "Say hello."}]} | GREEDY
COMPLETION = {"model": PROXY_MODEL, "prompt": "Say hello."} | GREEDY
REQUESTS = {CHAT_PATH: CHAT, COMPLETION_PATH: COMPLETION}
WHOLE = "hello from decode-1 without kv_transfer_params"
"""The stream the client sees: decode-0's first word, then decode-1's answer from its second word on."""


@pytest.fixture
async def two_decode(pool, make_engine):
    second = await make_engine("decode-1")
    pool.set_endpoints("decode", [*pool.endpoints("decode"), endpoint(second)])
    return second


async def stream(proxy: ProxyServer, path: str, body: dict) -> tuple[httpx.Response, str]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        response = await client.post(path, json=body)
        return response, response.text


def data_of(text: str) -> str:
    """The stream without its SSE comments."""
    return "\n\n".join(block for block in text.split("\n\n") if block and not block.startswith(":")) + "\n\n"


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETION_PATH])
async def test_a_greedy_stream_goes_on_on_another_decode_engine_unbroken(
    make_proxy, pool, path, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=0)
    decode_engine.behaviour = Behaviour.DROP  # it dies after two events: the chat's role and "hello", or two words

    response, text = await stream(proxy, path, REQUESTS[path])

    assert response.status_code == 200
    events = sse_events(data_of(text))
    assert streamed_text(path, events) == (WHOLE if path == CHAT_PATH else "hello from" + WHOLE[10:])
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["id"] for c in events[:-1]} == {chunks[0]["id"]}  # one stream: the first engine's id throughout
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if path == CHAT_PATH else "text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
    assert all(c["choices"][0]["token_ids"] is None for c in chunks)  # asked for the proxy, not shown
    words = len(WHOLE.split())
    assert events[-2]["usage"] == {"prompt_tokens": 2, "total_tokens": 2 + words, "completion_tokens": words}
    sent = 1 if path == CHAT_PATH else 2  # words the client had when decode-0 died
    assert f": pdserve: decode engine decode-0 failed after {sent} tokens; continued on decode engine decode-1" in text
    continued = two_decode.requests[-1]
    assert continued.path == COMPLETION_PATH  # a chat's rest, too, is a completion of its token ids
    assert continued.body["prompt"] == PROMPT_IDS + [FIRST_ID + i for i in range(sent)]
    assert continued.body["return_token_ids"] is True and continued.body["temperature"] == 0
    assert "kv_transfer_params" not in continued.body
    assert decode_engine.requests[-1].body["return_token_ids"] is True
    assert {e.engine_id: e.in_flight for e in pool.engines()} == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        samples = await scrape(client)
    assert samples[("pdserve_proxy_decode_migrations_total", (("model", PROXY_MODEL), ("outcome", "served")))] == 1


async def test_a_continued_stream_keeps_the_limits_and_the_token_ids_the_client_asked_for(
    make_proxy, pool, decode_engine, two_decode
):
    proxy = await make_proxy(health_interval_s=0)
    decode_engine.behaviour = Behaviour.DROP
    body = COMPLETION | {"max_tokens": 4, "min_tokens": 3, "return_token_ids": True}

    response, text = await stream(proxy, COMPLETION_PATH, body)

    events = sse_events(data_of(text))
    assert streamed_text(COMPLETION_PATH, events) == "hello from decode-1 without"  # 4 tokens in all
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[FIRST_ID + i] for i in range(4)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS  # the prompt's ids once, the first event's
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    continued = two_decode.requests[-1].body
    assert (continued["max_tokens"], continued["min_tokens"]) == (2, 1)  # reduced by the 2 generated


async def test_a_stream_continues_on_the_prefill_engine_when_no_decode_engine_is_left(
    make_proxy, pool, prefill_engine, decode_engine
):
    proxy = await make_proxy(health_interval_s=0)
    decode_engine.behaviour = Behaviour.DROP

    response, text = await stream(proxy, CHAT_PATH, CHAT)

    assert streamed_text(CHAT_PATH, sse_events(data_of(text))) == "hello from prefill-0 without kv_transfer_params"
    assert "continued on prefill engine prefill-0" in text
    assert prefill_engine.requests[-1].body["prompt"] == PROMPT_IDS + [FIRST_ID]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"temperature": None}, "it samples (temperature the model's default"),
        ({"temperature": 0.7, "seed": 3}, "it samples (temperature 0.7"),
        ({"n": 2}, "it has n > 1"),
        ({"stop": ["."]}, "it sets stop"),
        ({"logprobs": True}, "it sets logprobs"),
        ({"frequency_penalty": 0.5}, "it sets frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "it sets tools"),
        ({"response_format": {"type": "json_object"}}, "it sets response_format"),
        ({"vllm_xargs": {"a": 1}}, "it sets vllm_xargs, which a continuation cannot keep"),
    ],
)
async def test_a_stream_that_cannot_be_continued_faithfully_ends_with_an_error_that_says_why(
    make_proxy, pool, decode_engine, two_decode, change, reason
):
    proxy = await make_proxy(health_interval_s=0)
    decode_engine.behaviour = Behaviour.DROP
    body = {key: value for key, value in (CHAT | change).items() if value is not None}

    response, text = await stream(proxy, CHAT_PATH, body)

    events = sse_events(text)
    error = events[-1]["error"]
    assert error["code"] == "engine_failed" and f"the stream could not be continued: {reason}" in error["message"]
    assert two_decode.requests == []
    assert "return_token_ids" not in decode_engine.requests[-1].body  # nothing asked that is not needed
    assert {e.engine_id: e.in_flight for e in pool.engines()} == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}


async def test_decode_retries_0_continues_no_stream(make_proxy, pool, decode_engine, two_decode):
    proxy = await make_proxy(health_interval_s=0, decode_retries=0)
    decode_engine.behaviour = Behaviour.DROP

    response, text = await stream(proxy, CHAT_PATH, CHAT)

    assert "could not be continued: proxy.decode_retries is 0" in sse_events(text)[-1]["error"]["message"]
    assert two_decode.requests == []


async def test_a_stream_moves_at_most_decode_retries_times(make_proxy, pool, decode_engine, two_decode):
    proxy = await make_proxy(health_interval_s=0, decode_retries=1, degrade=False)
    decode_engine.behaviour = two_decode.behaviour = Behaviour.DROP  # the continuation dies too

    response, text = await stream(proxy, COMPLETION_PATH, COMPLETION)

    events = sse_events(data_of(text))
    assert events[-1]["error"]["code"] == "engine_failed" and "decode engine decode-1 failed" in text
    assert streamed_text(COMPLETION_PATH, events[:-1]) == "hello from decode-1 without"  # 2 + 2, nothing twice
    assert {e.engine_id: e.in_flight for e in pool.engines()} == {"prefill-0": 0, "decode-0": 0, "decode-1": 0}


# ---------------------------------------------------------------- the ledger alone


def events(*chunks: bytes) -> bytes:
    return b"".join(b"data: " + chunk + b"\n\n" for chunk in chunks)


def test_the_ledger_reads_events_split_anywhere_and_sends_only_whole_ones():
    ledger = StreamLedger(COMPLETION, APIS["completion"])
    raw = events(
        b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"a",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[5,6],"token_ids":[7]}]}',
        b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"b",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[8]}]}',
    )
    out = b"".join(ledger.relay(raw[i : i + 7]) for i in range(0, len(raw), 7))
    assert out.count(b"\n\n") == 2 and b'"token_ids":null' in out and b"[5,6]" not in out
    assert (ledger.prompt_ids, ledger.sent) == ([5, 6], [7, 8])
    assert ledger.continuation_body() == {
        "model": PROXY_MODEL, "temperature": 0, "stream_options": {"include_usage": True},
        "prompt": [5, 6, 7, 8], "stream": True, "return_token_ids": True,
    }  # fmt: skip


def test_a_chat_event_that_shows_nothing_is_dropped_and_a_parsed_delta_refuses():
    ledger = StreamLedger(CHAT, APIS["chat"])
    out = ledger.relay(
        events(
            b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1]}',
            b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[9]}]}',
        )
    )
    assert out.count(b"data: ") == 1 and b'"prompt_token_ids":null' in out  # the empty delta is not shown
    assert ledger.sent == [9] and ledger.continuable() is None
    ledger.relay(
        events(
            b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{"reasoning":"hm"},"logprobs":null,"finish_reason":null,"token_ids":[10]}]}'
        )
    )
    assert ledger.continuable() == "the engine parses its output (reasoning)"


def test_refusal_passes_greedy_requests_of_the_known_fields():
    assert APIS["chat"].continuation_refusal(CHAT | {"max_completion_tokens": 9, "seed": 1, "top_k": 1}) is None
    assert APIS["completion"].continuation_refusal(COMPLETION | {"prompt": [1, 2, 3], "echo": True}) is None
    assert APIS["completion"].continuation_refusal(COMPLETION | {"prompt": ["a", "b"]}) == "it has several prompts"
    assert APIS["responses"].continuation_refusal({"model": PROXY_MODEL, "input": "hi", "temperature": 0}) is not None
