"""The proxy and our connector's extras: the ``X-PDServe-KV`` header and releasing abandoned KV.

Stub engines play a prefill engine that offers a release endpoint (as the
``pdserve`` connector does) and a decode engine that reports its KV load; a
real TCP server plays the prefill engine's side channel (``side_channel`` in conftest.py),
and one per TP rank the decode engine's (``report_ranks``), which a stream's report comes from.
"""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest

from proxy.kv_report import kv_report
from tests.stub_engine import Behaviour
from tests.unit.conftest import PROXY_MODEL, released

pytestmark = pytest.mark.timeout(15)

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": PROXY_MODEL, "messages": [{"role": "user", "content": "Say hello."}]}
REPORT = {"source": "transfer", "bytes": 1048576, "transfer_ms": 1.25, "remote_engine_id": "prefill-0"}


async def test_decode_report_becomes_the_x_pdserve_kv_header(client, decode_engine):
    decode_engine.kv_report = REPORT

    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200
    assert response.headers["x-pdserve-kv"] == (
        "source=transfer; bytes=1048576; transfer_ms=1.25; remote_engine_id=prefill-0"
    )


async def test_a_recompute_is_reported_with_its_reason(client, decode_engine):
    decode_engine.kv_report = {"source": "recomputed", "reason": "unreachable", "remote_engine_id": "prefill-0"}

    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.headers["x-pdserve-kv"] == "source=recomputed; reason=unreachable; remote_engine_id=prefill-0"


async def test_no_header_when_the_decode_engine_reports_nothing(client, decode_engine):
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200 and "x-pdserve-kv" not in response.headers


@pytest.fixture
def decode_ranks(report_ranks):
    for rank in report_ranks:
        rank.answer = json.dumps(REPORT).encode()
    return report_ranks


def sse_text(body: str) -> str:
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(orjson.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


async def test_a_stream_gets_its_kv_report_from_every_decode_rank(client, decode_ranks):
    decode_ranks[1].answer = json.dumps(REPORT | {"transfer_ms": 2.5}).encode()

    response = await client.post(CHAT_PATH, json=CHAT | {"stream": True}, headers={"X-Request-Id": "s-1"})

    assert response.status_code == 200
    # bytes add up over the ranks; the slowest rank's time counts
    assert response.headers["x-pdserve-kv"] == (
        "source=transfer; bytes=2097152; transfer_ms=2.5; remote_engine_id=prefill-0"
    )
    assert sse_text(response.text) == "hello from decode-0 with kv_transfer_params"
    assert [rank.messages for rank in decode_ranks] == [[b"PDKV prefill-0 s-1"]] * 2


async def test_a_rank_that_recomputed_makes_the_stream_say_recomputed(client, decode_ranks):
    recomputed = {"source": "recomputed", "reason": "transport", "remote_engine_id": "prefill-0"}
    decode_ranks[0].answer = json.dumps(recomputed).encode()

    response = await client.post(CHAT_PATH, json=CHAT | {"stream": True})

    assert (
        response.headers["x-pdserve-kv"]
        == "source=recomputed; bytes=1048576; transfer_ms=1.25; reason=transport; remote_engine_id=prefill-0"
    )


@pytest.mark.parametrize("answer", [None, b"NONE", b"not json"], ids=["silent", "none", "garbage"])
async def test_a_stream_whose_decode_engine_cannot_report_goes_on_without_the_header(client, decode_ranks, answer):
    decode_ranks[1].answer = answer

    started = asyncio.get_running_loop().time()
    response = await client.post(CHAT_PATH, json=CHAT | {"stream": True})

    assert response.status_code == 200 and "x-pdserve-kv" not in response.headers
    assert sse_text(response.text) == "hello from decode-0 with kv_transfer_params"
    assert asyncio.get_running_loop().time() - started < 2.0  # held up by the report timeout (0.25 s) at most


async def test_a_served_request_releases_nothing(client, side_channel, decode_engine):
    for stream in (False, True):
        response = await client.post(CHAT_PATH, json=CHAT | {"stream": stream})
        assert response.status_code == 200

    await asyncio.sleep(0.3)
    assert side_channel.messages == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("failure", ["500", "400"])
async def test_a_failed_decode_leg_releases_the_prefill_kv_at_once(
    client, side_channel, prefill_engine, decode_engine, stream, failure
):
    request = CHAT | {"stream": stream}
    if failure == "500":
        decode_engine.behaviour = Behaviour.ERROR_500
    else:
        request |= {"max_tokens": 2, "min_tokens": 5}  # the prefill drops min_tokens; the decode refuses it

    response = await client.post(CHAT_PATH, json=request, headers={"X-Request-Id": "req-7"})

    assert response.status_code == (502 if failure == "500" else 400)
    assert await released(side_channel) == ["PDRL req-7"]
    assert prefill_engine.prefill_requests[0].answered_kv_transfer_params["remote_request_id"] == "req-7"


@pytest.mark.parametrize("degrade", [True, False], ids=["served-by-the-prefill-engine", "502"])
async def test_a_decode_engine_that_is_down_releases_the_prefill_kv(make_client, side_channel, decode_engine, degrade):
    await decode_engine.stop()

    response = await (await make_client(degrade=degrade)).post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "req-8"})

    assert response.status_code == (200 if degrade else 502)
    assert await released(side_channel) == ["PDRL req-8"]


async def test_an_unanswered_release_does_not_hold_up_the_client(client, prefill_engine, decode_engine):
    prefill_engine.release_endpoint = "tcp://127.0.0.1:9"  # nothing listens there
    decode_engine.behaviour = Behaviour.ERROR_500

    started = asyncio.get_running_loop().time()
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 502
    assert asyncio.get_running_loop().time() - started < 1.0


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        b'{"pdserve_kv": 1}',
        b'{"kv_transfer_params": {"pdserve_kv": "transfer"}}',
        b'{"kv_transfer_params": null, "x": "pdserve_kv"}',
    ],
)
def test_kv_report_ignores_what_it_cannot_read(payload):
    assert kv_report(payload) is None


def test_kv_report_keeps_zero_bytes_and_drops_empty_fields():
    payload = b'{"kv_transfer_params": {"pdserve_kv": {"source": "local_prefix_cache", "bytes": 0, "reason": ""}}}'

    assert kv_report(payload) == "source=local_prefix_cache; bytes=0"
