"""The official ``openai`` client, unchanged, against the proxy of the shared cluster.

What a user of the OpenAI API relies on, through both legs (prefill engine,
KV over the connector, decode engine): chat and text completions, streamed
and not; ``usage`` (also in a stream with ``stream_options.include_usage``);
sampling fields that must reach the decode engine (``stop``, ``n``,
``logprobs``, ``seed``, ``max_completion_tokens``); errors as the client's
exception classes; the request id and the serving path in the headers.
"""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import ADAPTER, Cluster, kv_report

# What the OpenAI client sees is the proxy's doing, whatever connector moves the KV: on our connector's
# shared cluster only (vLLM's NixlConnector spins its engines' cores, and doubles this file's time).
pytestmark = [pytest.mark.integration, pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)]

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Tell me about the city of Paris."}]


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_usage_is_the_same_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk comes last
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_text_completion_with_stop_and_max_completion_tokens(client: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four, five, six,"
    stopped = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stop=[","])
    assert stopped.choices[0].finish_reason == "stop" and "," not in stopped.choices[0].text

    short = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"


def test_n_seed_and_logprobs_reach_the_decode_engine(client: openai.OpenAI) -> None:
    sampled = dict(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=12, seed=1234)
    raw = client.chat.completions.with_raw_response.create(n=3, logprobs=True, top_logprobs=2, **sampled)
    # The decode engine reads the prompt's KV once for the n samples (vLLM makes each one a request with the
    # same parameters: no replay), and says so.
    assert kv_report(raw.headers)["source"] == "transfer", raw.headers
    first = raw.parse()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    for choice in first.choices:
        assert all(len(token.top_logprobs) == 2 for token in choice.logprobs.content)
    # The same seed gives the same sample; each of the n choices is its own sample.
    again = client.chat.completions.create(n=3, logprobs=True, top_logprobs=2, **sampled)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    assert len({c.message.content for c in first.choices}) > 1


def test_headers_say_how_the_request_was_served(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=4, extra_headers={"X-Request-Id": "conformance-1"}
    )
    assert raw.headers["x-request-id"] == "conformance-1"
    assert raw.headers["x-pdserve-path"] == "disaggregated"
    assert raw.headers["x-pdserve-prefill"] == "prefill-0" and raw.headers["x-pdserve-decode"] == "decode-0"
    assert raw.parse().usage.completion_tokens == 4


def test_errors_are_the_clients_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hi " * 5000, max_tokens=4)
    assert "context" in too_long.value.message.lower()
    assert [m.id for m in client.models.list()] == [MODEL, ADAPTER]  # the cluster's LoRA adapter after the model


def test_a_client_cannot_tell_the_engines_where_to_read_kv(client: openai.OpenAI) -> None:
    # vLLM's connectors take kv_transfer_params from the request: through the proxy, only a prefill
    # engine of the cluster sets them.
    forged = {"do_remote_prefill": True, "remote_host": "198.18.0.99", "remote_port": 5600, "remote_block_ids": [0]}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"kv_transfer_params": forged})
    assert refused.value.param == "kv_transfer_params"


FIRST_REQUEST = [{"role": "user", "content": "What is the capital of France?"}]
"""The README's first request (no sampling fields: the demo's generation defaults apply, as this cluster's)."""


def test_the_readmes_first_request_answers_right_every_time(client: openai.OpenAI) -> None:
    answers = [client.chat.completions.create(model=MODEL, messages=FIRST_REQUEST) for _ in range(10)]
    assert {(a.choices[0].message.content, a.choices[0].finish_reason) for a in answers} == {
        ("The capital of France is Paris.", "stop")
    }
    for _ in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=FIRST_REQUEST, stream=True)
        assert (
            "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "The capital of France is Paris."
        )
