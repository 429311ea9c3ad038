"""Builders for the proxy's unit tests: ``ProxyConfig`` from flat keywords
(``proxy_config(prefill_policy="prefix_aware", degrade=False)``), the APIs by name (``APIS``), a body checked as
the front checks it (``parse_request``), and one request's ``Exchange``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from proxy.apis import REGISTRY, GenerationApi
from proxy.bodies import parse_object
from proxy.config import ProxyConfig, RoutingConfig
from proxy.exchange import Exchange
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool

ROUTING_KEYS = {"prefill_policy": "prefill", "decode_policy": "decode"} | {
    name: name for name in RoutingConfig.model_fields if name.startswith("prefix_") or name == "kv_events"
}
"""Keywords that are ``RoutingConfig``'s fields (its policies named by pool)."""


def proxy_config(model_name: str = "m", **settings: Any) -> ProxyConfig:
    routing = {ROUTING_KEYS[name]: settings.pop(name) for name in list(settings) if name in ROUTING_KEYS}
    return ProxyConfig(model_name=model_name, routing=RoutingConfig(**routing), **settings)


APIS: dict[str, Any] = {api.name: api for api in REGISTRY}
"""Each API the proxy serves, by its name (``chat``, ``completion``, ``responses``, ``tokenize``...)."""


def parse_request(raw: bytes, kind: str, model_name: str, adapters: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw`` read and checked as the front does for API ``kind`` serving ``model_name`` (and its adapters)."""
    api: GenerationApi = APIS[kind]
    return api.check(parse_object(raw), model_name, adapters)


def make_exchange(
    body: dict[str, Any] | None = None,
    kind: str = "completion",
    headers: dict[str, str] | None = None,
    metrics: ProxyMetrics | None = None,
) -> Exchange:
    """An ``Exchange`` of a request of API ``kind`` with ``headers``, its ``body`` already parsed, as the front makes
    it."""
    api = APIS[kind]
    raw_headers = [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    request = Request({"type": "http", "method": "POST", "path": api.path, "headers": raw_headers})
    exchange = Exchange(request, api, (metrics or ProxyMetrics(EnginePool())).of(None))
    exchange.body = body if body is not None else {"model": "m", "prompt": "Say hello."}
    exchange.engine_headers = {"Content-Type": "application/json", "X-Request-Id": exchange.request_id}
    return exchange
