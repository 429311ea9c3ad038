"""One proxy app serving two models (``create_app`` with a ``ProxyConfig`` per model), against stub engines:
each request goes to the pools of the model (or adapter) it names, a model nobody serves is a 404 naming every
one, ``/v1/models`` lists them all with their adapters, each model counts in its own metrics and has its own
health, and an admin adds an engine to the pool of the model it names."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.pool import EnginePool
from tests.unit.conftest import ProxyServer, endpoint
from tests.unit.proxy_factories import proxy_config
from tests.unit.proxy_requests import CHAT, CHAT_PATH

ADMIN_KEY = "admin-key-for-tests-0123456789"


@pytest.fixture
async def two(make_engine, monkeypatch) -> AsyncIterator[tuple[httpx.AsyncClient, dict]]:
    """A client of a proxy serving "a" (adapter "a-pirate") and "b", each on a prefill and a decode stub."""
    monkeypatch.setenv("PDSERVE_TEST_ADMIN_KEY", ADMIN_KEY)
    engines, pools = {}, {}
    for model in ("a", "b"):
        pool = pools[model] = EnginePool()
        for role in ("prefill", "decode"):
            engine = engines[f"{model}-{role}"] = await make_engine(f"{model}-{role}-0")
            pool.set_endpoints(role, [endpoint(engine)])
    configs = [
        proxy_config("a", adapters=("a-pirate",), admin_key_env=("PDSERVE_TEST_ADMIN_KEY",)),
        proxy_config("b", admin_key_env=("PDSERVE_TEST_ADMIN_KEY",)),
    ]
    server = await ProxyServer(create_app(configs, pools)).start()
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        yield client, engines | {"pools": pools}
    await server.stop()


@pytest.mark.parametrize(("model", "served_by"), [("a", "a"), ("a-pirate", "a"), ("b", "b")])
async def test_a_request_goes_to_the_pools_of_the_model_it_names(two, model, served_by) -> None:
    client, engines = two
    response = await client.post(CHAT_PATH, json=CHAT | {"model": model})
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-prefill"] == f"{served_by}-prefill-0"
    assert response.headers["x-pdserve-decode"] == f"{served_by}-decode-0"
    other = "b" if served_by == "a" else "a"
    assert not engines[f"{other}-prefill"].requests and not engines[f"{other}-decode"].requests


async def test_a_model_nobody_serves_is_a_404_naming_every_model(two) -> None:
    client, _ = two
    response = await client.post(CHAT_PATH, json=CHAT | {"model": "c"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert error["message"] == "The model `c` does not exist; this server serves `a`, `a-pirate`, `b`"
    # a body that is wrong besides is a 400 first, as with one model
    assert (await client.post(CHAT_PATH, json={"model": "c"})).status_code == 400


async def test_models_lists_every_model_then_its_adapters(two) -> None:
    client, _ = two
    listing = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listing] == [("a", None), ("a-pirate", "a"), ("b", None)]


async def test_each_model_counts_in_its_own_metrics(two) -> None:
    client, _ = two
    for model in ("a", "a-pirate", "b"):
        assert (await client.post(CHAT_PATH, json=CHAT | {"model": model})).status_code == 200
    assert (await client.post(CHAT_PATH, json=CHAT | {"model": "c"})).status_code == 404
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families((await client.get("/metrics")).text)
        for s in family.samples
    }
    received = "pdserve_proxy_requests_received_total"
    assert samples[(received, (("model", "a"),))] == 2 and samples[(received, (("model", "b"),))] == 1
    refused = ("pdserve_proxy_requests_total", (("model", ""), ("path", "disaggregated"), ("route", CHAT_PATH),
                                                ("status", "404")))  # fmt: skip
    assert samples[refused] == 1  # before its body named a model it serves, a request is nobody's
    ready = "pdserve_proxy_pool_engines"
    assert samples[(ready, (("model", "b"), ("role", "decode"), ("state", "ready")))] == 1


async def test_health_is_each_models_and_the_worst_of_them(two) -> None:
    client, engines = two
    assert (await client.get("/health")).json()["models"] == {"a": "ok", "b": "ok"}
    engines["pools"]["b"].set_endpoints("prefill", [])
    engines["pools"]["b"].set_endpoints("decode", [])
    response = await client.get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable" and response.json()["models"] == {"a": "ok", "b": "unavailable"}


async def test_an_admin_adds_an_engine_to_the_pool_of_the_model_it_names(two, make_engine) -> None:
    client, engines = two
    added = await make_engine("b-decode-1")
    headers = {"X-Admin-Key": ADMIN_KEY}
    new = {"role": "decode", "engine_id": "b-decode-1", "url": added.url}
    unnamed = await client.post("/admin/engines", json=new, headers=headers)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"

    assert (await client.post("/admin/engines", json=new | {"model": "b"}, headers=headers)).status_code == 201

    assert [e.engine_id for e in engines["pools"]["b"].engines("decode")] == ["b-decode-0", "b-decode-1"]
    assert [e.engine_id for e in engines["pools"]["a"].engines("decode")] == ["a-decode-0"]
    assert (await client.post("/admin/engines/b-decode-1/drain", headers=headers)).status_code == 200
    assert engines["pools"]["b"].engine("b-decode-1").draining
