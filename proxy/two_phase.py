"""The two-phase flow of one completion request: admission, routing, the prefill leg (tried again on
another engine if it fails), the decode leg, the KV release when nobody will read it, and the relay.

``TwoPhaseFlow`` is the app's one instance (``proxy.app.create_app`` builds it
and its routes call ``serve``); it owns the engine calls' ``Upstream``, the
``KVReleaser`` and the ``KVReports`` between its ``open`` and ``close`` (the
app's lifespan). Every leg counts in its engine's ``in_flight`` while it runs,
whatever ends it.

Engines are called with the cluster's engine key (``config.engine_auth``;
``connectors.auth``), or with the client's own ``Authorization`` only for
engines someone else started with ``--api-key`` (``forward_authorization``).
The prefill engine is told which decode engine will read its KV
(``config.bind_reader``): it binds the transfer parameters it issues to that
engine, so no other can use them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from connectors import wire
from proxy.auth import KeyCheck, bearer_token, load_engine_key
from proxy.config import ProxyConfig
from proxy.disconnect import cancel_on_disconnect
from proxy.engine_client import EngineClient, EngineResponse
from proxy.errors import (
    ClientGone,
    EngineConnectionError,
    InvalidApiKey,
    InvalidRequest,
    ProxyError,
    UpstreamFailed,
    error_response,
)
from proxy.flow import EngineRejected, Upstream, check_context_length, decode_body, parse_request, prefill_body
from proxy.health import HealthTracker
from proxy.kv_report import KVReports, kv_report
from proxy.limits import AdmissionGate, read_body
from proxy.metrics import DEFAULT_SERVING_PATH, ProxyMetrics
from proxy.pool import EngineState
from proxy.release import KVReleaser
from proxy.routing import DECODE_FAILED, DEGRADED_REASONS, NO_DECODE_ENGINE, PREFILL_FAILED, Router, TierHeld

__all__ = ["DECODE_ONLY", "DISAGGREGATED", "PREFILL_ONLY", "TwoPhaseFlow", "serving_path"]

logger = logging.getLogger(__name__)

DISAGGREGATED, DECODE_ONLY, PREFILL_ONLY = "disaggregated", "decode-only", "prefill-only"
"""The values of ``X-PDServe-Path`` and ``request.state.serving_path``."""


class TwoPhaseFlow:
    """Serves completion requests through the pools (``serve``); one per app."""

    def __init__(
        self,
        config: ProxyConfig,
        router: Router,
        tracker: HealthTracker,
        metrics: ProxyMetrics,
        api_keys: KeyCheck,
        checks_health: bool,
    ) -> None:
        self.config, self.router, self.tracker, self.metrics = config, router, tracker, metrics
        self.api_keys = api_keys
        self.checks_health = checks_health
        self.retries = config.prefill_retries
        self.gate = (
            AdmissionGate(config.max_concurrent_requests, config.max_queued_requests)
            if config.max_concurrent_requests is not None
            else None
        )
        self.engine_authorization = f"Bearer {load_engine_key()}" if config.engine_auth else None
        self.upstream: Upstream | None = None
        self.releaser: KVReleaser | None = None
        self.kv_reports: KVReports | None = None

    def open(self, client: EngineClient) -> None:
        """Start serving on ``client`` (the app's lifespan)."""
        self.upstream = Upstream(client, self.config.request_timeout_s)
        self.releaser = KVReleaser()
        self.kv_reports = KVReports()

    async def close(self) -> None:
        if self.releaser is not None:
            await self.releaser.close()
        if self.kv_reports is not None:
            self.kv_reports.close()

    def require_api_key(self, request: Request) -> None:
        if self.api_keys.keys and not self.api_keys.allows(bearer_token(request.headers.get("authorization"))):
            raise InvalidApiKey("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'")

    def engine_headers(self, request: Request, request_id: str) -> dict[str, str]:
        """The headers of both legs' engine calls."""
        # identity: answers are relayed byte for byte, so they must not come compressed.
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "Accept-Encoding": "identity"}
        if self.engine_authorization is not None:
            headers["Authorization"] = self.engine_authorization  # the cluster's engines take only this
        elif self.config.forward_authorization and (authorization := request.headers.get("authorization")):
            headers["Authorization"] = authorization  # engines started with --api-key check it
        return headers

    # ---------------------------------------------------------------- a request

    async def serve(self, request: Request, kind: str, route: str) -> Response:
        started = time.perf_counter()
        self.metrics.received.inc()
        request_id = request.headers.get("x-request-id") or f"pdserve-{os.urandom(16).hex()}"
        reply_headers = {"X-Request-Id": request_id}
        try:
            response = await self._answer(request, kind, route, request_id, reply_headers, started)
        except ProxyError as e:
            e.headers = reply_headers | e.headers
            response = error_response(e)
        except EngineRejected as e:
            response = Response(
                orjson.dumps(e.body), status_code=e.status, media_type="application/json", headers=reply_headers
            )
        except ClientGone as e:
            response = Response(status_code=e.status)  # sent to nobody; counted
        if not isinstance(response, StreamingResponse):  # a stream counts when it ends
            self.metrics.request_done(route, response.status_code, serving_path(request), time.perf_counter() - started)
        return response

    async def _answer(
        self, request: Request, kind: str, route: str, request_id: str, reply_headers: dict[str, str], started: float
    ) -> Response:
        self.require_api_key(request)
        if "json" not in request.headers.get("content-type", "application/json"):
            raise InvalidRequest("Content-Type must be application/json")
        try:
            raw = await read_body(request, self.config.max_body_bytes)
        except ClientDisconnect as e:
            raise ClientGone(f"request {request_id}: the client went away while sending its body") from e
        body = parse_request(raw, kind, self.config.model_name)
        if self.config.max_model_len is not None:
            check_context_length(body, self.config.max_model_len)
        async with cancel_on_disconnect(request, request_id):
            if self.gate is not None:
                await self.gate.enter()
            slot_handed_on = False
            try:
                outcome = await self._two_legs(request, kind, route, body, request_id, reply_headers, started)
                slot_handed_on = isinstance(outcome, tuple)  # a stream gives the slot back when it ends
            finally:
                if self.gate is not None and not slot_handed_on:
                    self.gate.leave()
            if isinstance(outcome, tuple):
                return await self._relay(*outcome, request_id, reply_headers)
        return outcome

    async def _two_legs(
        self,
        request: Request,
        kind: str,
        route: str,
        body: dict,
        request_id: str,
        reply_headers: dict[str, str],
        started: float,
    ) -> Response | tuple[DecodeStream, EngineState, dict | None]:
        """Route, prefill, decode: the response, or a stream to relay (with its decode engine and KV params)."""
        assert self.upstream is not None and self.releaser is not None, "the flow is not open"
        upstream, releaser = self.upstream, self.releaser
        headers = self.engine_headers(request, request_id)
        held = await self._tier_held(body, kind, headers, request_id) if self.router.asks_tier(body, kind) else None
        prefill_engine, decode_engine, prefix, reason = self.router.route(body, kind, held)
        if prefill_engine is not None:
            path = DISAGGREGATED
        else:
            path = PREFILL_ONLY if reason == NO_DECODE_ENGINE else DECODE_ONLY
            if reason in DEGRADED_REASONS:
                self.metrics.degraded.labels(reason).inc()
        request.state.serving_path = path
        reply_headers["X-PDServe-Path"] = _path_header(path, reason)
        reply_headers["X-PDServe-Decode"] = decode_engine.engine_id
        kv_params = None
        prefill_started = time.perf_counter()
        if prefill_engine is not None:
            reader = decode_engine.engine_id if self.config.bind_reader else None
            try:
                kv_params = await self._prefill(
                    prefill_engine, prefix, route, body, reader, headers, request_id, reply_headers
                )
            except UpstreamFailed as failure:
                if not self.config.degrade:
                    raise
                # Nothing reached the client yet: the decode engine computes the prompt (and says so).
                logger.warning(
                    "request %s: the prefill leg failed (%s); decode engine %s computes the prompt",
                    request_id, failure.message, decode_engine.engine_id,
                )  # fmt: skip
                self.metrics.degraded.labels(PREFILL_FAILED).inc()
                request.state.serving_path = DECODE_ONLY
                reply_headers.pop("X-PDServe-Prefill", None)
                reply_headers["X-PDServe-Path"] = _path_header(DECODE_ONLY, PREFILL_FAILED)
            else:
                if not kv_params:
                    logger.warning(
                        "request %s: prefill engine %s returned no kv_transfer_params; decode engine %s "
                        "will compute the prompt itself",
                        request_id, reply_headers["X-PDServe-Prefill"], decode_engine.engine_id,
                    )  # fmt: skip
        decode_started = time.perf_counter()
        response, decode_engine, kv_params = await self._open_decode(
            request, decode_engine, prefix, route, body, kv_params, headers, request_id, reply_headers
        )
        leg_open = True
        try:
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "request %s: queued %.1f ms, prefill %.1f ms, decode headers %.1f ms",
                    request_id, 1000 * (prefill_started - started), 1000 * (decode_started - prefill_started),
                    1000 * (time.perf_counter() - decode_started),
                )  # fmt: skip
            if body.get("stream"):
                stream = DecodeStream(
                    upstream.stream(response, decode_engine, request_id),
                    response, decode_engine, releaser, kv_params, request_id,
                    StreamMeter(request, route, started, self.metrics, self.gate),
                )  # fmt: skip
                leg_open = False  # the stream ends the leg
            else:
                payload = await upstream.read_all(response, decode_engine, request_id)
                decode_engine.failures = 0
        except BaseException as e:  # the decode leg failed or the client went away: nobody reads the KV
            releaser.release(kv_params, request_id)
            if isinstance(e, UpstreamFailed):
                self._unreachable(decode_engine, e, request_id)
            raise
        finally:
            if leg_open:
                decode_engine.end_leg()
        if not leg_open:
            return stream, decode_engine, kv_params
        if report := kv_report(payload):
            reply_headers["X-PDServe-KV"] = report
        return Response(payload, media_type="application/json", headers=reply_headers)

    async def _open_decode(
        self,
        request: Request,
        engine: EngineState,
        prefix: tuple[int, ...],
        route: str,
        body: dict,
        kv_params: dict | None,
        headers: dict,
        request_id: str,
        reply_headers: dict,
    ) -> tuple[EngineResponse, EngineState, dict | None]:
        """Open the decode leg: the response, its engine (its leg started) and the KV parameters it got.

        An engine that cannot be reached is replaced by another ready decode engine
        (``routing.decode_retries``): nothing reached it or the client. KV bound to the
        engine that failed (``bind_reader``) cannot be read by another: it is released,
        and the next engine computes the prompt (``decode-only; reason=decode-failed``).
        """
        assert self.upstream is not None and self.releaser is not None
        tried: list[EngineState] = []
        while True:
            reply_headers["X-PDServe-Decode"] = engine.engine_id
            engine.start_leg()
            try:
                response = await self.upstream.decode(engine, route, decode_body(body, kv_params), headers, request_id)
                return response, engine, kv_params
            except BaseException as e:
                engine.end_leg()
                if not isinstance(e, UpstreamFailed):
                    self.releaser.release(kv_params, request_id)  # the client went away: nobody reads the KV
                    raise
                failure = e
            self._unreachable(engine, failure, request_id)
            tried.append(engine)
            retryable = failure.unreachable and len(tried) <= self.config.decode_retries
            retry = self.router.retry("decode", prefix, tried) if retryable else None
            if retry is None:
                self.releaser.release(kv_params, request_id)
                raise failure
            logger.warning(
                "request %s: decode engine %s failed; trying decode engine %s",
                request_id, engine.engine_id, retry.engine_id,
            )  # fmt: skip
            if kv_params and self.config.bind_reader:
                self.releaser.release(kv_params, request_id)
                kv_params = None
                self.metrics.degraded.labels(DECODE_FAILED).inc()
                request.state.serving_path = DECODE_ONLY
                reply_headers.pop("X-PDServe-Prefill", None)
                reply_headers["X-PDServe-Path"] = _path_header(DECODE_ONLY, DECODE_FAILED)
            engine = retry

    async def _tier_held(self, body: dict, kind: str, headers: dict, request_id: str) -> TierHeld | None:
        """What the shared KV tier holds of the prompt, as a tier engine answers (``wire.TIER_HELD_PATH``);
        None without an answer within ``routing.tier_lookup_timeout_s`` (routed as without a tier)."""
        assert self.upstream is not None
        engine = self.router.tier_engine()
        if engine is None:
            return None
        timeout_s = self.config.tier_lookup_timeout_s
        url = f"{engine.url}{wire.TIER_HELD_PATH}?kind={kind}"
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.upstream.client.post(url, orjson.dumps(body), headers, timeout_s)
                payload = await response.read(timeout_s)
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {payload[:200]!r}")
            answer = orjson.loads(payload)
            held = TierHeld(int(answer[wire.PROMPT_TOKENS] or 0), int(answer[wire.TIERS].get(wire.SHARED_TIER, 0)))
        except (EngineConnectionError, TimeoutError, ValueError, TypeError, KeyError, AttributeError) as e:
            self.metrics.tier_lookups.labels("failed").inc()
            logger.info("request %s: no answer from %s on the KV tier (%s); routed without it",
                        request_id, engine.engine_id, e or type(e).__name__)  # fmt: skip
            return None
        self.metrics.tier_lookups.labels("ok").inc()
        return held

    def _unreachable(self, engine: EngineState, failure: UpstreamFailed, request_id: str) -> None:
        if self.checks_health and failure.unreachable:
            self.tracker.failed(engine, failure.message, request_id)

    async def _prefill(
        self,
        engine: EngineState,
        prefix: tuple[int, ...],
        path: str,
        body: dict,
        reader: str | None,
        headers: dict,
        request_id: str,
        reply_headers: dict,
    ) -> dict | None:
        """The prefill leg, tried again on other engines if it fails (nothing has reached the client yet)."""
        assert self.upstream is not None
        request = prefill_body(body, reader)
        tried: list[EngineState] = []
        while True:
            reply_headers["X-PDServe-Prefill"] = engine.engine_id
            try:
                with engine:
                    kv_params = await self.upstream.prefill(engine, path, request, headers, request_id)
                engine.failures = 0
                return kv_params
            except UpstreamFailed as failure:
                self._unreachable(engine, failure, request_id)
                tried.append(engine)
                retry = self.router.retry("prefill", prefix, tried) if len(tried) <= self.retries else None
                if retry is None:
                    raise
                logger.warning(
                    "request %s: prefill engine %s failed; trying prefill engine %s",
                    request_id, engine.engine_id, retry.engine_id,
                )  # fmt: skip
                engine = retry

    async def _relay(
        self, stream: DecodeStream, engine: EngineState, kv_params: dict | None, request_id: str, reply_headers: dict
    ) -> Response:
        """The streamed answer. When the decode engine can say how the KV got to it (``pdserve`` connector),
        its headers wait for the first chunk (the KV is loaded by then) and carry ``X-PDServe-KV``."""
        if engine.kv_endpoints and kv_params and wire.PDSERVE_REPORT in kv_params and self.kv_reports is not None:
            try:
                if await stream.first() is not None:
                    asked = time.perf_counter()
                    if report := await self.kv_reports.query(engine.kv_endpoints, kv_params, request_id):
                        reply_headers["X-PDServe-KV"] = report
                    if logger.isEnabledFor(logging.DEBUG):
                        logger.debug(
                            "request %s: KV report from decode engine %s in %.2f ms",
                            request_id, engine.engine_id, 1000 * (time.perf_counter() - asked),
                        )  # fmt: skip
            except BaseException:  # the client went away: no response will close the stream
                await stream.aclose()
                raise
        return RelayResponse(
            stream, media_type="text/event-stream", headers=reply_headers | {"Cache-Control": "no-cache"}
        )


def _path_header(path: str, reason: str | None) -> str:
    """``X-PDServe-Path``: ``disaggregated``, or ``decode-only; reason=...`` / ``prefill-only; reason=...``."""
    return f"{path}; reason={reason}" if reason else path


def serving_path(request: Request) -> str:
    """How the request was served (``request.state.serving_path``, set by the router), for the metrics."""
    return request.scope.get("state", {}).get("serving_path", DEFAULT_SERVING_PATH)


class DecodeStream:
    """A decode engine's SSE stream on its way to the client; ``aclose`` ends the decode leg exactly once.

    An async generator could not promise that: one never started (the client left
    before the response's headers went out) runs no ``finally``. ``RelayResponse``
    closes it whatever happened. If the stream ends before its first chunk
    (failure, client gone), the prefill engine is told to release the KV. Its
    ``StreamMeter`` times the chunks and gives back the request's slot.
    """

    __slots__ = (
        "_chunks",
        "_response",
        "_engine",
        "_releaser",
        "_kv_params",
        "_request_id",
        "_meter",
        "_started",
        "_closed",
        "_pending",
    )

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        response: EngineResponse,
        engine: EngineState,
        releaser: KVReleaser,
        kv_params: dict | None,
        request_id: str,
        meter: StreamMeter,
    ) -> None:
        self._chunks, self._response, self._engine = chunks, response, engine
        self._releaser, self._kv_params, self._request_id = releaser, kv_params, request_id
        self._meter = meter
        self._started = self._closed = False
        self._pending: bytes | None = None

    def __aiter__(self) -> DecodeStream:
        return self

    async def first(self) -> bytes | None:
        """Wait for the first chunk and keep it for the response; None if the stream ended without one."""
        try:
            self._pending = await self.__anext__()
        except StopAsyncIteration:
            return None
        return self._pending

    async def __anext__(self) -> bytes:
        if self._pending is not None:
            chunk, self._pending = self._pending, None
            return chunk
        try:
            chunk = await anext(self._chunks)
        except BaseException:  # the end (StopAsyncIteration), a failure or a cancellation
            await self.aclose()
            raise
        self._started = True
        self._meter.chunk()
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            self._response.release()
            self._engine.end_leg()
            if not self._started:
                logger.info(
                    "request %s: decode engine %s's stream ended before its first chunk",
                    self._request_id, self._engine.engine_id,
                )  # fmt: skip
                self._releaser.release(self._kv_params, self._request_id)
            self._meter.done()


class RelayResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its ``DecodeStream`` however the response ends."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class StreamMeter:
    """One stream's share of the metrics (time to first chunk, between chunks, end to end) and of the
    admission gate (its slot is given back when the stream ends)."""

    __slots__ = ("_request", "_route", "_started", "_metrics", "_gate", "_last")

    def __init__(
        self, request: Request, route: str, started: float, metrics: ProxyMetrics, gate: AdmissionGate | None
    ) -> None:
        self._request, self._route, self._started, self._metrics, self._gate = request, route, started, metrics, gate
        self._last = 0.0

    def chunk(self) -> None:
        now = time.perf_counter()
        if self._last:
            self._metrics.inter_token_latency.observe(now - self._last)
        else:
            self._metrics.time_to_first_token.observe(now - self._started)
        self._last = now

    def done(self) -> None:
        if self._gate is not None:
            self._gate.leave()
        elapsed = time.perf_counter() - self._started
        self._metrics.request_done(self._route, 200, serving_path(self._request), elapsed)
