"""Builders of KVTopology for the connector's unit tests; each test file picks its own defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connectors.topology import KVTopology

BASE_FIELDS: dict[str, Any] = {
    "tp_size": 1,
    "tp_rank": 0,
    "total_num_kv_heads": 4,
    "block_size": 16,
    "layout": "HN2D",
    "head_dim": 4,
    "dtype": "bfloat16",
    "num_layers": 2,
}


def topology_factory(**defaults: Any) -> Callable[..., KVTopology]:
    """``make(**overrides)`` building a valid topology from ``BASE_FIELDS | defaults | overrides``."""
    fields = BASE_FIELDS | defaults

    def make(**overrides: Any) -> KVTopology:
        return KVTopology(**(fields | overrides))

    return make
