"""Shared fixtures for the pure unit tests: no Ray, no vLLM, no network.

Every test runs against a private model cache (``PDSERVE_MODEL_CACHE``) in which
the demo model is "prepared" as an empty directory, and on a machine that reports
8 CPU cores, so results never depend on the developer's ~/.cache or core count.

The proxy's fixtures (at the end) serve the proxy and stub engines on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from contract.auth import SECRET_ENV, SECRET_FILE_ENV, ClusterSecret
from contract.framing import MAX_FRAME_BYTES, FramingError, frame, read_frame
from orchestrator.models import DEMO_MODEL_NAME, KNOWN_MODELS
from proxy.app import create_app
from proxy.pool import Endpoint, EnginePool
from proxy.server import uvicorn_config
from tests.stub_engine import StubEngine
from tests.unit.proxy_factories import proxy_config

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL_CPU_SPEC = REPO_ROOT / "configs" / "local-cpu.yaml"
MACHINE_CPUS = 8

# The smallest valid spec; tests override only what they are about.
BASE_SPEC: dict[str, Any] = {
    "model": DEMO_MODEL_NAME,
    "prefill": {"port": 8100, "kv_port": 5600},
    "decode": {"port": 8200, "kv_port": 5700},
}


def spec_dict(**overrides: Any) -> dict[str, Any]:
    """``BASE_SPEC`` with ``overrides`` merged in; mappings merge key by key.

    ``spec_dict(prefill={"replicas": 2})`` keeps prefill's ports and adds replicas.
    """
    return _merge(copy.deepcopy(BASE_SPEC), overrides)


def _merge(into: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache in which the demo model is prepared."""
    cache = tmp_path / "model-cache"
    (cache / KNOWN_MODELS[DEMO_MODEL_NAME].dir_name).mkdir(parents=True)
    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(cache))
    return cache


TEST_SECRET = ClusterSecret("the-unit-tests-cluster-secret-0123456789")
"""The cluster secret every unit test's process holds (connectors read it from the environment)."""


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch: pytest.MonkeyPatch) -> ClusterSecret:
    monkeypatch.setenv(SECRET_ENV, TEST_SECRET.reveal())
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    return TEST_SECRET


@pytest.fixture(autouse=True)
def machine_cpus(monkeypatch: pytest.MonkeyPatch) -> int:
    """The CPU count the spec falls back on when resources.cpus is not set."""
    monkeypatch.setattr(os, "cpu_count", lambda: MACHINE_CPUS)
    return MACHINE_CPUS


@pytest.fixture
def make_spec() -> Callable[..., dict[str, Any]]:
    """Factory for spec dicts: ``make_spec(prefill={"replicas": 2})`` (see ``spec_dict``)."""
    return spec_dict


@pytest.fixture
def local_cpu_spec() -> Path:
    """The demo spec shipped in configs/."""
    return LOCAL_CPU_SPEC


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """Write a spec file: a dict is dumped as YAML, a str is written verbatim."""

    def write(content: dict[str, Any] | str, name: str = "cluster.yaml") -> Path:
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
        return path

    return write


# --- The proxy (proxy.app) against stub engines (tests/stub_engine.py) ------------------
#
# ``prefill_engine`` / ``decode_engine``: stub vLLM engines on ephemeral ports.
# ``pool``: an EnginePool whose prefill and decode endpoints are those stubs.
# ``proxy``: the app of ``create_app(proxy_config(request_timeout_s=PROXY_TIMEOUT_S), pool)`` served
# for real by uvicorn in the test's event loop (so its lifespan runs).
# ``client``: an httpx.AsyncClient on the proxy. ``make_engine`` / ``make_proxy``: more
# stubs, or a proxy configured otherwise (routing settings as keywords).

PROXY_MODEL = "m"
PROXY_TIMEOUT_S = 0.5
"""The proxy's request_timeout_s: short, so that hanging engines fail tests fast."""


class _InLoopServer(uvicorn.Server):
    """uvicorn for tests: no signal handlers (pytest owns them), no 0.1 s polling loop, and a quick shutdown.

    uvicorn's own ``main_loop`` polls ``should_exit`` every 0.1 s and its ``shutdown``
    always sleeps 0.1 s: a fifth of a second per test. This one waits on an event, and
    shuts down as uvicorn does (stop listening, close idle connections, let running ones
    finish, then the app's lifespan shutdown) without the fixed sleeps. It leans on
    uvicorn's internals (``main_loop``, ``servers``, ``server_state``, ``lifespan``) for
    that: test_proxy, test_disconnect and test_proxy_kv (159 tests) took 16-17 s with it
    and 41-44 s on a plain ``uvicorn.Server``, in one session. The proxy itself keeps
    uvicorn's own loop and shutdown (``proxy.server``), which test_standalone and
    test_proxy_actor run.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_requested = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        await self.on_tick(0)  # sets the default response headers (Date, Server)
        await self.exit_requested.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        deadline = time.monotonic() + self.config.timeout_graceful_shutdown
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        for task in list(self.server_state.tasks):
            task.cancel()
        await self.lifespan.shutdown()


class ProxyServer:
    """An ASGI app served by uvicorn on 127.0.0.1 and an ephemeral port, in the running event loop."""

    def __init__(self, app: Any, **uvicorn_overrides: Any) -> None:
        """``uvicorn_overrides``: settings other than the proxy's own (``proxy.server.uvicorn_config``)."""
        self.app = app
        self.uvicorn_overrides = uvicorn_overrides
        self.url = ""
        self._server: _InLoopServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> ProxyServer:
        # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is TCP;
        # with Nagle on, every keep-alive request waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # The settings the proxy runs with (uvloop aside: pytest-asyncio owns the loop).
        config = uvicorn_config(self.app, log_config=None, timeout_graceful_shutdown=1, **self.uvicorn_overrides)
        self._server = _InLoopServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # startup failed (uvicorn exits): raise its error
                self._task.result()
                raise RuntimeError("uvicorn exited during startup")
            await asyncio.sleep(0.001)
        return self

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        self._server.exit_requested.set()
        await self._task


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[StubEngine]]]:
    """Factory of started stub engines, all stopped after the test: ``await make_engine("decode-1")``."""
    engines: list[StubEngine] = []

    async def make(name: str, **options: Any) -> StubEngine:
        engine = StubEngine(name, **options)
        engines.append(engine)
        return await engine.start()

    yield make
    for engine in engines:
        await engine.stop()


@pytest.fixture
async def prefill_engine(make_engine) -> StubEngine:
    return await make_engine("prefill-0")


@pytest.fixture
async def decode_engine(make_engine) -> StubEngine:
    return await make_engine("decode-0")


def endpoint(engine: StubEngine) -> Endpoint:
    return Endpoint(engine.name, engine.url)


@pytest.fixture
def pool(prefill_engine: StubEngine, decode_engine: StubEngine) -> EnginePool:
    pool = EnginePool()
    pool.set_endpoints("prefill", [endpoint(prefill_engine)])
    pool.set_endpoints("decode", [endpoint(decode_engine)])
    return pool


@pytest.fixture
async def make_proxy(pool: EnginePool) -> AsyncIterator[Callable[..., Awaitable[ProxyServer]]]:
    """Factory of served proxies on ``pool``, stopped after the test: ``await make_proxy(request_timeout_s=10)``.

    Further keyword arguments are ``ProxyConfig`` settings: ``await make_proxy(max_body_bytes=100)``.
    """
    servers: list[ProxyServer] = []

    async def make(
        request_timeout_s: float = PROXY_TIMEOUT_S, model_name: str = PROXY_MODEL, **settings: Any
    ) -> ProxyServer:
        """``settings``: as ``proxy_config`` takes them, e.g. ``prefill_policy="least_loaded"``."""
        config = proxy_config(model_name, request_timeout_s=request_timeout_s, **settings)
        servers.append(ProxyServer(create_app(config, pool)))
        return await servers[-1].start()

    yield make
    for server in reversed(servers):
        await server.stop()


@pytest.fixture
async def proxy(make_proxy) -> ProxyServer:
    return await make_proxy()


@pytest.fixture
async def client(proxy: ProxyServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
        yield client


@pytest.fixture
async def make_client(make_proxy) -> AsyncIterator[Callable[..., Awaitable[httpx.AsyncClient]]]:
    """Factory of clients, each on a proxy of its own: ``await make_client(max_body_bytes=100)``.

    Keyword arguments go to ``make_proxy``; ``headers=`` are sent with every request.
    """
    clients: list[httpx.AsyncClient] = []

    async def make(headers: dict[str, str] | None = None, **settings: Any) -> httpx.AsyncClient:
        proxy = await make_proxy(**settings)
        clients.append(httpx.AsyncClient(base_url=proxy.url, timeout=10, headers=headers))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()


class SideChannel:
    """An engine's KV side channel (a real TCP server speaking ``contract.framing``): keeps every message
    and answers ``answer`` (a prefill's release: OK); with ``answer=None`` it never answers."""

    def __init__(self, answer: bytes | None = b"OK") -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()  # connections wait in the backlog until the server below takes them
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.answer = answer
        self.messages: list[bytes] = []
        self._connections: set[asyncio.Task] = set()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._listener)
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            while True:
                self.messages.append(await read_frame(reader, MAX_FRAME_BYTES))
                if self.answer is None:
                    await asyncio.Event().wait()
                writer.write(frame(self.answer))
                await writer.drain()
        except (FramingError, OSError):
            pass  # the client closed its connection
        finally:
            self._connections.discard(task)
            writer.close()

    async def close(self) -> None:
        tasks = [self.task, *self._connections]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()


@pytest.fixture
async def side_channel(prefill_engine: StubEngine) -> AsyncIterator[SideChannel]:
    channel = SideChannel()
    prefill_engine.release_endpoint = channel.endpoint
    yield channel
    await channel.close()


@pytest.fixture
async def report_ranks(
    pool: EnginePool, side_channel: SideChannel, decode_engine: StubEngine
) -> AsyncIterator[list[SideChannel]]:
    """The decode engine's side channel, two TP ranks (answering ``NONE`` until a test says otherwise),
    given to the pool as the engine's ``kv_endpoints``; the prefill engine offers a report message."""
    ranks = [SideChannel(answer=b"NONE") for _ in range(2)]
    pool.set_endpoints("decode", [Endpoint(decode_engine.name, decode_engine.url, tuple(r.endpoint for r in ranks))])
    yield ranks
    for rank in ranks:
        await rank.close()


async def released(channel: SideChannel, timeout_s: float = 3.0, quiet_s: float = 0.3) -> list[str]:
    """The messages ``channel`` received: the first within ``timeout_s``, and all that came in the ``quiet_s``
    after it (where a second release of one request's KV would be)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not channel.messages and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(quiet_s)
    return [m.decode() for m in channel.messages]
