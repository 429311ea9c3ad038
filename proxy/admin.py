"""The admin routes: look at the engine pool and change it while the proxy serves.

- ``GET /admin/engines``: ``pool.snapshot()``.
- ``POST /admin/engines`` with ``{"role", "engine_id", "url"}`` (and, for an engine of the
  ``pdserve`` connector, its side channel ``"kv_endpoints"``): add an engine, or take
  back one that is draining (201).
- ``POST /admin/engines/{engine_id}/drain``: send it no new request.
- ``DELETE /admin/engines/{engine_id}``: take it out.

They exist only when an admin key is configured (``create_app`` does not
mount them otherwise: 404) and each call must present one, as
``X-Admin-Key: <key>`` or ``Authorization: Bearer <key>`` (401 otherwise).
The client API keys do not open them. Under the orchestrator, the controller
sets each role's engines whenever one becomes ready or dies, which replaces
what was changed here.
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.auth import KeyCheck, bearer_token
from proxy.errors import InvalidApiKey, InvalidRequest
from proxy.pool import KV_ENDPOINT_PATTERN, Endpoint, EnginePool

__all__ = ["admin_router"]


class NewEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    engine_id: str = Field(min_length=1, max_length=200)
    url: str = Field(pattern=r"^https?://[^/\s]+/?$", description="The engine's base URL, e.g. http://10.0.0.5:8100")
    kv_endpoints: list[Annotated[str, Field(pattern=KV_ENDPOINT_PATTERN)]] = Field(
        default_factory=list,
        max_length=64,
        description="The pdserve connector's side channel, one per TP rank (tcp://host:kv_port+rank): a "
        "decode engine's streams then carry X-PDServe-KV",
    )


def admin_router(pool: EnginePool, admin_keys: KeyCheck) -> APIRouter:
    router = APIRouter(prefix="/admin")

    def authorize(request: Request) -> None:
        presented = request.headers.get("x-admin-key") or bearer_token(request.headers.get("authorization"))
        if not admin_keys.allows(presented):
            raise InvalidApiKey("missing or wrong admin key (X-Admin-Key or Authorization: Bearer)")

    def answer(payload: object, status: int = 200) -> Response:
        return Response(orjson.dumps(payload), status_code=status, media_type="application/json")

    # A ProxyError raised here becomes its OpenAI error answer (the app's exception handler).

    @router.get("/engines")
    async def list_engines(request: Request) -> Response:
        authorize(request)
        return answer(pool.snapshot())

    @router.post("/engines")
    async def add_engine(request: Request) -> Response:
        authorize(request)
        try:
            engine = NewEngine.model_validate_json(await request.body())
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from e
        try:
            known = next((e for e in pool.engines() if e.engine_id == engine.engine_id), None)
            if known is not None and not known.draining:
                raise ValueError(f"engine {engine.engine_id!r} is already in the pool")
            pool.add(
                engine.role, Endpoint(engine.engine_id, engine.url.rstrip("/"), tuple(engine.kv_endpoints))
            )  # or takes a draining one back
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        return answer(pool.snapshot(), 201)

    @router.post("/engines/{engine_id}/drain")
    async def drain_engine(request: Request, engine_id: str) -> Response:
        authorize(request)
        pool.drain(engine_id)
        return answer(pool.snapshot())

    @router.delete("/engines/{engine_id}")
    async def remove_engine(request: Request, engine_id: str) -> Response:
        authorize(request)
        pool.remove(engine_id)
        return answer(pool.snapshot())

    return router
