"""The OpenAI-compatible FastAPI app in front of the prefill and decode pools.

``create_app(config, pool)`` builds the app; its lifespan owns the one
``EngineClient`` (keep-alive connections to the engines) used for every upstream call. Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not):
  the two-phase flow of ``proxy.flow``.
- ``GET /v1/models``: the one served model.
- ``GET /health``: 200 while both pools have an engine, else 503.

The client's ``Authorization`` header goes on to both engines (a vLLM server
started with ``--api-key`` checks it). Every response carries ``X-Request-Id`` (the client's, or one made here) and,
once engines were chosen, ``X-PDServe-Prefill`` / ``X-PDServe-Decode``: the
engines that served it. A non-streaming answer of a decode engine that runs
the ``pdserve`` connector also carries ``X-PDServe-KV``: how the prompt's KV
reached the decode engine (``source=transfer; bytes=...; transfer_ms=...``, or
``source=recomputed; reason=...``).

When the decode leg produced nothing (it failed, or the client went away
first), the prefill engine is told to free the KV it holds for the request
(``proxy.release``), rather than keep it until its lease expires.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.engine_client import EngineClient
from proxy.errors import InvalidRequest, ProxyError, error_body, error_response
from proxy.flow import EngineRejected, Upstream, decode_body, parse_request, prefill_body
from proxy.pool import ROLES, EnginePool
from proxy.release import KVReleaser

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    model_name: str
    request_timeout_s: float = 600.0


def create_app(config: ProxyConfig, pool: EnginePool | None = None) -> FastAPI:
    pool = pool if pool is not None else EnginePool()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineClient()
        app.state.upstream = Upstream(client, config.request_timeout_s)
        app.state.releaser = KVReleaser()
        try:
            yield
        finally:
            await app.state.releaser.close()
            await client.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.pool = pool
    app.state.config = config

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, code=str(exc.status_code))
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")

    async def serve(request: Request, kind: str, path: str) -> Response:
        request_id = request.headers.get("x-request-id") or f"pdserve-{os.urandom(16).hex()}"
        reply_headers = {"X-Request-Id": request_id}
        upstream: Upstream = request.app.state.upstream
        try:
            if "json" not in request.headers.get("content-type", "application/json"):
                raise InvalidRequest("Content-Type must be application/json")
            body = parse_request(await request.body(), kind, config.model_name)
            prefill_engine, decode_engine = pool.pick("prefill"), pool.pick("decode")
            reply_headers |= {
                "X-PDServe-Prefill": prefill_engine.engine_id,
                "X-PDServe-Decode": decode_engine.engine_id,
            }
            # identity: answers are relayed byte for byte, so they must not come compressed.
            headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "Accept-Encoding": "identity"}
            if authorization := request.headers.get("authorization"):
                headers["Authorization"] = authorization  # engines started with --api-key check it
            kv_params = await upstream.prefill(prefill_engine, path, prefill_body(body), headers, request_id)
            if not kv_params:
                logger.warning(
                    "request %s: prefill engine %s returned no kv_transfer_params; decode engine %s "
                    "will compute the prompt itself",
                    request_id, prefill_engine.engine_id, decode_engine.engine_id,
                )  # fmt: skip
            releaser: KVReleaser = request.app.state.releaser
            try:
                response = await upstream.decode(decode_engine, path, decode_body(body, kv_params), headers, request_id)
                if body.get("stream"):
                    return StreamingResponse(
                        _relay(upstream.stream(response, decode_engine, request_id), releaser, kv_params, request_id),
                        media_type="text/event-stream",
                        headers=reply_headers | {"Cache-Control": "no-cache"},
                    )
                payload = await upstream.read_all(response, decode_engine, request_id)
            except BaseException:  # the decode leg failed or the client went away: nobody reads the KV
                releaser.release(kv_params, request_id)
                raise
            if report := kv_report(payload):
                reply_headers["X-PDServe-KV"] = report
            return Response(payload, media_type="application/json", headers=reply_headers)
        except ProxyError as e:
            e.headers = reply_headers | e.headers
            return error_response(e)
        except EngineRejected as e:
            return Response(
                orjson.dumps(e.body), status_code=e.status, media_type="application/json", headers=reply_headers
            )

    completions_api = APIRouter(route_class=DirectRoute)

    @completions_api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat", "/v1/chat/completions")

    @completions_api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion", "/v1/completions")

    app.include_router(completions_api)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": created, "owned_by": "pdserve"}],
        }

    @app.get("/health")
    async def health() -> Response:
        engines = pool.snapshot()
        healthy = all(engines[role] for role in ROLES)
        body = {"status": "ok" if healthy else "unavailable", "engines": engines}
        return Response(orjson.dumps(body), status_code=200 if healthy else 503, media_type="application/json")

    return app


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


async def _relay(
    chunks: AsyncIterator[bytes], releaser: KVReleaser, kv_params: dict | None, request_id: str
) -> AsyncIterator[bytes]:
    """Relay a decode stream; if it ends before its first byte (failure, client gone), release the KV."""
    started = False
    try:
        async for chunk in chunks:
            started = True
            yield chunk
    finally:
        if not started:
            releaser.release(kv_params, request_id)


def kv_report(payload: bytes) -> str | None:
    """The ``X-PDServe-KV`` header value for a decode engine's JSON answer, if it reports its KV load."""
    if b'"pdserve_kv"' not in payload:
        return None
    try:
        report = orjson.loads(payload)["kv_transfer_params"]["pdserve_kv"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if not isinstance(report, dict):
        return None
    keys = ("source", "bytes", "transfer_ms", "reason", "remote_engine_id")
    return "; ".join(f"{key}={report[key]}" for key in keys if report.get(key) not in (None, ""))
