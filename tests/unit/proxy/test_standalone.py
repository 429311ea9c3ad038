"""``pdserve proxy``: the proxy alone, run as a real process in front of stub engines.

Each test starts ``python -m orchestrator.cli proxy ... --port 0`` as a
subprocess, reads the URL it prints once it listens, and talks to it over HTTP
(with the OpenAI client, as a user would) while the stub engines run in the
test's event loop. The pure pieces of ``proxy.standalone`` are tested at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import httpx
import openai
import psutil
import pytest

from contract.auth import SECRET_ENV, engine_key
from proxy.config import ProxyConfig
from proxy.server import listen_socket
from proxy.standalone import (
    StandaloneError,
    StandaloneSettings,
    model_name_from_engines,
    normalize_url,
    parse_kv_endpoints,
)
from tests.stub_engine import StubEngine, answer_text
from tests.unit.conftest import REPO_ROOT, TEST_SECRET, SideChannel
from tests.unit.proxy_requests import wait_until

pytestmark = pytest.mark.timeout(60)

START_TIMEOUT_S = 30.0
MESSAGES = [{"role": "user", "content": "Say hello."}]


class CliProxy:
    """A running ``pdserve proxy`` process."""

    def __init__(self, process: asyncio.subprocess.Process, url: str, banner: list[str]) -> None:
        self.process, self.url, self.banner = process, url, banner

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=10)

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 15)


async def run_cli(*args: str) -> asyncio.subprocess.Process:
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator.cli", "proxy", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=REPO_ROOT,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def cli_proxy(*args: str) -> AsyncIterator[CliProxy]:
    """``pdserve proxy *args --port 0``, until it says where it listens; stopped (SIGTERM) afterwards."""
    process = await run_cli(*args, "--port", "0")
    banner: list[str] = []
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    stderr = (await process.stderr.read()).decode()
                    raise AssertionError(f"pdserve proxy exited ({await process.wait()}): {stderr}")
                banner.append(line.rstrip("\n"))
                if match := re.search(r"on (http://\S+)/v1 ", line):
                    break
        for _ in range(2):  # the prefill and decode lines
            banner.append((await process.stdout.readline()).decode().rstrip("\n"))
        proxy = CliProxy(process, match[1], banner)
        yield proxy
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.communicate(), 15)  # also drains and closes its pipes
        except TimeoutError:
            process.kill()
            await process.communicate()


def urls(*engines: StubEngine) -> list[str]:
    return [engine.url for engine in engines]


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a process that ended but was not reaped counts as gone)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


# --- serving ----------------------------------------------------------------------------


async def test_serves_chat_completions_with_the_model_learnt_from_the_engines(prefill_engine, decode_engine):
    async with cli_proxy("--prefill", prefill_engine.url, "--decode", decode_engine.url) as proxy:
        assert proxy.banner[0].startswith("pdserve proxy: serving 'stub-model' on http://127.0.0.1:")
        async with proxy.openai() as client:
            models = await client.models.list()
            completion = await client.chat.completions.create(model="stub-model", messages=MESSAGES, max_tokens=20)

    assert [model.id for model in models.data] == ["stub-model"]
    assert completion.choices[0].message.content == answer_text("decode-0", with_kv=True)
    (prefill,) = prefill_engine.requests
    assert prefill.body["max_tokens"] == 1 and prefill.body["kv_transfer_params"]["do_remote_decode"] is True
    (decode,) = decode_engine.requests
    assert decode.body["max_tokens"] == 20
    assert decode.body["kv_transfer_params"] == prefill.answered_kv_transfer_params


async def test_streams_chat_completions(prefill_engine, decode_engine):
    async with cli_proxy("--prefill", prefill_engine.url, "--decode", decode_engine.url) as proxy:
        async with proxy.openai() as client:
            stream = await client.chat.completions.create(model="stub-model", messages=MESSAGES, stream=True)
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]

    assert "".join(pieces) == answer_text("decode-0", with_kv=True)
    assert len(pieces) > 2
    assert decode_engine.requests[0].body["stream"] is True
    assert prefill_engine.requests[0].body["stream"] is False


async def test_completions_and_the_pdserve_headers(prefill_engine, decode_engine):
    async with cli_proxy("--prefill", prefill_engine.url, "--decode", decode_engine.url) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            response = await client.post(
                "/v1/completions", json={"model": "stub-model", "prompt": "Say hello."}, headers={"X-Request-Id": "q-1"}
            )

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == answer_text("decode-0", with_kv=True)
    assert response.headers["x-request-id"] == "q-1"
    assert (response.headers["x-pdserve-prefill"], response.headers["x-pdserve-decode"]) == ("prefill-0", "decode-0")


async def test_round_robin_over_the_engines_named_on_the_command_line(make_engine):
    prefill = [await make_engine(f"p{i}") for i in range(2)]
    decode = [await make_engine(f"d{i}") for i in range(2)]
    args = ["--prefill", *urls(*prefill), "--decode", *urls(*decode), "--model", "m"]
    async with cli_proxy(*args) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            responses = [
                await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}) for _ in range(4)
            ]

    assert [r.headers["x-pdserve-prefill"] for r in responses] == ["prefill-0", "prefill-1"] * 2
    assert [r.headers["x-pdserve-decode"] for r in responses] == ["decode-0", "decode-1"] * 2
    assert [r.json()["choices"][0]["message"]["content"] for r in responses[:2]] == [
        answer_text("d0", with_kv=True),
        answer_text("d1", with_kv=True),
    ]
    assert all(len(engine.requests) == 2 for engine in prefill + decode)


async def test_several_workers_share_the_port_and_stop_together(prefill_engine, decode_engine):
    args = ["--prefill", prefill_engine.url, "--decode", decode_engine.url, "--model", "m", "--workers", "2"]
    async with cli_proxy(*args) as proxy:
        assert "(2 worker(s))" in proxy.banner[0]
        children = psutil.Process(proxy.process.pid).children(recursive=True)
        workers = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection each time: both workers get some
        async with httpx.AsyncClient(base_url=proxy.url, limits=limits) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}) for _ in range(24))
            )
        status = await proxy.stop()

    assert [r.status_code for r in responses] == [200] * 24
    assert len(decode_engine.requests) == 24
    served_by = {r.peer for r in decode_engine.requests}
    assert len(served_by) >= 2  # each worker keeps its own connections to the engine
    assert status == 0
    assert len(workers) == 2
    await wait_until(lambda: not [p for p in children if alive(p)], 10)


async def test_a_worker_that_dies_is_replaced(prefill_engine, decode_engine):
    args = ["--prefill", prefill_engine.url, "--decode", decode_engine.url, "--model", "m", "--workers", "2"]
    async with cli_proxy(*args) as proxy:
        parent = psutil.Process(proxy.process.pid)

        def workers() -> list[psutil.Process]:
            found = []
            for child in parent.children():
                with contextlib.suppress(psutil.NoSuchProcess):  # the killed worker may vanish while we look
                    if child.is_running() and "spawn_main" in " ".join(child.cmdline()):
                        found.append(child)
            return found

        victim = workers()[0]
        victim.kill()
        async with asyncio.timeout(START_TIMEOUT_S):
            while victim.pid in [p.pid for p in workers()] or len(workers()) < 2:
                await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=proxy.url, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            responses = [
                await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}) for _ in range(6)
            ]

    assert [r.status_code for r in responses] == [200] * 6


async def test_sigterm_stops_it_cleanly(prefill_engine, decode_engine):
    async with cli_proxy("--prefill", prefill_engine.url, "--decode", decode_engine.url, "--model", "m") as proxy:
        status = await proxy.stop()

    assert status == 0


async def test_model_flag_needs_no_engine_to_start(unused_url):
    async with cli_proxy("--prefill", unused_url, "--decode", unused_url, "--model", "named") as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            models = await client.get("/v1/models")
            response = await client.post("/v1/chat/completions", json={"model": "named", "messages": MESSAGES})

    assert [model["id"] for model in models.json()["data"]] == ["named"]
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "engine_failed"


async def test_an_api_key_from_the_environment_guards_the_proxy(unused_url, monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_KEY", "sk-cli")
    args = ("--prefill", unused_url, "--decode", unused_url, "--model", "m", "--api-key-env", "PDSERVE_TEST_KEY")
    async with cli_proxy(*args, "--max-body-bytes", "2048") as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            refused = await client.get("/v1/models")
            allowed = await client.get("/v1/models", headers={"Authorization": "Bearer sk-cli"})
            too_large = await client.post(
                "/v1/completions", json={"model": "m", "prompt": "x" * 4096}, headers={"Authorization": "Bearer sk-cli"}
            )

    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert allowed.status_code == 200
    assert too_large.status_code == 413


async def test_the_engine_key_file_alone_lets_it_call_engines(prefill_engine, decode_engine, monkeypatch, tmp_path):
    """Least privilege by hand: `pdserve secret S --engine-key-file K`, then the proxy holds K, not S."""
    monkeypatch.delenv(SECRET_ENV)
    (tmp_path / "engine.key").write_text(engine_key(TEST_SECRET) + "\n")
    args = ("--prefill", prefill_engine.url, "--decode", decode_engine.url)
    async with cli_proxy(*args, "--engine-key-file", str(tmp_path / "engine.key")) as proxy:
        async with proxy.openai() as client:
            await client.chat.completions.create(model="stub-model", messages=MESSAGES, max_tokens=5)

    for engine in (prefill_engine, decode_engine):  # /v1/models (the model's name) and the request's leg
        assert {r.headers["authorization"] for r in engine.requests} == {f"Bearer {engine_key(TEST_SECRET)}"}


async def test_an_api_key_variable_that_is_not_set_is_an_error(unused_url):
    args = ("--prefill", unused_url, "--decode", unused_url, "--model", "m", "--api-key-env", "PDSERVE_UNSET_KEY")
    process = await run_cli(*args, "--port", "0")
    out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)

    assert process.returncode == 1
    assert "PDSERVE_UNSET_KEY" in err.decode() and "not set" in err.decode()


async def test_an_admin_engine_network_that_is_not_one_is_an_error(unused_url):
    args = ("--prefill", unused_url, "--decode", unused_url, "--model", "m", "--admin-engine-networks", "10.0.0.0/8")
    process = await run_cli(*args, "--admin-engine-networks", "ten-dot-something", "--port", "0")
    out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)

    assert process.returncode == 1
    assert "admin_engine_networks: 'ten-dot-something' is not a network" in err.decode()


async def test_engines_serving_different_models_is_an_error(make_engine):
    prefill = await make_engine("prefill-0", model_name="llama")
    decode = await make_engine("decode-0", model_name="qwen")
    process = await run_cli("--prefill", prefill.url, "--decode", decode.url, "--port", "0")
    out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)

    assert process.returncode == 1
    assert "different models" in err.decode()
    assert f"{prefill.url} serves 'llama'" in err.decode() and f"{decode.url} serves 'qwen'" in err.decode()


async def test_an_engine_that_never_answers_is_an_error_after_the_wait(prefill_engine, unused_url):
    process = await run_cli("--prefill", prefill_engine.url, "--decode", unused_url, "--wait-s", "0.5")
    out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)

    assert process.returncode == 1
    assert f"waiting up to 0.5s for {unused_url}" in out.decode()
    assert "no model name from 1 engine(s)" in err.decode() and "--model" in err.decode()
    assert unused_url in err.decode()


async def test_a_port_in_use_is_an_error(prefill_engine, decode_engine):
    taken = listen_socket("127.0.0.1", 0)
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        args = ["--prefill", prefill_engine.url, "--decode", decode_engine.url, "--model", "m", "--port", port]
        process = await run_cli(*args)
        out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT_S)
    finally:
        taken.close()

    assert process.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err.decode()


def test_prefill_and_decode_are_required(capsys):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as info:
        main(["proxy", "--decode", "http://127.0.0.1:8200"])

    assert info.value.code == 2
    assert "--prefill" in capsys.readouterr().err


def test_routing_flags():
    from orchestrator.cli import build_parser
    from orchestrator.cli.proxy import proxy_settings

    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]
        + ["--routing-prefill", "prefix_aware", "--routing-decode", "least_loaded", "--decode-only-below-tokens", "64"]
        + ["--decode-only-if-cached", "--prefill-retries", "2", "--health-interval-s", "0", "--unhealthy-after", "4"]
        + ["--decode-retries", "0", "--no-degrade"]
    )
    settings = proxy_settings(args)

    assert (settings.routing.prefill, settings.routing.decode) == ("prefix_aware", "least_loaded")
    assert (settings.decode_only_below_tokens, settings.decode_only_if_cached, settings.prefill_retries) == (
        64,
        True,
        2,
    )
    assert (settings.health_interval_s, settings.unhealthy_after, settings.healthy_after) == (0.0, 4, 2)
    assert settings.decode_retries == 0 and settings.degrade is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--routing-prefill", "random"], "invalid choice: 'random'"),
        (
            ["--decode-only-below-tokens", "-1"],
            "--decode-only-below-tokens: Input should be greater than or equal to 0",
        ),
        (["--unhealthy-after", "0"], "--unhealthy-after: Input should be greater than or equal to 1 (got '0')"),
        (["--max-body-bytes", "lots"], "--max-body-bytes: Input should be a valid integer"),
    ],
)
def test_bad_routing_flags_exit_2(capsys, flags, message):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as info:
        main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", *flags])

    assert info.value.code == 2
    assert message in capsys.readouterr().err


async def test_decode_only_below_tokens_on_the_command_line(prefill_engine, decode_engine):
    flags = ("--decode-only-below-tokens", "100", "--model", "stub-model")
    async with cli_proxy("--prefill", prefill_engine.url, "--decode", decode_engine.url, *flags) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            response = await client.post("/v1/completions", json={"model": "stub-model", "prompt": "Hi"})

    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-path"] == "decode-only; reason=short-prompt"
    assert prefill_engine.requests == [] and len(decode_engine.requests) == 1


def test_workers_must_be_positive(capsys):
    from orchestrator.cli import main

    with pytest.raises(SystemExit) as info:
        main(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--workers", "0"])

    assert info.value.code == 2
    assert "--workers: must be at least 1, got 0" in capsys.readouterr().err


@pytest.fixture
def unused_url() -> str:
    """A URL on which nothing listens."""
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


# --- proxy.standalone ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8100", "http://127.0.0.1:8100"),
        ("http://127.0.0.1:8100/", "http://127.0.0.1:8100"),
        ("http://127.0.0.1:8100/v1", "http://127.0.0.1:8100"),
        ("127.0.0.1:8100", "http://127.0.0.1:8100"),
        ("https://engine.example:443/", "https://engine.example:443"),
    ],
)
def test_normalize_url(given, expected):
    assert normalize_url(given) == expected


def test_normalize_url_refuses_other_schemes():
    with pytest.raises(StandaloneError, match="only http"):
        normalize_url("grpc://127.0.0.1:8100")


def test_settings_name_the_engines_by_role_and_position():
    settings = StandaloneSettings(("http://p:1", "http://p:2"), ("http://d:1",), ProxyConfig(model_name="m"))

    snapshot = settings.pool().snapshot()
    assert {role: [(e["engine_id"], e["url"]) for e in engines] for role, engines in snapshot.items()} == {
        "prefill": [("prefill-0", "http://p:1"), ("prefill-1", "http://p:2")],
        "decode": [("decode-0", "http://d:1")],
    }


def test_decode_kv_gives_each_decode_server_its_side_channel():
    kv = parse_kv_endpoints(["tcp://d:5700,tcp://d:5701", "tcp://e:5700"], 2)
    settings = StandaloneSettings(("http://p:1",), ("http://d:1", "http://e:1"), ProxyConfig(model_name="m"), kv)

    decode = settings.pool().snapshot()["decode"]
    assert [(e["engine_id"], e["kv_endpoints"]) for e in decode] == [
        ("decode-0", ["tcp://d:5700", "tcp://d:5701"]),
        ("decode-1", ["tcp://e:5700"]),
    ]
    assert parse_kv_endpoints([], 2) == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["tcp://d:5700"], "1 value(s) for 2 --decode server(s)"),
        (["tcp://d:5700", "http://e:8200"], "'http://e:8200' is not tcp://host:port"),
        (["tcp://d:5700", "tcp://e"], "'tcp://e' is not tcp://host:port"),
    ],
)
def test_decode_kv_that_does_not_fit_is_an_error(values, message):
    with pytest.raises(StandaloneError, match=re.escape(message)):
        parse_kv_endpoints(values, 2)


async def test_a_stream_through_the_command_line_proxy_carries_the_decode_servers_report(prefill_engine, decode_engine):
    ranks = [SideChannel(answer=b'{"source": "transfer", "bytes": 512, "transfer_ms": 1.5}') for _ in range(2)]
    prefill_engine.release_endpoint = "tcp://127.0.0.1:9"  # offers the report message, as ours does
    kv = ",".join(rank.endpoint for rank in ranks)
    args = ("--prefill", prefill_engine.url, "--decode", decode_engine.url, "--decode-kv", kv)
    try:
        async with cli_proxy(*args) as proxy, httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            body = {"model": "stub-model", "messages": MESSAGES, "stream": True}
            response = await client.post("/v1/chat/completions", json=body)
    finally:
        for rank in ranks:
            await rank.close()

    assert response.status_code == 200
    assert response.headers["x-pdserve-kv"] == "source=transfer; bytes=1024; transfer_ms=1.5"


async def test_model_name_waits_for_an_engine_that_is_starting(make_engine):
    ready = await make_engine("prefill-0", model_name="smol")
    starting = await make_engine("decode-0", model_name="smol")
    await starting.stop()
    waited: list[list[str]] = []

    lookup = asyncio.create_task(
        asyncio.to_thread(model_name_from_engines, [ready.url, starting.url], 10.0, waited.append)
    )
    await wait_until(lambda: waited, 10)  # it found the engine down and waits for it
    await starting.start()

    assert await lookup == ("smol",)
    assert waited == [[starting.url]]


async def test_the_adapters_the_engines_serve_are_served_too(make_engine):
    engines = [await make_engine(name, model_name="smol", adapters=("pirate",)) for name in ("prefill-0", "decode-0")]
    assert await asyncio.to_thread(model_name_from_engines, [e.url for e in engines], 1.0) == ("smol", "pirate")


async def test_model_name_from_an_engine_that_answers_500_is_an_error(make_engine):
    failing = await make_engine("prefill-0")
    failing.behaviour = failing.behaviour.ERROR_500

    with pytest.raises(StandaloneError, match="HTTP 500"):
        await asyncio.to_thread(model_name_from_engines, [failing.url], 0.0)


def test_tune_gc_raises_the_threshold_and_freezes_what_exists():
    import gc

    from proxy.server import GC_THRESHOLD, tune_gc

    threshold = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold()[0] == GC_THRESHOLD
        assert gc.get_threshold()[1:] == threshold[1:]
        assert gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
