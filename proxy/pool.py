"""The proxy's view of the engines: which prefill and decode engines may take requests.

The orchestrator (or, standalone, the command line) sets the endpoints of each
role; the proxy picks one per request. Round robin over the engines that are
in the pool; an engine the orchestrator sees die is taken out, and put back
when it is ready again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from proxy.errors import EngineNotFound, NoHealthyEngine

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

    # --- Minimal add/drain/remove for the admin routes (proxy.admin) ---------------------
    # The routing branch brings the full versions (health, draining that lets requests
    # finish, in-flight counts); these keep the same names and errors so a merge keeps theirs.

    def add(self, role: str, endpoint: Endpoint) -> None:
        """Put ``endpoint`` in ``role``'s pool; ``ValueError`` for an unknown role or an engine id in use."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        if any(e.engine_id == endpoint.engine_id for r in ROLES for e in self._endpoints[r]):
            raise ValueError(f"engine {endpoint.engine_id!r} is already in the pool")
        self._endpoints[role] = (*self._endpoints[role], endpoint)

    def drain(self, engine_id: str) -> None:
        """Send no new request to ``engine_id`` (here: take it out; requests under way finish on their own)."""
        self.remove(engine_id)

    def remove(self, engine_id: str) -> None:
        """Take ``engine_id`` out of its pool; ``EngineNotFound`` if no pool has it."""
        for role in ROLES:
            kept = tuple(e for e in self._endpoints[role] if e.engine_id != engine_id)
            if len(kept) != len(self._endpoints[role]):
                self._endpoints[role] = kept
                return
        raise EngineNotFound(f"no engine {engine_id!r} in the pool", param="engine_id")
