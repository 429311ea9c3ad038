"""The proxy's calls to engines (``proxy.upstream.Upstream``): every one, the tier lookup included, goes
through the app's one ``EngineClient`` with the exchange's route, engine headers and request id.

A recording client stands for ``proxy.engine_client.EngineClient`` here; the same calls against stub
engines over HTTP are ``test_proxy.py``'s and ``test_proxy_routing.py``'s.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from contract import wire
from proxy.errors import EngineConnectionError, UpstreamFailed
from proxy.pool import Endpoint
from proxy.routing import TierHeld
from proxy.upstream import EngineRejected, Upstream
from tests.unit.proxy_factories import make_exchange

ENGINE = Endpoint("decode-0", "http://10.0.0.7:8200")
LONG = {"model": "m", "prompt": "Tell me a story. " * 20}
TIER_ANSWER = {wire.PROMPT_TOKENS: 320, wire.TIERS: {wire.SHARED_TIER: 128, "node": 0}}


class Answer:
    """An engine's answer as ``EngineResponse`` gives it."""

    def __init__(self, status: int, payload: bytes) -> None:
        self.status, self.payload, self.released = status, payload, False

    async def read(self, timeout_s: float) -> bytes:
        self.released = True
        return self.payload


class RecordingClient:
    """Stands for ``EngineClient``: records each ``post`` and answers ``answer`` (or raises it)."""

    def __init__(self, answer: Answer | Exception) -> None:
        self.answer = answer
        self.posts: list[dict[str, Any]] = []

    async def post(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Answer:
        self.posts.append({"url": url, "body": orjson.loads(body), "headers": headers, "timeout_s": timeout_s})
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def upstream(answer: Answer | Exception) -> tuple[Upstream, RecordingClient]:
    client = RecordingClient(answer)
    return Upstream(client, timeout_s=5.0, tier_timeout_s=0.2), client  # type: ignore[arg-type]


async def test_the_tier_lookup_goes_through_the_upstream_client():
    calls, client = upstream(Answer(200, orjson.dumps(TIER_ANSWER)))
    exchange = make_exchange(LONG, headers={"X-Request-Id": "t-1"})

    held = await calls.tier_held(ENGINE, exchange)

    assert held == TierHeld(320, 128)
    assert client.posts == [
        {
            "url": f"{ENGINE.url}{wire.TIER_HELD_PATH}",
            "body": LONG,
            "headers": exchange.engine_headers,
            "timeout_s": 0.2,
        }
    ]
    assert client.posts[0]["headers"]["X-Request-Id"] == "t-1"


@pytest.mark.parametrize(
    "answer",
    [
        EngineConnectionError("refused"),
        TimeoutError("slow"),
        Answer(500, b"engine core died"),
        Answer(200, b"not json"),
        Answer(200, b'{"prompt_tokens": 3}'),
    ],
    ids=["refused", "timeout", "500", "garbage", "incomplete"],
)
async def test_a_tier_lookup_without_a_usable_answer_is_none(answer, caplog):
    calls, _ = upstream(answer)

    with caplog.at_level(logging.INFO, logger="proxy"):
        assert await calls.tier_held(ENGINE, make_exchange(LONG, headers={"X-Request-Id": "t-2"})) is None
    assert any("t-2" in r.getMessage() and "decode-0" in r.getMessage() for r in caplog.records)


async def test_both_legs_go_to_the_exchanges_route_with_its_engine_headers():
    calls, client = upstream(Answer(200, b'{"kv_transfer_params": {"remote_engine_id": "prefill-0"}}'))
    exchange = make_exchange(kind="chat", headers={"X-Request-Id": "t-3"})

    assert await calls.prefill(ENGINE, exchange, {"max_tokens": 1}) == {"remote_engine_id": "prefill-0"}
    await calls.decode(ENGINE, exchange, {"max_tokens": 9})

    assert [(p["url"], p["body"], p["headers"]) for p in client.posts] == [
        (f"{ENGINE.url}/v1/chat/completions", {"max_tokens": 1}, exchange.engine_headers),
        (f"{ENGINE.url}/v1/chat/completions", {"max_tokens": 9}, exchange.engine_headers),
    ]


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (Answer(503, b"busy"), UpstreamFailed),
        (Answer(401, b"no"), UpstreamFailed),
        (Answer(400, b"{}"), EngineRejected),
    ],
    ids=["5xx", "401-is-ours", "4xx-is-the-clients"],
)
async def test_an_engines_error_status_is_a_failure_or_the_clients_error(answer, raised):
    calls, _ = upstream(answer)
    exchange = make_exchange()

    with pytest.raises(raised):
        await calls.prefill(ENGINE, exchange, {})
    with pytest.raises(raised):
        await calls.decode(ENGINE, exchange, {})
