"""``ProxyConfig`` for unit tests from flat keywords: ``proxy_config(prefill_policy="prefix_aware", degrade=False)``."""

from __future__ import annotations

from typing import Any

from proxy.config import ProxyConfig, RoutingConfig

ROUTING_KEYS = {"prefill_policy": "prefill", "decode_policy": "decode"} | {
    name: name for name in RoutingConfig.model_fields if name.startswith("prefix_")
}
"""Keywords that are ``RoutingConfig``'s fields (its policies named by pool)."""


def proxy_config(model_name: str = "m", **settings: Any) -> ProxyConfig:
    routing = {ROUTING_KEYS[name]: settings.pop(name) for name in list(settings) if name in ROUTING_KEYS}
    return ProxyConfig(model_name=model_name, routing=RoutingConfig(**routing), **settings)
