"""The OpenAI-compatible FastAPI app in front of the prefill and decode pools.

``create_app(config, pool)`` builds the app: the one ``EngineClient`` (keep-alive
connections to the engines) used for every upstream call, each model's ``ModelFlow``
(``proxy.flow``) and the ``Front`` that hands them requests (``proxy.front``). Its
lifespan runs the background tasks that use the client: ``/health`` probes
(``proxy.health``), for the load-aware policies ``/metrics`` polls
(``proxy.load``), and where routing reads prefixes the engines' KV events
(``proxy.residency``); at its end the flows and the client close. Routes:

- one per API of ``proxy.apis.REGISTRY``: ``POST /v1/chat/completions``, ``POST /v1/completions``,
  ``POST /v1/responses`` (streaming and not), served through prefill and decode (one
  ``proxy.exchange.Exchange`` per request; engine calls: ``proxy.upstream``); each API's module says what it
  refuses (the Responses API's ``previous_response_id`` and ``background``: they need the memory of the one
  engine that made a response). ``POST /tokenize``, ``POST /detokenize``: one ready engine of either pool,
  in turn, once the request has an admission slot; counted in the engine's ``in_flight`` while it runs (a
  drain waits for it); its answer as it came.
- ``GET /v1/models``: each served model, then its LoRA adapters (``parent``: the model).
- ``GET /health``: 200 while both pools of every model have a ready engine (healthy, not draining), else 503
  (no key needed).

An app serves one model or several (``create_app`` takes one ``ProxyConfig`` per model): each model has its
own pools, router, health checks, admission gate and ``ModelFlow``; a request goes to the flow of the model
(or adapter) its body names, 404 in OpenAI's format for one nobody serves.
- ``GET /metrics``: Prometheus metrics (``proxy.metrics``; no key needed).
- ``/admin/engines...``: with an admin key only (``proxy.admin``).

A completion request is checked in this order: API key (``proxy.auth``, 401),
Content-Type, body size (``proxy.limits``, 413) and the time its body takes to
come (408), the body (its API's, ``proxy.apis``, 400/404), the context length when
``max_model_len`` is known (400), then it waits for a slot
(``proxy.limits.AdmissionGate``: ``max_concurrent_requests``, or a limit that
follows the pools' ready engines; 429 when the queue is full) and runs,
cancelled if its client goes away (``proxy.disconnect``).

``proxy.routing.Router`` chooses each request's engines (``config.routing``),
or serves it decode-only (no prefill leg). A prefill leg that fails
(``UpstreamFailed``) is tried again on another prefill engine, up to
``config.prefill_retries`` times; an engine's 4xx is not. Every leg counts
in its engine's ``in_flight`` from the moment its engine is chosen until it
ends, whatever ends it (a drain waits for a decode leg whose prefill still runs).

Engines get the cluster's engine key (``engine_auth``), never a client's key
unless ``forward_authorization`` says so (engines someone else started with
``--api-key``).
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
(``proxy.release``, through the exchange's ``KVHandle``), rather than keep it until its lease expires.

The fast path (``config.fast_path``, on by default): ``DirectRoute`` calls the
completion endpoints without FastAPI's dependency machinery, and
``proxy.server.uvicorn_config`` serves with ``CoalescingHttpToolsProtocol``;
both lean on FastAPI's and uvicorn's internals, and each earns it: taken out
one at a time, the proxy spent 9-34 % more CPU per request (the README's
"Proxy" measurements). Off, the proxy runs on stock ``APIRoute`` and uvicorn's
own httptools protocol (the same answers, which ``test_engine_auth`` checks on
both paths; about a third more CPU), the way out if an upgrade of either breaks
the fast path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract import wire
from contract.wire import ROLES
from proxy.admin import PUBLIC_ENGINE_FIELDS, admin_key_of, admin_router, parse_networks
from proxy.apis import REGISTRY, Api
from proxy.auth import KeyCheck, load_keys
from proxy.config import ProxyConfig
from proxy.engine_client import EngineClient
from proxy.errors import ProxyError, error_body, error_response
from proxy.exchange import DECODE_ONLY, DISAGGREGATED, PREFILL_ONLY
from proxy.flow import ModelFlow
from proxy.front import Front
from proxy.health import HealthMonitor, HealthTracker
from proxy.load import LoadPoller
from proxy.metrics import CONTENT_TYPE_LATEST, ProxyMetrics
from proxy.pool import EnginePool, PoolSet
from proxy.residency import EventFeeds
from proxy.routing import Router
from proxy.upstream import Upstream

__all__ = ["DECODE_ONLY", "DISAGGREGATED", "PREFILL_ONLY", "ProxyConfig", "create_app"]

logger = logging.getLogger(__name__)


def create_app(
    config: ProxyConfig | Sequence[ProxyConfig], pool: EnginePool | Mapping[str, EnginePool] | None = None
) -> FastAPI:
    """The proxy's app; ``ProxyConfigError`` if its keys cannot be read.

    ``config``: one model's, or one per model served (``ClusterSpec.proxy_configs``: the same proxy settings,
    the first's taken for what the app shares); ``pool``: the model's pool, or each model's by its name."""
    configs = [config] if isinstance(config, ProxyConfig) else list(config)
    config = configs[0]
    if isinstance(pool, EnginePool):
        pools = PoolSet({config.model_name: pool})
    else:
        pools = PoolSet({c.model_name: (pool or {}).get(c.model_name) or EnginePool() for c in configs})
    created = int(time.time())
    checks_health = config.health_interval_s > 0

    api_keys = KeyCheck(load_keys(config.api_key_env, config.api_key_file))
    admin_keys = KeyCheck(load_keys(config.admin_key_env, config.admin_key_file))
    admin_networks = parse_networks(config.admin_engine_networks)
    metrics = ProxyMetrics(pools.by_model)
    client = EngineClient(connect_timeout_s=config.connect_timeout_s)
    flows = []
    for model_config in configs:
        model_pool = pools.of(model_config.model_name)
        tracker = HealthTracker(model_pool, config.unhealthy_after, config.healthy_after)
        upstream = Upstream(client, model_config.request_timeout_s, model_config.tier_lookup_timeout_s)
        flows.append(
            ModelFlow(
                model_config, Router(model_pool, model_config), tracker, metrics.of(model_config.model_name),
                checks_health, upstream,
            )
        )  # fmt: skip
    flow = flows[0]
    front = Front(config, flows, api_keys, metrics.of(None))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background = []
        for each in flows:
            if checks_health:
                monitor = HealthMonitor(each.tracker, client, config.health_interval_s, config.health_timeout_s)
                background.append(asyncio.create_task(monitor.run(), name="pdserve-health"))
            if each.config.routing.needs_load and config.metrics_interval_s > 0:
                poller = LoadPoller(each.router.pool, client, config.metrics_interval_s, config.health_timeout_s)
                background.append(asyncio.create_task(poller.run(), name="pdserve-load"))
            if each.router.residency is not None:
                feeds = EventFeeds(each.router.pool, each.router.residency, client, each.engine_key_headers)
                background.append(asyncio.create_task(feeds.run(), name="pdserve-kv-events"))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            for each in flows:
                await each.close()
            await client.close()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)
    app.state.pool = flow.router.pool  # the first model's
    app.state.pools = pools
    app.state.config = config
    app.state.router = flow.router
    app.state.health = flow.tracker
    app.state.metrics = metrics
    app.state.flow = flow
    app.state.flows = flows
    app.state.front = front

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, code=str(exc.status_code))
        return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        return error_response(exc)

    # The fast path (``DirectRoute``) or FastAPI's own routing (``config.fast_path``: false).
    completions_api = APIRouter(route_class=DirectRoute if config.fast_path else APIRoute)

    for api in REGISTRY:
        completions_api.add_api_route(api.path, _endpoint(front, api), methods=["POST"], name=api.name)
    app.include_router(completions_api)

    @app.get(wire.MODELS_PATH)
    async def models(request: Request) -> Response:
        front.require_api_key(request)
        data = []
        for each in configs:
            base = {"id": each.model_name, "object": "model", "created": created, "owned_by": "pdserve"}
            data += [base, *(base | {"id": name, "parent": each.model_name} for name in each.adapters)]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        # ok: both pools (of every model) can take requests; degraded: one can, and serves them alone
        # (proxy.degrade); unavailable (503): requests (of a model) would fail. Where the engines listen (URLs,
        # side channels) only for an admin key: an anonymous caller learns how many engines are healthy, not
        # where to send them packets.
        engines = pools.snapshot()
        if not (admin_keys.enabled and admin_keys.allows(admin_key_of(request))):
            engines = {role: [{k: v for k, v in e.items() if k in PUBLIC_ENGINE_FIELDS} for e in listed]
                       for role, listed in engines.items()}  # fmt: skip
        each = {name: _pool_status(model_pool, config.degrade) for name, model_pool in pools.by_model.items()}
        status = next((s for s in ("unavailable", "degraded") if s in each.values()), "ok")
        body = {"status": status, "engines": engines} | ({"models": each} if len(each) > 1 else {})
        code = 503 if status == "unavailable" else 200
        return Response(orjson.dumps(body), status_code=code, media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if admin_keys.enabled:
        app.include_router(admin_router(pools, admin_keys, admin_networks))

    return app


def _pool_status(pool: EnginePool, degrade: bool) -> str:
    """ok: both of a model's pools have a ready engine; degraded: one has, and serves alone; else unavailable."""
    ready = [role for role in ROLES if pool.ready(role)]
    if len(ready) == len(ROLES):
        return "ok"
    return "degraded" if ready and degrade else "unavailable"


def _endpoint(front: Front, api: Api) -> Callable[[Request], Coroutine[Any, Any, Response]]:
    async def endpoint(request: Request) -> Response:
        return await front.serve(request, api)

    return endpoint


class DirectRoute(APIRoute):
    """An ``APIRoute`` whose endpoint, taking only the ``Request`` and returning a ``Response``, is called as is.

    FastAPI's own handler solves the endpoint's dependencies for every request
    (parsing query parameters and cookies, two exit stacks) and then looks at
    what it returned; an endpoint that declares nothing but the request needs
    none of it, and it cost the proxy 15-20 % more CPU per request
    (``scripts/bench_proxy.py``, two runs, against a copy of the proxy without it).
    It reads the fields of FastAPI's ``Dependant``.
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
