"""What clients send beyond chat and completions: OpenAI's Responses API through prefill and decode, and the
routes one engine answers (``/tokenize``, ``/detokenize``), against stub engines.

The real path (vLLM CPU engines, the ``openai`` SDK's ``client.responses``) is
``tests/integration/test_parity.py``.
"""

from __future__ import annotations

import orjson
import pytest

from contract import headers, wire
from proxy.apis.responses import Responses, conversation
from proxy.errors import ContextLengthExceeded, InvalidRequest
from proxy.routing import prefix_hashes
from tests.stub_engine import answer_text
from tests.unit.conftest import PROXY_MODEL
from tests.unit.proxy_factories import APIS, parse_request
from tests.unit.proxy_requests import assert_openai_error

pytestmark = pytest.mark.timeout(15)

RESPONSE = {"model": PROXY_MODEL, "input": "Say hello."}


def events_of(text: str) -> list[tuple[str, dict]]:
    """A Responses API stream's ``(event, data)`` pairs."""
    pairs = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event, data = block.split("\n", 1)
        assert event.startswith("event: ") and data.startswith("data: "), block
        pairs.append((event.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return pairs


def output_text(payload: dict) -> str:
    return "".join(part["text"] for item in payload["output"] for part in item["content"])


async def test_a_response_is_prefilled_then_decoded_with_the_prefills_kv(client, prefill_engine, decode_engine):
    response = await client.post(wire.RESPONSES_PATH, json=RESPONSE | {"max_output_tokens": 40})

    assert response.status_code == 200, response.text
    assert output_text(response.json()) == answer_text("decode-0", with_kv=True)
    assert response.headers[headers.PATH] == "disaggregated"
    [prefill] = prefill_engine.prefill_requests
    assert prefill.path == wire.RESPONSES_PATH
    # one token, not stored, not streamed; nothing of chat's (max_tokens, n) that vLLM's Responses API lacks
    assert (prefill.body["max_output_tokens"], prefill.body["stream"], prefill.body["store"]) == (1, False, False)
    assert "max_tokens" not in prefill.body and "n" not in prefill.body
    [decode] = decode_engine.decode_requests
    assert decode.body["max_output_tokens"] == 40 and decode.body["input"] == "Say hello."
    assert decode.kv_transfer_params == prefill.answered_kv_transfer_params


async def test_a_streamed_response_relays_the_event_stream_and_reads_the_kv_past_the_preamble(
    client, prefill_engine, decode_engine
):
    async with client.stream("POST", wire.RESPONSES_PATH, json=RESPONSE | {"stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join([chunk async for chunk in response.aiter_text()])

    events = events_of(text)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1][0] == "response.completed" and "[DONE]" not in text
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == answer_text("decode-0", with_kv=True)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))  # none lost, none twice


def test_the_preamble_of_a_responses_stream_is_not_generation():
    assert not Responses().generated(b'event: response.created\ndata: {"type":"response.created"}\n\n')
    both = b"event: response.created\ndata: {}\n\nevent: response.in_progress\ndata: {}\n\n"
    assert not Responses().generated(both)
    assert Responses().generated(both + b'event: response.output_item.added\ndata: {"type":"x"}\n\n')
    assert not Responses().generated(b'data: {"error": {}}\n\n')  # no event line: not the engine generating


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background")],
)
async def test_what_needs_one_engines_memory_is_refused_clearly(client, prefill_engine, decode_engine, fields, param):
    response = await client.post(wire.RESPONSES_PATH, json=RESPONSE | fields)

    error = assert_openai_error(response, 400, error_type="invalid_request_error", param=param)
    assert f"{param} is not supported by pdserve's prefill/decode" in error["message"]
    assert prefill_engine.requests == [] and decode_engine.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": PROXY_MODEL}, "input"),
        ({"model": PROXY_MODEL, "input": ""}, "input"),
        (RESPONSE | {"max_output_tokens": 0}, "max_output_tokens"),
        (RESPONSE | {"stream": "yes"}, "stream"),
        (RESPONSE | {"kv_transfer_params": {"remote_host": "10.0.0.1"}}, "kv_transfer_params"),
    ],
)
def test_a_bad_responses_body_is_refused_with_the_field(body, param):
    with pytest.raises(InvalidRequest) as refused:
        parse_request(orjson.dumps(body), "responses", PROXY_MODEL)
    assert refused.value.param == param


def test_a_responses_prefill_keeps_its_own_fields_and_drops_the_stream():
    body = RESPONSE | {"stream": True, "stream_options": {"include_obfuscation": False}, "max_output_tokens": 9}
    prefill = Responses().prefill_body(body, "decode-0")
    assert (prefill["max_output_tokens"], prefill["stream"], prefill["store"]) == (1, False, False)
    assert "stream_options" not in prefill and prefill["kv_transfer_params"][wire.PDSERVE_READER] == "decode-0"
    assert body["max_output_tokens"] == 9  # the client's body is left as it came


def test_a_responses_conversation_is_routed_as_the_chat_it_is():
    body = {
        "model": PROXY_MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "The capital of France?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
            {"role": "user", "content": "And of Italy?"},
        ],
    }
    messages = conversation(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    chat = {"model": PROXY_MODEL, "messages": messages}
    assert APIS["responses"].estimate_tokens(body) == APIS["chat"].estimate_tokens(chat) > 0
    assert prefix_hashes(body, APIS["responses"], 8, 4) == prefix_hashes(chat, APIS["chat"], 8, 4) != ()
    image = {"model": PROXY_MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "url": "x"}]}]}
    assert APIS["responses"].estimate_tokens(image) > 10**9  # not text: never decode-only
    assert conversation(RESPONSE) == [{"role": "user", "content": "Say hello."}]


def test_a_responses_request_that_cannot_fit_names_max_output_tokens():
    with pytest.raises(ContextLengthExceeded) as refused:
        Responses().check_length(RESPONSE | {"max_output_tokens": 5000}, 4096)
    assert refused.value.param == "max_output_tokens" and "in the input" in refused.value.message


# --- /tokenize and /detokenize: one engine, no KV -----------------------------------------


@pytest.mark.parametrize("path", [wire.TOKENIZE_PATH, wire.DETOKENIZE_PATH])
async def test_tokenize_and_detokenize_are_answered_by_one_ready_engine_in_turn(
    client, prefill_engine, decode_engine, path
):
    body = {"model": PROXY_MODEL, "prompt": "one two three"} if path == wire.TOKENIZE_PATH else {"tokens": [1, 2]}
    first = await client.post(path, json=body)
    second = await client.post(path, json=body)

    assert first.status_code == second.status_code == 200, first.text
    if path == wire.TOKENIZE_PATH:
        assert first.json()["count"] == 3 and first.json()["tokens"] == [100, 101, 102]
    else:
        assert first.json()["prompt"] == "w1 w2"
    assert first.headers[headers.DECODE] == "decode-0" and second.headers[headers.PREFILL] == "prefill-0"
    assert decode_engine.requests == prefill_engine.requests == []  # stub: tokenize is not recorded as a leg


async def test_tokenize_refuses_another_model_and_a_body_that_is_not_an_object(client, prefill_engine, decode_engine):
    other = await client.post(wire.TOKENIZE_PATH, json={"model": "gpt-4o", "prompt": "hi"})
    assert_openai_error(other, 404, error_type="invalid_request_error", code="model_not_found", param="model")
    not_json = await client.post(wire.TOKENIZE_PATH, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert_openai_error(not_json, 400, error_type="invalid_request_error")


async def test_tokenize_needs_the_api_key_like_every_route(make_client, monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_KEYS", "sk-good")
    client = await make_client(api_key_env=("PDSERVE_TEST_KEYS",))
    refused = await client.post(wire.TOKENIZE_PATH, json={"prompt": "hi"})
    allowed = await client.post(wire.TOKENIZE_PATH, json={"prompt": "hi"}, headers={"authorization": "Bearer sk-good"})
    assert_openai_error(refused, 401, error_type="invalid_request_error", code="invalid_api_key")
    assert allowed.status_code == 200


async def test_a_decode_engine_dying_mid_response_ends_the_stream_with_the_apis_error_event(client, decode_engine):
    from tests.stub_engine import Behaviour

    decode_engine.behaviour = Behaviour.DROP
    async with client.stream("POST", wire.RESPONSES_PATH, json=RESPONSE | {"stream": True}) as response:
        text = (await response.aread()).decode()

    assert response.status_code == 200  # the headers went out with the preamble
    events = events_of(text)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    name, error = events[-1]
    assert name == "error" and error["type"] == "error" and error["code"] == "engine_failed"
    assert "decode engine decode-0" in error["message"]


async def test_a_responses_kv_counts_as_read_only_past_the_preamble():
    """vLLM sends the preamble before the decode engine ran: a stream that ends there read no KV, so its exchange
    releases the prefill's (``Exchange.close``); the first event past it marks the KV read."""
    from types import SimpleNamespace

    from proxy.relay import DecodeStream

    reads: list[str] = []
    exchange = SimpleNamespace(
        kv=SimpleNamespace(read=lambda: reads.append("read")),
        chunk_relayed=lambda: None,
        request_id="r-1",
        api=Responses(),
    )
    exchange.close = lambda status: None
    engine = SimpleNamespace(end_leg=lambda: None, engine_id="decode-0")
    preamble = [b"event: response.created\ndata: {}\n\n", b"event: response.in_progress\ndata: {}\n\n"]

    async def chunks(items):
        for item in items:
            yield item

    response = SimpleNamespace(release=lambda: None)
    cut = DecodeStream(chunks(preamble), response, engine, exchange)
    assert await cut.first() is None and reads == []  # ended in its preamble: nothing read
    assert [chunk async for chunk in cut] == preamble  # what came is still relayed

    delta = b'event: response.output_text.delta\ndata: {"delta": "Hi"}\n\n'
    whole = DecodeStream(chunks([*preamble, delta]), response, engine, exchange)
    assert await whole.first() == delta and reads == ["read"]
    assert [chunk async for chunk in whole] == [*preamble, delta]
