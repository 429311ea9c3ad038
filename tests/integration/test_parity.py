"""P/D is invisible to a client: every request a client sends, through the proxy (prefill engine, KV over the
connector, decode engine) and to the decode engine alone (no KV moved: it computes the prompt), gets the same
answer, greedy or seeded. A mismatch fails with both answers.

Covered: greedy and seeded sampling, ``n``, logprobs and top logprobs, JSON-schema and JSON-object output, stop
sequences, penalties, ``min_tokens``, ``logit_bias``, ``echo``, token-id prompts, a batch of prompts, a 2.5k-token
prompt, streamed usage, ``prompt_logprobs``; tool calls (a named function, ``required``, ``auto``; streamed, their
deltas joined); the Responses API (``client.responses``, streamed and not); ``/tokenize`` and ``/detokenize``; a
LoRA adapter both pools load (``engine.lora_adapters``; random weights, ``testlib.lora``), whose answer differs from
the base model's.
``docs/openai-api.md`` has the table of what passes and what is refused.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import openai
import pytest

from contract import wire
from tests.integration.conftest import ADAPTER, Cluster, http_json, kv_report

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)]

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Tell me about the city of Paris."}]
FLOAT_TOLERANCE = 2e-3  # logprobs of KV moved over the connector against KV the engine computed
VARYING = {"id", "created", "created_at", "system_fingerprint", "kv_transfer_params", "request_id"}
"""Fields that differ between any two answers (ids, times) or that P/D adds (the KV parameters)."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
LONG_PROMPT = " ".join(f"Item {i}: the river ran past mill number {i} in the valley." for i in range(140))
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}

CHAT_CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0, "max_tokens": 16},
    "seeded sampling": {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "max_tokens": 16},
    "n and seed": {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 12},
    "logprobs": {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 3},
    "json schema": {
        "temperature": 0,
        "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    },  # fmt: skip
    "json object": {"temperature": 0, "max_tokens": 32, "response_format": {"type": "json_object"}},
    "stop": {"temperature": 0, "max_tokens": 40, "stop": [".", ","]},
    "penalties": {
        "temperature": 0,
        "max_tokens": 24,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
    },  # fmt: skip
    "min tokens": {"temperature": 0, "max_tokens": 20, "min_tokens": 20},
    "logit bias": {"temperature": 0, "max_tokens": 12, "logit_bias": {"330": -100, "314": 5}},
    "max completion tokens": {"temperature": 0, "max_completion_tokens": 6},
    "tool named": {
        "temperature": 0,
        "max_tokens": 48,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },  # fmt: skip
    "tool required": {"temperature": 0, "max_tokens": 48, "tools": [WEATHER], "tool_choice": "required"},
    "tool auto": {"temperature": 0, "max_tokens": 24, "tools": [WEATHER], "tool_choice": "auto"},
}
COMPLETION_CASES: dict[str, dict[str, Any]] = {
    "greedy": {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 16},
    "echo and logprobs": {"prompt": "One, two, three,", "temperature": 0, "max_tokens": 6, "echo": True, "logprobs": 2},
    "token ids": {"prompt": [504, 3575, 282, 4649, 314], "temperature": 0, "max_tokens": 12},
    "batch": {"prompt": ["Red, green,", "Monday, Tuesday,"], "temperature": 0, "max_tokens": 8},
    "prompt logprobs": {"prompt": "The sky is blue and", "temperature": 0, "max_tokens": 4, "prompt_logprobs": 2},
    "long prompt": {"prompt": LONG_PROMPT + "\nThe last mill's number is", "temperature": 0, "max_tokens": 8},
}
STREAM_CASES: dict[str, dict[str, Any]] = {
    "chat usage": {"messages": ASK, "temperature": 0, "max_tokens": 16, "stream_options": {"include_usage": True}},
    "completion usage": {
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 16,
        "stream_options": {"include_usage": True},
    },  # fmt: skip
    "tool named": CHAT_CASES["tool named"] | {"messages": [{"role": "user", "content": "Weather in Paris?"}]},
    "tool required": CHAT_CASES["tool required"] | {"messages": [{"role": "user", "content": "Weather in Rome?"}]},
}


@pytest.fixture(scope="module")
def both(cluster: Cluster) -> dict[str, tuple[str, dict[str, str]]]:
    """Where to send a request through P/D (the proxy) and to one engine alone (the decode engine, with the
    engine key), and the headers each needs."""
    return {"pd": (cluster.proxy_url, {}), "alone": (cluster.engine("decode")["url"], cluster.engine_headers)}


def comparable(value: Any) -> Any:
    """An answer without what differs between any two answers (``VARYING``)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (floats within ``FLOAT_TOLERANCE``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, abs_tol=FLOAT_TOLERANCE):
        return []
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isinf(a) and a == b):
        return []
    return [f"{where or 'answer'}: {a!r} != {b!r}"]


def assert_same(pd: Any, alone: Any) -> None:
    found = differences(comparable(pd), comparable(alone))
    assert not found, (
        f"P/D and one engine alone differ at {found[:5]}\nP/D:   {json.dumps(pd)[:3000]}\n"
        f"alone: {json.dumps(alone)[:3000]}"
    )


def post_both(both: dict, path: str, body: dict) -> tuple[dict, dict]:
    answers = {}
    for name, (base, headers) in both.items():
        status, _, answer = http_json(base + path, body, headers=headers, timeout=300)
        assert status == 200, f"{name}: HTTP {status}: {answer}"
        answers[name] = answer
    return answers["pd"], answers["alone"]


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_answers_equal_one_engine_alone(both, case: str) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}] if "tool" in case else ASK
    pd, alone = post_both(both, wire.CHAT_PATH, {"model": MODEL, "messages": messages} | CHAT_CASES[case])
    assert_same(pd, alone)
    if case in ("tool named", "tool required"):  # the choice forces a call: one came, its arguments are JSON
        [call] = pd["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        json.loads(call["function"]["arguments"])  # whatever a 135M model fills in, it is JSON
    if case == "json schema":
        assert set(json.loads(pd["choices"][0]["message"]["content"])) >= {"city", "population"}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completion_answers_equal_one_engine_alone(both, case: str) -> None:
    pd, alone = post_both(both, wire.COMPLETIONS_PATH, {"model": MODEL} | COMPLETION_CASES[case])
    assert_same(pd, alone)
    if case == "long prompt":
        assert pd["usage"]["prompt_tokens"] > 2500


def stream(base: str, path: str, body: dict, headers: dict[str, str]) -> list[dict]:
    request = urllib.request.Request(
        base + path, data=json.dumps(body | {"stream": True}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )  # fmt: skip
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def joined(events: list[dict]) -> dict:
    """A stream as what its client assembles: each choice's text and tool calls (deltas joined), finish, usage."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            into = choices.setdefault(choice["index"], {"text": "", "tool_calls": {}, "finish_reason": None})
            delta = choice.get("delta", {})
            into["text"] += choice.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                target = into["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                target["name"] += function.get("name") or ""
                target["arguments"] += function.get("arguments") or ""
            into["finish_reason"] = choice.get("finish_reason") or into["finish_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_streams_equal_one_engine_alone(both, case: str) -> None:
    body = {"model": MODEL} | STREAM_CASES[case]
    path = wire.COMPLETIONS_PATH if "prompt" in body else wire.CHAT_PATH
    pd, alone = (joined(stream(base, path, body, headers)) for base, headers in both.values())
    assert_same(pd, alone)
    assert pd["usage"] is not None or "tool" in case
    if "tool" in case:  # the call's deltas arrived whole through the relay: they join into one JSON call
        [call] = pd["choices"][0]["tool_calls"].values()
        assert call["name"] == "get_weather"
        json.loads(call["arguments"])


def openai_clients(both: dict) -> dict[str, openai.OpenAI]:
    return {
        name: openai.OpenAI(base_url=base + "/v1", api_key=headers.get("Authorization", "Bearer x")[7:] or "x",
                            max_retries=0, timeout=300)
        for name, (base, headers) in both.items()
    }  # fmt: skip


def test_the_responses_api_equals_one_engine_alone_streamed_and_not(both) -> None:
    clients = openai_clients(both)
    asked = {"model": MODEL, "input": "Tell me about Paris.", "instructions": "Be brief.", "max_output_tokens": 12}
    whole = {name: client.responses.create(**asked, temperature=0) for name, client in clients.items()}
    assert whole["pd"].output_text and whole["pd"].output_text == whole["alone"].output_text
    assert whole["pd"].usage.model_dump() == whole["alone"].usage.model_dump()

    streamed = {}
    for name, client in clients.items():
        events = list(client.responses.create(**asked, temperature=0, stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))  # none lost, none twice
        streamed[name] = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed["pd"] == streamed["alone"] == whole["pd"].output_text


def test_a_response_through_pd_moved_its_kv(cluster: Cluster) -> None:
    status, headers, answer = http_json(
        cluster.proxy_url + wire.RESPONSES_PATH, {"model": MODEL, "input": LONG_PROMPT[:1500], "max_output_tokens": 4}
    )
    assert status == 200, answer
    assert {k.lower(): v for k, v in headers.items()}["x-pdserve-path"] == "disaggregated"
    assert kv_report(headers)["source"] == "transfer", headers


def test_tokenize_and_detokenize_answer_as_the_engine_does(both) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is Paris."}
    pd, alone = post_both(both, wire.TOKENIZE_PATH, body)
    assert pd == alone and pd["count"] == len(pd["tokens"]) > 3
    chat = {"model": MODEL, "messages": ASK}
    assert_same(*post_both(both, wire.TOKENIZE_PATH, chat))
    pd, alone = post_both(both, wire.DETOKENIZE_PATH, {"model": MODEL, "tokens": pd["tokens"]})
    assert pd == alone and pd["prompt"].strip() == body["prompt"]


def test_an_adapters_answer_through_pd_equals_one_engine_alone_and_differs_from_the_base_models(
    both, cluster: Cluster
) -> None:
    status, _, listing = http_json(cluster.proxy_url + wire.MODELS_PATH)
    assert status == 200 and [m["id"] for m in listing["data"]] == [MODEL, ADAPTER]
    assert listing["data"][1]["parent"] == MODEL
    asked = {"messages": ASK, "temperature": 0, "max_tokens": 16}
    base, base_alone = post_both(both, wire.CHAT_PATH, {"model": MODEL} | asked)
    adapted, adapted_alone = post_both(both, wire.CHAT_PATH, {"model": ADAPTER} | asked)
    assert_same(adapted, adapted_alone)
    assert_same(base, base_alone)
    text = adapted["choices"][0]["message"]["content"]
    assert text != base["choices"][0]["message"]["content"], text  # the same prompt: its base KV was not reused
    status, headers, _ = http_json(
        cluster.proxy_url + wire.CHAT_PATH, {"model": ADAPTER, "messages": ASK, "max_tokens": 2}
    )
    assert status == 200 and {k.lower(): v for k, v in headers.items()}["x-pdserve-path"] == "disaggregated"
    assert kv_report(headers)["source"] in ("transfer", "recomputed")
    unknown, _, error = http_json(cluster.proxy_url + wire.CHAT_PATH, {"model": "no-such-adapter", "messages": ASK})
    assert unknown == 404 and error["error"]["code"] == "model_not_found"
