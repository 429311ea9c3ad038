"""``orchestrator.proxy_actor.ProxyActor`` without Ray: the class the controller wraps in ``ray.remote``.

Its server runs in the test's event loop, as in the actor's; ``set_endpoints``
is what the controller calls as engines come and go.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from contract.auth import PROXY_ENGINE_KEY_ENV, SECRET_ENV, SECRET_FILE_ENV, ClusterSecret, EngineKey, engine_key
from orchestrator import engine_handles, proxy_actor
from orchestrator.pools import Pools
from orchestrator.proxy_actor import ProxyActor
from orchestrator.proxy_link import ProxyLink
from orchestrator.spec import ClusterSpec
from proxy.app import ProxyConfig
from proxy.server import listen_socket
from tests.stub_engine import answer_text
from tests.unit.conftest import TEST_SECRET, spec_dict
from tests.unit.controller_factories import Events

pytestmark = pytest.mark.timeout(20)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}


def free_port() -> int:
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture
def actor_process(monkeypatch):
    """The actor's process as the test's own, its environment restored afterwards (the actor writes it)."""
    monkeypatch.setattr(proxy_actor, "redirect_output", lambda path: None)  # keep pytest's stdout
    monkeypatch.setattr(proxy_actor, "tune_gc", lambda: None)  # pytest's process keeps its collector as it is
    monkeypatch.setenv(PROXY_ENGINE_KEY_ENV, "")  # monkeypatch puts back what was there (nothing)
    monkeypatch.setenv(SECRET_FILE_ENV, "/as/if/ray/had/passed/it/on")  # the conftest set PDSERVE_CLUSTER_SECRET


@pytest.fixture
async def actor(actor_process, tmp_path):
    actor = ProxyActor(
        ProxyConfig(model_name="m", request_timeout_s=5.0), "127.0.0.1", free_port(), str(tmp_path / "proxy.log")
    )
    yield actor
    await actor.stop()


async def test_serves_the_engines_the_controller_sets(actor, prefill_engine, decode_engine):
    info = await actor.start()
    await actor.set_endpoints("prefill", [("prefill-0", prefill_engine.url)])
    await actor.set_endpoints("decode", [("decode-0", decode_engine.url, ("tcp://127.0.0.1:5700",))])
    side_channel = actor.pools.of(None).engine("decode-0").kv_endpoints

    async with httpx.AsyncClient(base_url=info["url"]) as client:
        served = await client.post("/v1/chat/completions", json=CHAT)
        await actor.set_endpoints("decode", [])
        emptied = await client.post("/v1/chat/completions", json=CHAT)

    assert info["state"] == "ready"
    assert side_channel == ("tcp://127.0.0.1:5700",)
    assert served.status_code == 200
    assert served.json()["choices"][0]["message"]["content"] == answer_text("decode-0", with_kv=True)
    assert emptied.status_code == 200  # a prefill engine serves it whole (proxy.degrade)
    assert emptied.headers["x-pdserve-path"] == "prefill-only; reason=no-decode-engine"
    assert (await actor.info())["pool"]["decode"] == []


async def test_an_engine_taken_back_from_draining_gets_requests_again(actor, prefill_engine, decode_engine):
    info = await actor.start()
    await actor.set_endpoints("decode", [("decode-0", decode_engine.url)])
    both = [("prefill-0", prefill_engine.url), ("prefill-1", prefill_engine.url)]
    await actor.set_endpoints("prefill", both, draining=["prefill-1"])

    async with httpx.AsyncClient(base_url=info["url"]) as client:

        async def prefilled_by() -> set[str]:
            answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
            return {answer.headers["x-pdserve-prefill"] for answer in answers}

        draining = await prefilled_by()
        await actor.set_endpoints("prefill", both)  # the controller took prefill-1 back
        back = await prefilled_by()

    assert draining == {"prefill-0"}
    assert back == {"prefill-0", "prefill-1"}
    assert not actor.pools.of(None).engine("prefill-1").draining


async def test_a_taken_port_fails_the_start(actor):
    taken = listen_socket("127.0.0.1", actor.port)
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match="could not listen"):
            await actor.start()
    finally:
        taken.close()
    assert actor.state == "failed"


# --- least privilege: the engine key, never the cluster secret ------------------------------------------


async def test_the_actor_holds_the_engine_key_and_never_the_cluster_secret(
    actor_process, tmp_path, prefill_engine, decode_engine
):
    assert os.environ[SECRET_ENV] == TEST_SECRET.reveal()  # the process had it (Ray's environment, say)
    actor = ProxyActor(
        ProxyConfig(model_name="m", request_timeout_s=5.0, engine_auth=True),
        "127.0.0.1",
        free_port(),
        str(tmp_path / "proxy.log"),
        EngineKey.of(TEST_SECRET),
    )
    try:
        info = await actor.start()
        await actor.set_endpoints("prefill", [("prefill-0", prefill_engine.url)])
        await actor.set_endpoints("decode", [("decode-0", decode_engine.url)])
        async with httpx.AsyncClient(base_url=info["url"]) as client:
            served = await client.post("/v1/chat/completions", json=CHAT)
    finally:
        await actor.stop()

    assert SECRET_ENV not in os.environ and SECRET_FILE_ENV not in os.environ
    assert os.environ[PROXY_ENGINE_KEY_ENV] == engine_key(TEST_SECRET)
    assert served.status_code == 200
    for engine in (prefill_engine, decode_engine):  # the engines still get their key
        assert engine.requests[0].headers["authorization"] == f"Bearer {engine_key(TEST_SECRET)}"


def test_the_engine_key_never_shows_itself():
    key = EngineKey.of(TEST_SECRET)
    assert repr(key) == str(key) == f"{[key]}"[1:-1] == "EngineKey(****)"
    assert key.reveal() not in repr(SimpleNamespace(key=key))
    assert key == EngineKey(engine_key(TEST_SECRET)) and key != EngineKey.of(ClusterSecret("another-secret-0123456789"))


async def test_the_controller_hands_the_proxy_actor_the_engine_key_alone(monkeypatch, tmp_path):
    """What ``ray.remote(ProxyActor)...remote(*args)`` is given crosses to the proxy's process: no secret."""
    given: list[tuple[Any, ...]] = []

    class ProxyClass:
        def options(self, **options: Any) -> ProxyClass:
            return self

        def remote(self, *args: Any) -> Any:
            given.append(args)

            async def started() -> dict[str, str]:
                return {"url": "http://127.0.0.1:8000"}

            return SimpleNamespace(start=SimpleNamespace(remote=started))

    monkeypatch.setattr(engine_handles.ray, "remote", lambda cls: ProxyClass())
    spec = ClusterSpec.model_validate(spec_dict())
    link = ProxyLink(
        [Pools(spec, {}, tmp_path, {"prefill": 1, "decode": 1})],
        engine_handles.EngineHandles(spec, TEST_SECRET, tmp_path),
        Events(),
    )
    await link.start()

    [args] = given
    assert not any(type(arg) is ClusterSecret for arg in args)  # an EngineKey, from which no other key derives
    assert TEST_SECRET.reveal() not in repr(args)
    assert args[-1] == EngineKey.of(TEST_SECRET)
    assert link.url == "http://127.0.0.1:8000"
