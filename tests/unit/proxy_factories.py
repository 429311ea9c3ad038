"""Builders for the proxy's unit tests: ``ProxyConfig`` from flat keywords
(``proxy_config(prefill_policy="prefix_aware", degrade=False)``), and one request's ``Exchange``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from proxy.config import ProxyConfig, RoutingConfig
from proxy.exchange import Exchange
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool

ROUTING_KEYS = {"prefill_policy": "prefill", "decode_policy": "decode"} | {
    name: name for name in RoutingConfig.model_fields if name.startswith("prefix_")
}
"""Keywords that are ``RoutingConfig``'s fields (its policies named by pool)."""


def proxy_config(model_name: str = "m", **settings: Any) -> ProxyConfig:
    routing = {ROUTING_KEYS[name]: settings.pop(name) for name in list(settings) if name in ROUTING_KEYS}
    return ProxyConfig(model_name=model_name, routing=RoutingConfig(**routing), **settings)


def make_exchange(
    body: dict[str, Any] | None = None,
    kind: str = "completion",
    headers: dict[str, str] | None = None,
    metrics: ProxyMetrics | None = None,
) -> Exchange:
    """An ``Exchange`` of a request with ``headers``, its ``body`` already parsed, as ``TwoPhaseFlow`` makes it."""
    route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    raw_headers = [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    request = Request({"type": "http", "method": "POST", "path": route, "headers": raw_headers})
    exchange = Exchange(request, kind, route, (metrics or ProxyMetrics(EnginePool())).of(None))
    exchange.body = body if body is not None else {"model": "m", "prompt": "Say hello."}
    exchange.engine_headers = {"Content-Type": "application/json", "X-Request-Id": exchange.request_id}
    return exchange
