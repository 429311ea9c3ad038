"""The OpenAI-compatible FastAPI app in front of the prefill and decode pools.

``create_app(config, pool)`` builds the app; its lifespan owns the one
``EngineClient`` (keep-alive connections to the engines) used for every upstream call,
and the background tasks that use it: ``/health`` probes (``proxy.health``) and,
for the load-aware policies, ``/metrics`` polls (``proxy.load``). Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not):
  the two-phase flow of ``proxy.flow``.
- ``GET /v1/models``: the one served model.
- ``GET /health``: 200 while both pools have a ready engine (healthy, not draining), else 503 (no key needed).
- ``GET /metrics``: Prometheus metrics (``proxy.metrics``; no key needed).
- ``/admin/engines...``: with an admin key only (``proxy.admin``).

A completion request is checked in this order: API key (``proxy.auth``, 401),
Content-Type, body size (``proxy.limits``, 413), the body (``proxy.flow``,
400/404), the context length when ``max_model_len`` is known (400), then it
waits for a slot (``proxy.limits.AdmissionGate``, 429 when the queue is full)
and runs, cancelled if its client goes away (``proxy.disconnect``).

``proxy.routing.Router`` chooses each request's engines (``config.routing``),
or serves it decode-only (no prefill leg). A prefill leg that fails
(``UpstreamFailed``) is tried again on another prefill engine, up to
``routing.prefill_retries`` times; an engine's 4xx is not. Every leg counts
in its engine's ``in_flight`` while it runs, whatever ends it.

The client's ``Authorization`` header goes on to the engines only with
``forward_authorization`` (a vLLM server started with ``--api-key`` checks it).
Every response carries ``X-Request-Id`` (the client's, or one made here) and,
once engines were chosen, ``X-PDServe-Path`` (``disaggregated`` or
``decode-only``; also ``request.state.serving_path``, for the metrics),
``X-PDServe-Prefill`` (not when decode-only) and ``X-PDServe-Decode``: how and
by which engines it was served. The answer of a decode engine that runs the
``pdserve`` connector also carries ``X-PDServe-KV``: how the prompt's KV
reached the decode engine (``source=transfer; bytes=...; transfer_ms=...``, or
``source=recomputed; reason=...``; ``proxy.kv_report``). A stream's headers
then wait for its first chunk, when the decode engine has loaded the KV and
its side channel can be asked how.

When the decode leg produced nothing (it failed, or the client went away
first), the prefill engine is told to free the KV it holds for the request
(``proxy.release``), rather than keep it until its lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from connectors import wire
from connectors.wire import ROLES
from proxy.admin import admin_router
from proxy.auth import KeyCheck, bearer_token, load_keys
from proxy.config import ProxyConfig
from proxy.disconnect import cancel_on_disconnect
from proxy.engine_client import EngineClient, EngineResponse
from proxy.errors import (
    ClientGone,
    InvalidApiKey,
    InvalidRequest,
    ProxyError,
    UpstreamFailed,
    error_body,
    error_response,
)
from proxy.flow import EngineRejected, Upstream, check_context_length, decode_body, parse_request, prefill_body
from proxy.health import HealthMonitor, HealthTracker
from proxy.kv_report import KVReports, kv_report
from proxy.limits import AdmissionGate, read_body
from proxy.load import LoadPoller
from proxy.metrics import CONTENT_TYPE_LATEST, DEFAULT_SERVING_PATH, ProxyMetrics
from proxy.pool import EnginePool, EngineState
from proxy.release import KVReleaser
from proxy.routing import DEGRADED_REASONS, NO_DECODE_ENGINE, Router

__all__ = ["DECODE_ONLY", "DISAGGREGATED", "PREFILL_ONLY", "ProxyConfig", "create_app"]

logger = logging.getLogger(__name__)

DISAGGREGATED, DECODE_ONLY, PREFILL_ONLY = "disaggregated", "decode-only", "prefill-only"
"""The values of ``X-PDServe-Path`` and ``request.state.serving_path``."""


def create_app(config: ProxyConfig, pool: EnginePool | None = None) -> FastAPI:
    """The proxy's app; ``ProxyConfigError`` if its keys cannot be read."""
    pool = pool if pool is not None else EnginePool()
    created = int(time.time())
    settings = config.routing
    router = Router(pool, settings)
    tracker = HealthTracker(pool, settings.unhealthy_after, settings.healthy_after)
    checks_health = settings.health_interval_s > 0
    retries = settings.prefill_retries

    api_keys = KeyCheck(load_keys(config.api_key_env, config.api_key_file))
    admin_keys = KeyCheck(load_keys(config.admin_key_env, config.admin_key_file))
    metrics = ProxyMetrics(pool)
    gate = (
        AdmissionGate(config.max_concurrent_requests, config.max_queued_requests)
        if config.max_concurrent_requests is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient(connect_timeout_s=config.connect_timeout_s)
        app.state.upstream = Upstream(client, config.request_timeout_s)
        app.state.releaser = KVReleaser()
        app.state.kv_reports = KVReports()
        background = []
        if checks_health:
            monitor = HealthMonitor(tracker, client, settings.health_interval_s, settings.health_timeout_s)
            background.append(asyncio.create_task(monitor.run(), name="pdserve-health"))
        if settings.needs_load and settings.metrics_interval_s > 0:
            poller = LoadPoller(pool, client, settings.metrics_interval_s, settings.health_timeout_s)
            background.append(asyncio.create_task(poller.run(), name="pdserve-load"))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await app.state.releaser.close()
            app.state.kv_reports.close()
            await client.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.pool = pool
    app.state.config = config
    app.state.router = router
    app.state.health = tracker
    app.state.metrics = metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, code=str(exc.status_code))
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        return error_response(exc)

    def require_api_key(request: Request) -> None:
        if api_keys.keys and not api_keys.allows(bearer_token(request.headers.get("authorization"))):
            raise InvalidApiKey("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'")

    def unreachable(engine: EngineState, failure: UpstreamFailed, request_id: str) -> None:
        if checks_health and failure.unreachable:
            tracker.failed(engine, failure.message, request_id)

    async def prefill(
        upstream: Upstream,
        engine: EngineState,
        prefix: tuple[int, ...],
        path: str,
        body: dict,
        headers: dict,
        request_id: str,
        reply_headers: dict,
    ) -> dict | None:
        """The prefill leg, tried again on other engines if it fails (nothing has reached the client yet)."""
        request = prefill_body(body)
        tried: list[EngineState] = []
        while True:
            reply_headers["X-PDServe-Prefill"] = engine.engine_id
            try:
                with engine:
                    kv_params = await upstream.prefill(engine, path, request, headers, request_id)
                engine.failures = 0
                return kv_params
            except UpstreamFailed as failure:
                unreachable(engine, failure, request_id)
                tried.append(engine)
                retry = router.retry_prefill(prefix, tried) if len(tried) <= retries else None
                if retry is None:
                    raise
                logger.warning(
                    "request %s: prefill engine %s failed; trying prefill engine %s",
                    request_id, engine.engine_id, retry.engine_id,
                )  # fmt: skip
                engine = retry

    async def relay(
        stream: DecodeStream, engine: EngineState, kv_params: dict | None, request_id: str, reply_headers: dict
    ) -> Response:
        """The streamed answer. When the decode engine can say how the KV got to it (``pdserve`` connector),
        its headers wait for the first chunk (the KV is loaded by then) and carry ``X-PDServe-KV``."""
        if engine.kv_endpoints and kv_params and wire.PDSERVE_REPORT in kv_params:
            try:
                if await stream.first() is not None:
                    reports: KVReports = app.state.kv_reports
                    asked = time.perf_counter()
                    if report := await reports.query(engine.kv_endpoints, kv_params, request_id):
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

    async def serve(request: Request, kind: str, route: str) -> Response:
        started = time.perf_counter()
        metrics.received.inc()
        request_id = request.headers.get("x-request-id") or f"pdserve-{os.urandom(16).hex()}"
        reply_headers = {"X-Request-Id": request_id}
        try:
            response = await answer(request, kind, route, request_id, reply_headers, started)
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
            metrics.request_done(route, response.status_code, serving_path(request), time.perf_counter() - started)
        return response

    async def answer(
        request: Request, kind: str, route: str, request_id: str, reply_headers: dict[str, str], started: float
    ) -> Response:
        require_api_key(request)
        if "json" not in request.headers.get("content-type", "application/json"):
            raise InvalidRequest("Content-Type must be application/json")
        try:
            raw = await read_body(request, config.max_body_bytes)
        except ClientDisconnect as e:
            raise ClientGone(f"request {request_id}: the client went away while sending its body") from e
        body = parse_request(raw, kind, config.model_name)
        if config.max_model_len is not None:
            check_context_length(body, config.max_model_len)
        upstream: Upstream = request.app.state.upstream
        releaser: KVReleaser = request.app.state.releaser
        async with cancel_on_disconnect(request, request_id):
            if gate is not None:
                await gate.enter()
            slot_handed_on = False
            try:
                prefill_engine, decode_engine, prefix, reason = router.route(body, kind)
                if prefill_engine is not None:
                    path = DISAGGREGATED
                else:
                    path = PREFILL_ONLY if reason == NO_DECODE_ENGINE else DECODE_ONLY
                    if reason in DEGRADED_REASONS:
                        metrics.degraded.labels(reason).inc()
                request.state.serving_path = path
                reply_headers["X-PDServe-Path"] = _path_header(path, reason)
                reply_headers["X-PDServe-Decode"] = decode_engine.engine_id
                # identity: answers are relayed byte for byte, so they must not come compressed.
                headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
                headers["Accept-Encoding"] = "identity"
                if config.forward_authorization and (authorization := request.headers.get("authorization")):
                    headers["Authorization"] = authorization  # engines started with --api-key check it
                kv_params = None
                prefill_started = time.perf_counter()
                if prefill_engine is not None:
                    kv_params = await prefill(
                        upstream, prefill_engine, prefix, route, body, headers, request_id, reply_headers
                    )
                    if not kv_params:
                        logger.warning(
                            "request %s: prefill engine %s returned no kv_transfer_params; decode engine %s "
                            "will compute the prompt itself",
                            request_id, reply_headers["X-PDServe-Prefill"], decode_engine.engine_id,
                        )  # fmt: skip
                decode_engine.start_leg()
                leg_open = True
                stream: DecodeStream | None = None
                try:
                    decode_started = time.perf_counter()
                    response = await upstream.decode(
                        decode_engine, route, decode_body(body, kv_params), headers, request_id
                    )
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
                            StreamMeter(request, route, started, metrics, gate),
                        )  # fmt: skip
                        leg_open = False  # the stream ends the leg
                        slot_handed_on = True  # and gives the slot back
                    else:
                        payload = await upstream.read_all(response, decode_engine, request_id)
                        decode_engine.failures = 0
                except BaseException as e:  # the decode leg failed or the client went away: nobody reads the KV
                    releaser.release(kv_params, request_id)
                    if isinstance(e, UpstreamFailed):
                        unreachable(decode_engine, e, request_id)
                    raise
                finally:
                    if leg_open:
                        decode_engine.end_leg()
                if stream is not None:
                    return await relay(stream, decode_engine, kv_params, request_id, reply_headers)
            finally:
                if gate is not None and not slot_handed_on:
                    gate.leave()
        if report := kv_report(payload):
            reply_headers["X-PDServe-KV"] = report
        return Response(payload, media_type="application/json", headers=reply_headers)

    completions_api = APIRouter(route_class=DirectRoute)

    @completions_api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat", "/v1/chat/completions")

    @completions_api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion", "/v1/completions")

    app.include_router(completions_api)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        require_api_key(request)
        listing = {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": created, "owned_by": "pdserve"}],
        }
        return Response(orjson.dumps(listing), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        # ok: both pools can take requests; degraded: one can, and serves them alone (proxy.degrade);
        # unavailable (503): requests would fail.
        engines = pool.snapshot()
        ready = [role for role in ROLES if pool.ready(role)]
        if len(ready) == len(ROLES):
            status = "ok"
        else:
            status = "degraded" if ready and config.routing.degrade else "unavailable"
        body = {"status": status, "engines": engines}
        code = 503 if status == "unavailable" else 200
        return Response(orjson.dumps(body), status_code=code, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if admin_keys.enabled:
        app.include_router(admin_router(pool, admin_keys))

    return app


def _path_header(path: str, reason: str | None) -> str:
    """``X-PDServe-Path``: ``disaggregated``, or ``decode-only; reason=...`` / ``prefill-only; reason=...``."""
    return f"{path}; reason={reason}" if reason else path


def serving_path(request: Request) -> str:
    """How the request was served (``request.state.serving_path``, set by the router), for the metrics."""
    return request.scope.get("state", {}).get("serving_path", DEFAULT_SERVING_PATH)


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose endpoint, taking only the ``Request`` and returning a ``Response``, is called as is.

    FastAPI's own handler solves the endpoint's dependencies for every request
    (parsing query parameters and cookies, two exit stacks) and then looks at
    what it returned; an endpoint that declares nothing but the request needs
    none of it, and it cost ~15 µs of CPU a request, about 6% of the proxy's.
    The route stays a FastAPI route: in the OpenAPI schema, behind the app's
    middleware and exception handlers. An endpoint that declares anything more
    (a parameter, a dependency, a response model) gets FastAPI's handler.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        dependant = self.dependant
        declared = (
            dependant.path_params,
            dependant.query_params,
            dependant.header_params,
            dependant.cookie_params,
            dependant.body_params,
            dependant.dependencies,
            dependant.websocket_param_name,
            dependant.http_connection_param_name,
            dependant.response_param_name,
            dependant.background_tasks_param_name,
            dependant.security_scopes_param_name,
            self.response_field,
        )
        if dependant.request_param_name is None or any(declared):
            return super().get_route_handler()
        endpoint, name = self.endpoint, dependant.request_param_name

        async def handler(request: Request) -> Response:
            return await endpoint(**{name: request})

        return handler


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
