"""Routing policies: how a pool's engine is chosen for a request, one module a policy, one registry.

A policy is a small class with the ``RoutingPolicy`` interface, over the pool's
ready engines (``EnginePool.ready``); it does no I/O. It says what it needs:
``needs_load`` (the engines' reported load, so the proxy polls their
``/metrics``), ``needs_prefix`` (the prompt's prefix hashes, and what a shared KV
tier holds of them); and how the autoscaling simulator models it
(``simulated_as``: ``"in_turn"`` or ``"least_loaded"``; None: it cannot, and a
simulation of it is refused by name).

``REGISTRY`` maps the config's choice (``proxy.routing.prefill`` / ``decode``)
to the policy's class; adding a policy is its module and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from proxy.policies.least_loaded import LeastLoaded, least_loaded
from proxy.policies.prefix_aware import PrefixAware, PrefixIndex
from proxy.policies.round_robin import RoundRobin

if TYPE_CHECKING:
    from proxy.config import RoutingConfig
    from proxy.pool import EngineState

__all__ = [
    "REGISTRY",
    "LeastLoaded",
    "PrefixAware",
    "PrefixIndex",
    "RoundRobin",
    "RoutingPolicy",
    "describe",
    "least_loaded",
    "make_policy",
    "simulated_as",
]


class RoutingPolicy(Protocol):
    """One pool's choice of engine."""

    needs_load: ClassVar[bool]
    """Reads ``EngineState.load`` (the proxy's legs on the engine, its queue and KV cache use from /metrics)."""
    needs_prefix: ClassVar[bool]
    """Reads the prompt's prefix hashes (and ``shared_depth``: what a shared KV tier holds of them)."""
    simulated_as: ClassVar[str | None]
    """How ``orchestrator.autoscale.simulator`` models it: ``"in_turn"``, ``"least_loaded"``, or None (refused)."""
    summary: ClassVar[str]
    """What it picks, in a few words (the configuration reference lists the choices with it)."""
    index: PrefixIndex | None
    """The prefixes it was sent, by engine, if it keeps them (the router reuses it for ``decode_only_if_cached``)."""

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> RoutingPolicy: ...

    def pick(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        """The engine for a request (``engines`` is never empty); a policy with an ``index`` records it.
        ``resident``: how many leading blocks of ``prefix`` each engine's prefix cache holds, from its KV events
        (``proxy.residency``; None: unknown), which a policy that reads prefixes prefers to its ``index``."""
        ...

    def choose(
        self,
        engines: Sequence[EngineState],
        prefix: tuple[int, ...] = (),
        shared_depth: int = 0,
        resident: Mapping[str, int] | None = None,
    ) -> EngineState:
        """``pick`` without recording the choice in ``index`` (the router records it itself)."""
        ...


REGISTRY: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix_aware": PrefixAware,
}


def describe() -> str:
    """The choices, each with its summary, for the config's description."""
    return ", ".join(f"{name} ({policy.summary})" for name, policy in REGISTRY.items())


def make_policy(name: str, routing: RoutingConfig) -> RoutingPolicy:
    try:
        policy = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {tuple(REGISTRY)}") from None
    return policy.from_config(routing)


def simulated_as(name: str) -> str:
    """How the autoscaling simulator models policy ``name`` (``"in_turn"`` or ``"least_loaded"``); ValueError
    naming it if the simulator cannot."""
    policy = REGISTRY.get(name)
    if policy is None:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {tuple(REGISTRY)}")
    if policy.simulated_as is None:
        raise ValueError(f"the simulator does not model routing policy {name!r}; simulate another or add it there")
    return policy.simulated_as
