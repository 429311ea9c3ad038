"""The proxy's view of the engines: which prefill and decode engines may take requests.

The orchestrator (or, standalone, the command line) sets the endpoints of each
role; the proxy picks one per request. Round robin over the engines that are
in the pool; an engine the orchestrator sees die is taken out, and put back
when it is ready again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from proxy.errors import NoHealthyEngine

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Endpoint:
    engine_id: str
    url: str


class EnginePool:
    def __init__(self) -> None:
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {role: () for role in ROLES}
        self._counters = {role: itertools.count() for role in ROLES}

    def set_endpoints(self, role: str, endpoints: list[Endpoint]) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        self._endpoints[role] = tuple(endpoints)

    def endpoints(self, role: str) -> tuple[Endpoint, ...]:
        return self._endpoints[role]

    def pick(self, role: str) -> Endpoint:
        endpoints = self._endpoints[role]
        if not endpoints:
            raise NoHealthyEngine(f"no healthy {role} engine is available", headers={"Retry-After": "5"})
        return endpoints[next(self._counters[role]) % len(endpoints)]

    def snapshot(self) -> dict[str, list[dict[str, str]]]:
        return {
            role: [{"engine_id": e.engine_id, "url": e.url} for e in endpoints]
            for role, endpoints in self._endpoints.items()
        }
