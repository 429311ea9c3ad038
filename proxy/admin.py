"""The admin routes: look at the engine pool and change it while the proxy serves.

- ``GET /admin/engines``: ``pool.snapshot()``.
- ``POST /admin/engines`` with ``{"role", "engine_id", "url"}`` (and, for an engine of the
  ``pdserve`` connector, its side channel ``"kv_endpoints"``; ``"model"`` when the proxy
  serves several): add an engine, or take back one that is draining (201).
- ``POST /admin/engines/{engine_id}/drain``: send it no new request.
- ``DELETE /admin/engines/{engine_id}``: take it out.

They exist only when an admin key is configured (``create_app`` does not
mount them otherwise: 404) and each call must present one, as
``X-Admin-Key: <key>`` or ``Authorization: Bearer <key>`` (401 otherwise).
The client API keys do not open them. Under the orchestrator, the controller
sets each role's engines whenever one becomes ready or dies, which replaces
what was changed here.

**Where an added engine may be.** An engine in the pool is sent users'
prompts and answers, the engine key (``engine_auth``: with it, any engine's
``/v1`` routes answer) and, with ``kv_endpoints``, the sealed release and
report messages of the requests it serves. So an admin may add an engine only
on a host of the cluster: one of the hosts of the engines the orchestrator or
the command line gave the pool (``EnginePool.cluster_hosts``), or an address
in ``ProxyConfig.admin_engine_networks`` (CIDRs: ``pdserve proxy
--admin-engine-networks 10.0.0.0/16``). That holds for its URL and for every
side-channel endpoint. A host name matches only a cluster host of the same
name; networks match only IP addresses as written (a name could later resolve
anywhere). Anything else is refused (400, ``param`` ``url`` or
``kv_endpoints.N``) and the pool is unchanged.

What an admin key can do, then: list the pool; drain and remove any engine
(so stop the service: a denial of service); add engines on the cluster's hosts
and allowed networks, which then get the traffic, the engine key and those
messages. Whoever runs a process on such a host can receive them, so an admin
key is worth about as much as a login there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.auth import KeyCheck, bearer_token
from proxy.errors import InvalidApiKey, InvalidRequest, ProxyConfigError
from proxy.pool import KV_ENDPOINT_PATTERN, Endpoint, PoolSet, url_host

__all__ = ["PUBLIC_ENGINE_FIELDS", "Network", "admin_key_of", "admin_router", "parse_networks", "refused_host"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(networks: Iterable[str]) -> tuple[Network, ...]:
    """``ProxyConfig.admin_engine_networks`` as networks; ``ProxyConfigError`` naming a bad one."""
    parsed = []
    for network in networks:
        try:
            parsed.append(ipaddress.ip_network(network, strict=False))
        except ValueError as e:
            raise ProxyConfigError(f"admin_engine_networks: {network!r} is not a network (CIDR): {e}") from e
    return tuple(parsed)


def refused_host(url: str, cluster_hosts: set[str], networks: tuple[Network, ...]) -> str | None:
    """Why an engine at ``url`` may not be added (see the module's docstring), or None if it may."""
    host = url_host(url)
    if host is None:
        return f"{url} names no host"
    if host in cluster_hosts:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and any(address in network for network in networks):
        return None
    allowed = ", ".join(sorted(cluster_hosts)) or "none yet"
    nets = ", ".join(str(n) for n in networks) or "none"
    return (
        f"{host} is not a host of this cluster's engines ({allowed}) nor in admin_engine_networks ({nets}): "
        "an engine is sent users' requests and the engine key"
    )


class NewEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    model: str | None = Field(default=None, description="The model it serves (needed when the proxy serves several)")
    engine_id: str = Field(min_length=1, max_length=200)
    url: str = Field(pattern=r"^https?://[^/\s]+/?$", description="The engine's base URL, e.g. http://10.0.0.5:8100")
    kv_endpoints: list[Annotated[str, Field(pattern=KV_ENDPOINT_PATTERN)]] = Field(
        default_factory=list,
        max_length=64,
        description="The pdserve connector's side channel, one per TP rank (tcp://host:kv_port+rank): a "
        "decode engine's streams then carry X-PDServe-KV",
    )


PUBLIC_ENGINE_FIELDS = frozenset({"engine_id", "in_flight", "healthy", "draining"})
"""What the proxy's ``/health`` shows of each engine to a caller without an admin key (no URL, no side channel)."""


def admin_key_of(request: Request) -> str | None:
    """The admin key a request presents (``X-Admin-Key`` or ``Authorization: Bearer``), or None."""
    return request.headers.get("x-admin-key") or bearer_token(request.headers.get("authorization"))


def admin_router(pools: PoolSet, admin_keys: KeyCheck, networks: tuple[Network, ...] = ()) -> APIRouter:
    router = APIRouter(prefix="/admin")

    def authorize(request: Request) -> None:
        if not admin_keys.allows(admin_key_of(request)):
            raise InvalidApiKey("missing or wrong admin key (X-Admin-Key or Authorization: Bearer)")

    def answer(payload: object, status: int = 200) -> Response:
        return Response(orjson.dumps(payload), status_code=status, media_type="application/json")

    # A ProxyError raised here becomes its OpenAI error answer (the app's exception handler).

    @router.get("/engines")
    async def list_engines(request: Request) -> Response:
        authorize(request)
        return answer(pools.snapshot())

    @router.post("/engines")
    async def add_engine(request: Request) -> Response:
        authorize(request)
        try:
            engine = NewEngine.model_validate_json(await request.body())
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from e
        for param, url in [("url", engine.url), *((f"kv_endpoints.{i}", u) for i, u in enumerate(engine.kv_endpoints))]:
            if (why := refused_host(url, pools.cluster_hosts, networks)) is not None:
                raise InvalidRequest(f"{param}: {why}", param=param)
        pool = pools.of(engine.model)
        try:
            known = next((e for e in pools.engines() if e.engine_id == engine.engine_id), None)
            if known is not None and (not known.draining or known not in pool.engines()):
                raise ValueError(f"engine {engine.engine_id!r} is already in the pool")
            pool.add(
                engine.role, Endpoint(engine.engine_id, engine.url.rstrip("/"), tuple(engine.kv_endpoints))
            )  # or takes a draining one back
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        return answer(pools.snapshot(), 201)

    @router.post("/engines/{engine_id}/drain")
    async def drain_engine(request: Request, engine_id: str) -> Response:
        authorize(request)
        pools.holding(engine_id).drain(engine_id)
        return answer(pools.snapshot())

    @router.delete("/engines/{engine_id}")
    async def remove_engine(request: Request, engine_id: str) -> Response:
        authorize(request)
        pools.holding(engine_id).remove(engine_id)
        return answer(pools.snapshot())

    return router
