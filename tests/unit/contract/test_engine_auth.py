"""The proxy's side of the trust rules: engines get the cluster's engine key and never a client's, the
prefill learns which decode engine will read, an engine's 401 is the proxy's fault (502, not 401);
and the proxy serves the same on its fast path and on stock FastAPI/uvicorn (``fast_path``)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from contract.auth import PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV, SECRET_ENV, engine_key
from proxy.app import ProxyConfig, create_app
from proxy.auth import load_engine_key
from proxy.errors import ProxyConfigError
from proxy.pool import EnginePool
from tests.stub_engine import Behaviour
from tests.unit.conftest import PROXY_MODEL, TEST_SECRET, released
from tests.unit.proxy_requests import CHAT, CHAT_PATH, wait_until

pytestmark = pytest.mark.timeout(15)

ENGINE_KEY = f"Bearer {engine_key(TEST_SECRET)}"


async def test_engines_get_the_clusters_key_and_never_the_clients(make_client, prefill_engine, decode_engine):
    client = await make_client(engine_auth=True, forward_authorization=True)
    response = await client.post(CHAT_PATH, json=CHAT, headers={"Authorization": "Bearer sk-client"})

    assert response.status_code == 200
    for engine in (prefill_engine, decode_engine):
        assert engine.requests[0].headers["authorization"] == ENGINE_KEY


def test_engine_auth_without_a_secret_names_where_it_is_looked_for(monkeypatch) -> None:
    for name in (SECRET_ENV, PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ProxyConfigError, match=f"{PROXY_ENGINE_KEY_ENV}.*{PROXY_ENGINE_KEY_FILE_ENV}.*{SECRET_ENV}"):
        create_app(ProxyConfig(model_name=PROXY_MODEL, engine_auth=True), EnginePool())


def test_the_engine_key_comes_first_then_its_file_then_the_secret(monkeypatch, tmp_path) -> None:
    """The cluster's proxy is given the key (``PDSERVE_ENGINE_KEY``); one started by hand a file of it, or the
    secret file to derive it from."""
    for name in (PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    given, in_file = "k" * 64, "f" * 64
    (tmp_path / "engine.key").write_text(in_file + "\n")
    assert load_engine_key() == engine_key(TEST_SECRET)  # the conftest's secret: derived
    monkeypatch.setenv(PROXY_ENGINE_KEY_FILE_ENV, str(tmp_path / "engine.key"))
    assert load_engine_key() == in_file
    monkeypatch.setenv(PROXY_ENGINE_KEY_ENV, given)
    assert load_engine_key() == given
    monkeypatch.delenv(SECRET_ENV)
    assert load_engine_key() == given  # no secret needed
    monkeypatch.delenv(PROXY_ENGINE_KEY_ENV)
    monkeypatch.setenv(PROXY_ENGINE_KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ProxyConfigError, match="cannot read the engine key file"):
        load_engine_key()


async def test_a_proxy_given_only_the_engine_key_sends_it(make_client, monkeypatch, prefill_engine, decode_engine):
    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.setenv(PROXY_ENGINE_KEY_ENV, engine_key(TEST_SECRET))
    client = await make_client(engine_auth=True)
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 200
    for engine in (prefill_engine, decode_engine):
        assert engine.requests[0].headers["authorization"] == ENGINE_KEY


@pytest.mark.parametrize("refusing", ["prefill", "decode"])
async def test_an_engine_refusing_the_proxys_key_is_a_502_not_the_clients_401(
    make_client, prefill_engine, decode_engine, refusing
):
    async def unauthorized(request: web.Request, received) -> web.Response:
        return web.json_response({"error": "Unauthorized"}, status=401)

    (prefill_engine if refusing == "prefill" else decode_engine).handler = unauthorized
    client = await make_client(engine_auth=True, prefill_retries=0, degrade=False)
    response = await client.post(CHAT_PATH, json=CHAT)

    assert response.status_code == 502, response.text
    assert "engine key" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_failed_prefill_leg_is_served_decode_only_and_counted(
    make_client, prefill_engine, decode_engine, stream
):
    prefill_engine.behaviour = Behaviour.ERROR_500
    client = await make_client()
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": stream}) as response:
        await response.aread()
    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "decode-only; reason=prefill-failed"
    assert "kv_transfer_params" not in decode_engine.requests[0].body
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_proxy_degraded_requests_total{model="m",reason="prefill-failed"} 1.0' in metrics


async def test_the_prefill_is_told_which_decode_engine_will_read(make_client, prefill_engine, decode_engine):
    client = await make_client(bind_reader=True)
    assert (await client.post(CHAT_PATH, json=CHAT)).status_code == 200
    assert prefill_engine.requests[0].kv_transfer_params["pdserve_reader"] == "decode-0"
    unbound = await make_client()
    assert (await unbound.post(CHAT_PATH, json=CHAT)).status_code == 200
    assert "pdserve_reader" not in prefill_engine.requests[1].kv_transfer_params


# --------------------------------------------------------------------------- fast path and stock path

both_paths = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "stock-fastapi-uvicorn"])


@both_paths
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_same_answer_on_either_path(make_client, prefill_engine, decode_engine, fast_path, stream):
    client = await make_client(fast_path=fast_path)
    async with client.stream("POST", CHAT_PATH, json=CHAT | {"stream": stream}) as response:
        body = (await response.aread()).decode()
    assert response.status_code == 200
    assert response.headers["x-pdserve-path"] == "disaggregated"
    assert "decode-0" in body and (body.count("data: ") > 1) == stream
    assert decode_engine.requests[0].kv_transfer_params["remote_engine_id"] == "prefill-0"


@both_paths
async def test_bad_requests_get_openai_errors_on_either_path(make_client, fast_path):
    client = await make_client(fast_path=fast_path, api_key_env=("PD_TEST_KEY",))
    response = await client.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    keyed = {"Authorization": "Bearer k"}
    response = await client.post(CHAT_PATH, json={"model": PROXY_MODEL, "messages": []}, headers=keyed)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


@both_paths
async def test_a_client_leaving_cancels_the_engine_request_on_either_path(
    make_client, side_channel, prefill_engine, decode_engine, fast_path
):
    client = await make_client(fast_path=fast_path, request_timeout_s=30)
    decode_engine.behaviour = Behaviour.HANG
    call = asyncio.create_task(client.post(CHAT_PATH, json=CHAT, headers={"X-Request-Id": "gone-7"}))
    await wait_until(lambda: bool(decode_engine.requests))
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_until(lambda: decode_engine.requests[0].disconnected)
    assert await released(side_channel) == ["PDRL gone-7"]


@pytest.fixture(autouse=True)
def _key(monkeypatch) -> None:
    monkeypatch.setenv("PD_TEST_KEY", "k")
