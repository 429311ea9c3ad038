"""The proxy's view of the engines: which prefill and decode engines exist, and which may take requests.

The orchestrator (or, standalone, the command line) sets the endpoints of
each role (``set_endpoints``); an admin may ``add``, ``drain`` or ``remove``
one engine. The hosts of the engines set by the orchestrator or the command
line are the cluster's (``cluster_hosts``, never shrinking): ``proxy.admin``
adds engines only there, or in networks the proxy's settings name.

Each engine has an ``EngineState``: the proxy's own in-flight legs on it
(``with engine:`` is one leg), its health (``proxy.health`` ejects and
readmits it), whether it is draining, and the load it last reported on
``/metrics`` (``proxy.load``).

``ready(role)`` is what routing chooses from: the engines that are healthy
and not draining, as a tuple rebuilt only when something changes, so that
reading it costs nothing per request. The policies of ``proxy.routing``
choose among them; ``pick`` is plain round robin. Whoever follows the ready
engines (the admission limit of ``proxy.limits``) is called when they change
(``watch``).

A request's legs count on their engines from the moment the router chose them
(``proxy.exchange.Exchange.routed``), not only while each runs: a drain (a role
move, a scale-down) that comes while a request's prefill leg runs sees its
decode leg in that engine's ``in_flight``, and waits for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from contract.wire import ROLES, TCP_ENDPOINT_PATTERN
from proxy.errors import InvalidRequest, NoHealthyEngine, UnknownEngine

__all__ = [
    "KV_ENDPOINT_PATTERN",
    "ROLES",
    "Endpoint",
    "EnginePool",
    "EngineState",
    "PoolSet",
    "endpoint_hosts",
    "url_host",
]

KV_ENDPOINT_PATTERN = TCP_ENDPOINT_PATTERN
"""One TP rank's side channel of the ``pdserve`` connector (``contract.wire.side_channel_endpoint``)."""


def url_host(url: str) -> str | None:
    """The host of ``http://host:port`` or ``tcp://host:port``, lower case, an IPv6 address without brackets."""
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None


def endpoint_hosts(endpoint: Endpoint) -> set[str]:
    """The hosts an engine's endpoint names: its URL's and its side channel's."""
    hosts = {url_host(url) for url in (endpoint.url, *endpoint.kv_endpoints)}
    return {host for host in hosts if host}


@dataclass(frozen=True, slots=True)
class Endpoint:
    engine_id: str
    url: str
    kv_endpoints: tuple[str, ...] = ()
    """The ``pdserve`` connector's side channel, one ZMQ endpoint per TP rank (none for other connectors)."""


@dataclass(slots=True, eq=False)
class EngineState:
    """One engine as the proxy sees it. Compared by identity: a re-added engine is a new state."""

    engine_id: str
    url: str
    role: str
    kv_endpoints: tuple[str, ...] = ()
    """Its connector's side channel, one ZMQ endpoint per TP rank (``pdserve`` connector only)."""
    in_flight: int = 0
    """Legs (prefill or decode calls) this proxy has routed to the engine and not yet ended: those under way, and
    those of requests routed here whose earlier leg (the prefill) still runs."""
    healthy: bool = True
    draining: bool = False
    failures: int = 0
    """Consecutive failures (probes, connection errors of requests); a success resets it."""
    successes: int = 0
    """Consecutive successful probes while ejected."""
    waiting: float = 0.0
    """Requests waiting in the engine's queue (``vllm:num_requests_waiting``), as last polled."""
    kv_cache_usage: float = 0.0
    """Fraction of the engine's KV cache in use (``vllm:kv_cache_usage_perc``, 0-1), as last polled."""

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.engine_id, self.url, self.kv_endpoints)

    @property
    def load(self) -> float:
        """The least-loaded score: this proxy's legs on it, its queue, and its KV cache use (0-1, a tie-breaker).

        The queue also counts this proxy's own requests that wait there: twice, then, but
        it is the only sign of what other proxies (``--workers``) send it.
        """
        return self.in_flight + self.waiting + self.kv_cache_usage

    def start_leg(self) -> None:
        self.in_flight += 1

    def end_leg(self) -> None:
        self.in_flight -= 1

    def __enter__(self) -> EngineState:
        self.in_flight += 1
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self.in_flight -= 1


class EnginePool:
    def __init__(self) -> None:
        self._engines: dict[str, EngineState] = {}
        self._roles: dict[str, tuple[EngineState, ...]] = {role: () for role in ROLES}
        self._ready: dict[str, tuple[EngineState, ...]] = {role: () for role in ROLES}
        self._counters = {role: itertools.count() for role in ROLES}
        self.cluster_hosts: set[str] = set()
        """Hosts (URL and side-channel) of every engine ``set_endpoints`` was given: the cluster's machines."""
        self.targets: dict[str, int] = {}
        """Each pool's size as its cluster's controller wants it (its autoscaler or ``pdserve scale``), when
        there is one: ``/metrics`` says it beside the engines the pool has."""
        self._watchers: list[Callable[[], None]] = []

    # --- membership (orchestrator, admin) --------------------------------------------------

    def set_endpoints(self, role: str, endpoints: list[Endpoint]) -> None:
        """Make ``endpoints`` the role's engines. One already known keeps its state (in-flight, health, draining).
        Their hosts join ``cluster_hosts``."""
        for endpoint in endpoints:
            self.cluster_hosts.update(endpoint_hosts(endpoint))
        self._replace(role, endpoints)

    def _replace(self, role: str, endpoints: list[Endpoint]) -> None:
        _check_role(role)
        engines = []
        for endpoint in endpoints:
            known = self._engines.get(endpoint.engine_id)
            if known is not None and known.role == role and known.url == endpoint.url:
                known.kv_endpoints = endpoint.kv_endpoints
                engines.append(known)
            else:
                engines.append(EngineState(endpoint.engine_id, endpoint.url, role, endpoint.kv_endpoints))
        for engine in self._roles[role]:
            self._engines.pop(engine.engine_id, None)
        for engine in engines:
            self._engines[engine.engine_id] = engine
        self._roles[role] = tuple(engines)
        self._refresh(role)

    def add(self, role: str, endpoint: Endpoint) -> EngineState:
        """Add an engine, or take back one that is draining (its URL may change: then it starts afresh)."""
        _check_role(role)
        known = self._engines.get(endpoint.engine_id)
        if known is not None and known.role != role:
            raise ValueError(f"engine {endpoint.engine_id!r} is already a {known.role} engine")
        if known is not None and known.url == endpoint.url:
            known.draining = False
            known.kv_endpoints = endpoint.kv_endpoints
            self._refresh(role)
            return known
        engines = [e for e in self._roles[role] if e.engine_id != endpoint.engine_id]
        self._replace(role, [e.endpoint for e in engines] + [endpoint])  # not the cluster's hosts by being added
        return self._engines[endpoint.engine_id]

    def drain(self, engine_id: str) -> EngineState:
        """Stop choosing the engine; the requests it has continue. ``add`` takes it back."""
        engine = self.engine(engine_id)
        engine.draining = True
        self._refresh(engine.role)
        return engine

    def remove(self, engine_id: str) -> EngineState:
        """Forget the engine; the requests it has continue (their legs end on the returned state)."""
        engine = self.engine(engine_id)
        self.set_endpoints(engine.role, [e.endpoint for e in self._roles[engine.role] if e is not engine])
        return engine

    def set_healthy(self, engine: EngineState, healthy: bool) -> None:
        engine.healthy = healthy
        self._refresh(engine.role)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the ready engines may have changed (membership, draining, health)."""
        self._watchers.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self._watchers:
            self._watchers.remove(callback)

    # --- reading ---------------------------------------------------------------------------

    def engine(self, engine_id: str) -> EngineState:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise UnknownEngine(f"no engine {engine_id!r} in the pool", param="engine_id") from None

    def engines(self, role: str | None = None) -> tuple[EngineState, ...]:
        """Every engine of ``role`` (of both roles if None), ready or not."""
        if role is None:
            return self._roles["prefill"] + self._roles["decode"]
        return self._roles[role]

    def endpoints(self, role: str) -> tuple[Endpoint, ...]:
        return tuple(engine.endpoint for engine in self._roles[role])

    def ready(self, role: str) -> tuple[EngineState, ...]:
        """The engines of ``role`` routing may choose: healthy and not draining."""
        return self._ready[role]

    def pick(self, role: str) -> EngineState:
        """Round robin over the ready engines of ``role``."""
        engines = self._ready[role]
        if not engines:
            raise no_healthy_engine(role)
        return engines[next(self._counters[role]) % len(engines)]

    def snapshot(self) -> dict[str, list[dict[str, str | int | bool | list[str]]]]:
        return {
            role: [
                {
                    "engine_id": e.engine_id,
                    "url": e.url,
                    "in_flight": e.in_flight,
                    "healthy": e.healthy,
                    "draining": e.draining,
                    "kv_endpoints": list(e.kv_endpoints),
                }
                for e in engines
            ]
            for role, engines in self._roles.items()
        }

    def _refresh(self, role: str) -> None:
        self._ready[role] = tuple(e for e in self._roles[role] if e.healthy and not e.draining)
        for callback in self._watchers:
            callback()


class PoolSet:
    """The pools of every model one app serves, by the model's name (``create_app``; one proxy, several models).
    Engine ids are unique across them (a cluster's are ``KEY-prefill-0``)."""

    def __init__(self, pools: Mapping[str, EnginePool]) -> None:
        self.by_model = dict(pools)

    def of(self, model: str | None) -> EnginePool:
        """The pool of ``model`` (None: the only one); ``InvalidRequest`` (param ``model``) for another."""
        if model is None and len(self.by_model) == 1:
            return next(iter(self.by_model.values()))
        if model in self.by_model:
            return self.by_model[model]
        names = ", ".join(self.by_model)
        raise InvalidRequest(f"model: {'name one' if model is None else f'no model {model!r}'} of {names}",
                             param="model")  # fmt: skip

    def holding(self, engine_id: str) -> EnginePool:
        """The pool of the engine ``engine_id``; ``UnknownEngine`` if none has it."""
        for pool in self.by_model.values():
            if any(e.engine_id == engine_id for e in pool.engines()):
                return pool
        raise UnknownEngine(f"no engine {engine_id!r} in the pool", param="engine_id")

    def engines(self) -> tuple[EngineState, ...]:
        return tuple(e for pool in self.by_model.values() for e in pool.engines())

    @property
    def cluster_hosts(self) -> set[str]:
        return set().union(*(pool.cluster_hosts for pool in self.by_model.values()))

    def snapshot(self) -> dict[str, list[dict[str, str | int | bool | list[str]]]]:
        """Every model's engines, by role (``EnginePool.snapshot``)."""
        merged: dict[str, list] = {role: [] for role in ROLES}
        for pool in self.by_model.values():
            for role, engines in pool.snapshot().items():
                merged[role] += engines
        return merged


def no_healthy_engine(role: str) -> NoHealthyEngine:
    return NoHealthyEngine(f"no healthy {role} engine is available", headers={"Retry-After": "5"})


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
