"""The proxy's calls to engines for a request, on the app's one ``EngineClient``.

``Upstream`` makes every call an exchange (``proxy.exchange.Exchange``) needs,
with the exchange's engine headers and request id: ``prefill`` (the answer's
``kv_transfer_params``), ``decode`` (the open response), then ``read_all`` or
``stream`` of its body, and ``tier_held`` (what the shared KV tier holds of the
prompt, asked before routing). The bodies they carry are ``proxy.bodies``'s.

An engine that cannot be reached, resets, times out or answers 5xx becomes
``UpstreamFailed`` (502), logged with the request id and the engine; an
engine's 4xx (e.g. a prompt longer than the context) is the client's error and
becomes ``EngineRejected``, relayed as it came. A tier lookup that fails is
logged and answers None: the request is routed as without a tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import orjson

from contract import wire
from proxy.engine_client import EngineClient, EngineResponse
from proxy.errors import EngineConnectionError, UpstreamFailed, error_body
from proxy.routing import TierHeld

if TYPE_CHECKING:
    from proxy.exchange import Exchange

__all__ = ["EngineAddress", "EngineRejected", "Upstream"]

logger = logging.getLogger(__name__)


class EngineAddress(Protocol):
    """What an upstream call needs of an engine (``proxy.pool.Endpoint`` or ``EngineState``)."""

    engine_id: str
    url: str


class Upstream:
    """HTTP calls to engines, on the app's one ``EngineClient`` (keep-alive connections per engine)."""

    def __init__(self, client: EngineClient, timeout_s: float, tier_timeout_s: float) -> None:
        self.client = client
        # A prefill call is bounded as a whole; a decode stream may run longer than
        # timeout_s in total, but never stays silent for longer than that.
        self.timeout_s = timeout_s
        self.tier_timeout_s = tier_timeout_s

    async def prefill(self, engine: EngineAddress, exchange: Exchange, body: dict) -> dict | None:
        """Run the prefill phase with ``body`` (its API's ``prefill_body``); the engine's ``kv_transfer_params``."""
        deadline = time.monotonic() + self.timeout_s
        url, request_id = engine.url + exchange.api.path, exchange.request_id
        try:
            response = await self.client.post(url, orjson.dumps(body), exchange.engine_headers, self.timeout_s)
            payload = await response.read(max(deadline - time.monotonic(), 0.0))
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(engine, "prefill", request_id, e) from e
        status = response.status
        if _engine_fault(status):
            raise _engine_failed(engine, "prefill", request_id, _engine_status(status, payload))
        if status >= 400:
            raise EngineRejected(status, payload)
        try:
            return orjson.loads(payload).get(wire.KV_TRANSFER_PARAMS)
        except (orjson.JSONDecodeError, AttributeError) as e:
            raise _engine_failed(engine, "prefill", request_id, f"unreadable answer: {e}") from e

    async def decode(
        self, engine: EngineAddress, exchange: Exchange, body: dict, route: str | None = None
    ) -> EngineResponse:
        """Open the decode call with ``body`` (``bodies.decode_body``) at ``route`` (the exchange's); return the
        response (the caller reads or releases it)."""
        url, request_id = engine.url + (route or exchange.api.path), exchange.request_id
        try:
            response = await self.client.post(url, orjson.dumps(body), exchange.engine_headers, self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(engine, "decode", request_id, e) from e
        if response.status >= 400:
            try:
                payload = await response.read(self.timeout_s)
            except (EngineConnectionError, TimeoutError) as e:
                raise _engine_failed(engine, "decode", request_id, e) from e
            if _engine_fault(response.status):
                raise _engine_failed(engine, "decode", request_id, _engine_status(response.status, payload))
            raise EngineRejected(response.status, payload)
        return response

    async def call(self, engine: EngineAddress, exchange: Exchange, raw: bytes) -> tuple[int, bytes]:
        """One call to ``engine`` at the exchange's route with the client's body as it came: the status and
        the answer (a relay API, ``proxy.apis.relays``)."""
        url, request_id, phase = engine.url + exchange.api.path, exchange.request_id, exchange.api.name
        try:
            response = await self.client.post(url, raw, exchange.engine_headers, self.timeout_s)
            payload = await response.read(self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(engine, phase, request_id, e) from e
        if _engine_fault(response.status):
            raise _engine_failed(engine, phase, request_id, _engine_status(response.status, payload))
        return response.status, payload

    async def read_all(self, response: EngineResponse, engine: EngineAddress, exchange: Exchange) -> bytes:
        """The decode engine's whole JSON answer."""
        try:
            return await response.read(self.timeout_s)
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(engine, "decode", exchange.request_id, e) from e

    async def stream(self, response: EngineResponse, engine: EngineAddress, exchange: Exchange) -> AsyncIterator[bytes]:
        """An SSE stream's bytes as they come; an engine failing mid-stream raises ``UpstreamFailed``
        (``proxy.relay.DecodeStream`` decides how the stream goes on)."""
        try:
            async for chunk in response.chunks(self.timeout_s):
                yield chunk
        except (EngineConnectionError, TimeoutError) as e:
            raise _engine_failed(engine, "decode", exchange.request_id, e) from e
        finally:
            response.release()

    async def tier_held(self, engine: EngineAddress, exchange: Exchange) -> TierHeld | None:
        """What the shared KV tier holds of the exchange's prompt, as ``engine`` answers (``wire.TIER_HELD_PATH``);
        None without an answer within ``tier_timeout_s``."""
        timeout_s = self.tier_timeout_s
        url = engine.url + wire.TIER_HELD_PATH
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.client.post(url, orjson.dumps(exchange.body), exchange.engine_headers, timeout_s)
                payload = await response.read(timeout_s)
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {payload[:200]!r}")
            answer = orjson.loads(payload)
            blocks = answer.get(wire.BLOCKS) or ()
            if not all(type(block) is int for block in blocks):
                raise ValueError("blocks that are not integers")
            shared = int(answer[wire.TIERS].get(wire.SHARED_TIER, 0))
            return TierHeld(int(answer[wire.PROMPT_TOKENS] or 0), shared, tuple(blocks))
        except (EngineConnectionError, TimeoutError, ValueError, TypeError, KeyError, AttributeError) as e:
            logger.info("request %s: no answer from %s on the KV tier (%s); routed without it",
                        exchange.request_id, engine.engine_id, e or type(e).__name__)  # fmt: skip
            return None


class EngineRejected(Exception):
    """An engine answered 4xx: the client's request is at fault; relay the answer."""

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(f"engine answered HTTP {status}")
        self.status = status
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            parsed = None
        if not (isinstance(parsed, dict) and "error" in parsed):
            parsed = error_body(payload.decode(errors="replace")[:500], "invalid_request_error")
        self.body = parsed


def _engine_status(status: int, payload: bytes) -> str:
    if status == 401:  # the proxy's own key, not the client's: the client must not see a 401
        return "HTTP 401: the engine refused the proxy's engine key (is it of another cluster's secret?)"
    return f"HTTP {status}: {payload[:200]!r}"


def _engine_fault(status: int) -> bool:
    """An engine's answer that is the engine's failure, not the client's: a 5xx, or a 401 (the cluster's engine
    key refused: the engine is not the cluster's, or its key is not ours)."""
    return status >= 500 or status == 401


def _engine_failed(engine: EngineAddress, phase: str, request_id: str, cause: object) -> UpstreamFailed:
    reason = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
    logger.warning("request %s: %s engine %s failed: %s", request_id, phase, engine.engine_id, reason)
    failure = UpstreamFailed(f"{phase} engine {engine.engine_id} failed: {reason}")
    failure.unreachable = isinstance(cause, EngineConnectionError)
    return failure
