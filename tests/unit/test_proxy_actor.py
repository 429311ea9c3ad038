"""``orchestrator.proxy_actor.ProxyActor`` without Ray: the class the controller wraps in ``ray.remote``.

Its server runs in the test's event loop, as in the actor's; ``set_endpoints``
is what the controller calls as engines come and go.
"""

from __future__ import annotations

import httpx
import pytest

from orchestrator import proxy_actor
from orchestrator.proxy_actor import ProxyActor
from proxy.app import ProxyConfig
from proxy.server import listen_socket
from tests.stub_engine import answer_text

pytestmark = pytest.mark.timeout(20)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}


@pytest.fixture
async def actor(monkeypatch, tmp_path):
    monkeypatch.setattr(proxy_actor, "redirect_output", lambda path: None)  # keep pytest's stdout
    monkeypatch.setattr(proxy_actor, "tune_gc", lambda: None)  # pytest's process keeps its collector as it is
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    actor = ProxyActor(ProxyConfig("m", 5.0), "127.0.0.1", port, str(tmp_path / "proxy.log"))
    yield actor
    await actor.stop()


async def test_serves_the_engines_the_controller_sets(actor, prefill_engine, decode_engine):
    info = await actor.start()
    await actor.set_endpoints("prefill", [("prefill-0", prefill_engine.url)])
    await actor.set_endpoints("decode", [("decode-0", decode_engine.url, ("tcp://127.0.0.1:5700",))])
    side_channel = actor.pool.engine("decode-0").kv_endpoints

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
    assert not actor.pool.engine("prefill-1").draining


async def test_a_taken_port_fails_the_start(actor):
    taken = listen_socket("127.0.0.1", actor.port)
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match="could not listen"):
            await actor.start()
    finally:
        taken.close()
    assert actor.state == "failed"
