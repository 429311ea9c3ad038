"""Helpers of the engine actor: core parsing, pinning, listening socket, error excerpts, its HTTP server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from orchestrator.engine_guard import OPEN_PATHS, guard
from orchestrator.engine_log import error_excerpt
from orchestrator.engine_processes import parse_cores, pin_process_tree
from orchestrator.engine_server import listen_socket, once_a_second


@pytest.mark.parametrize(
    ("bind", "cores"), [("0", {0}), ("0-1", {0, 1}), ("0|1", {0, 1}), ("0-1|4-5", {0, 1, 4, 5}), ("2,4", {2, 4})]
)
def test_parse_cores(bind: str, cores: set[int]) -> None:
    assert parse_cores(bind) == cores


def test_pin_process_tree_confines_children_threads() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        core = min(os.sched_getaffinity(0))
        assert pin_process_tree(child.pid, {core}) >= 1
        assert os.sched_getaffinity(child.pid) == {core}
    finally:
        child.kill()
        child.wait()


def test_listen_socket_is_tcp_so_asyncio_disables_nagle() -> None:
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_listen_socket_on_a_taken_port_fails_at_once() -> None:
    taken = listen_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


def test_error_excerpt_keeps_vllms_error_lines_and_drops_info_noise() -> None:
    log = "\n".join(
        [
            "INFO 11-22 loading model",
            "2026-11-22 INFO vllm.triton_utils: Triton disabled to prevent runtime errors.",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "ValueError: User-specified max_model_len (100000) is greater than the derived max_model_len",
        ]
    )
    excerpt = error_excerpt(log, RuntimeError("Engine core initialization failed"))
    assert excerpt.splitlines() == [
        "ValueError: User-specified max_model_len (100000) is greater than the derived max_model_len",
        "RuntimeError: Engine core initialization failed",
    ]


def test_error_excerpt_of_an_empty_log_says_so() -> None:
    assert "no error line" in error_excerpt("")


KEY = "k" * 64


async def _vllm_app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})
        return
    await send({"type": "http.response.start", "status": 418, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm"})


def _ask_guarded(healthy: bool, requests: list[tuple[str, str, dict[str, str]]]) -> list[httpx.Response]:
    async def health() -> bool:
        return healthy

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=guard(_vllm_app, KEY, health))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return [await client.request(method, path, headers=headers) for method, path, headers in requests]

    return asyncio.run(ask())


@pytest.mark.parametrize(("healthy", "status"), [(True, 200), (False, 503)])
def test_health_is_answered_before_vllms_app_without_the_key(healthy: bool, status: int) -> None:
    [health, other_method] = _ask_guarded(healthy, [("GET", "/health", {}), ("POST", "/health", {})])
    assert (health.status_code, other_method.status_code) == (status, 418)  # open path: vLLM answers the rest


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/invocations", "/tokenize", "/detokenize", "/scale_elastic_ep", "/a-route-of-vllm-2027",
     "/metrics/extra", "//health", "/health/", "/"],
)  # fmt: skip
@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS", "DELETE"])
def test_every_other_route_needs_the_engine_key(path: str, method: str) -> None:
    wrong = {"Authorization": "Bearer " + "x" * 64}
    basic = {"Authorization": "Basic " + KEY}
    good = {"Authorization": "Bearer " + KEY}
    refused, wrong_key, not_bearer, allowed = _ask_guarded(
        True, [(method, path, {}), (method, path, wrong), (method, path, basic), (method, path, good)]
    )
    for response in (refused, wrong_key, not_bearer):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"  # OpenAI's error format
    assert allowed.status_code == 418


def test_only_the_probes_are_open() -> None:
    assert OPEN_PATHS == {"/health", "/metrics"}
    [metrics] = _ask_guarded(True, [("GET", "/metrics", {})])
    assert metrics.status_code == 418


def test_a_websocket_without_the_key_is_closed_before_vllm_sees_it() -> None:

    async def run(headers: list[tuple[bytes, bytes]]) -> list[dict]:
        sent: list[dict] = []
        messages = [{"type": "websocket.connect"}]

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "websocket.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        async def health() -> bool:
            return True

        scope = {"type": "websocket", "path": "/v1/realtime", "headers": headers}
        await guard(_vllm_app, KEY, health)(scope, receive, send)
        return sent

    events = asyncio.run(run([]))
    assert events == [{"type": "websocket.close", "code": 1008}]
    events = asyncio.run(run([(b"authorization", f"Bearer {KEY}".encode())]))
    assert events[0] == {"type": "websocket.accept"}


def test_the_engines_http_server_ticks_once_a_second_and_exits_at_once() -> None:
    async def run() -> tuple[int, float, httpx.Response]:
        sock = listen_socket("127.0.0.1", 0)
        server = once_a_second(uvicorn.Server)(uvicorn.Config(_vllm_app, log_level="warning", lifespan="off"))
        ticks = 0
        on_tick = server.on_tick

        async def counting(counter: int) -> bool:
            nonlocal ticks
            ticks += 1
            return await on_tick(counter)

        server.on_tick = counting
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as http:
            response = await http.get(f"http://127.0.0.1:{sock.getsockname()[1]}/")
        await asyncio.sleep(1.5)
        started = time.monotonic()
        server.exit()
        await asyncio.wait_for(serving, 5)
        return ticks, time.monotonic() - started, response

    ticks, exit_s, response = asyncio.run(run())
    assert ticks <= 3  # uvicorn's own loop: 15 in that time
    assert exit_s < 0.5
    assert response.status_code == 418 and "date" in response.headers


class _Engine:
    def __init__(self, dead: bool = False) -> None:
        self.dead = dead

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.dead:
            raise EngineDeadError()


def test_an_engine_whose_side_channel_stops_answering_says_so_then_restarts(monkeypatch) -> None:
    """The actor pings its side channels: /health turns 503 at the second missed probe, and the process exits
    (Ray restarts the actor, the controller starts vLLM again) at the fourth; an answer resets the count, and a
    channel that closes the probe's connection unanswered (flooded: its loop turns) counts as no miss."""
    from connectors import side_client
    from orchestrator import engine_actor as module
    from tests.unit.conftest import TEST_SECRET

    answers = iter(["silent", "answered", "silent", "busy", "silent", "silent", "silent", "silent"])
    seen: list[tuple[int, bool]] = []
    actor = module.EngineActor.__new__(module.EngineActor)
    actor.launch = SimpleNamespace(engine_id="prefill-0", kv_endpoints=("tcp://127.0.0.1:1",))
    actor._side_channel_missed = 0
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", TEST_SECRET.reveal())
    monkeypatch.setattr(module, "SIDE_CHANNEL_PROBE_S", 0.0)
    monkeypatch.setattr(side_client, "probe", lambda endpoint, auth, timeout_s: next(answers))

    class Exited(BaseException):
        pass

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(module.os, "_exit", exit_)

    async def watch() -> None:
        engine = _Engine()
        original = module.asyncio.sleep

        async def sleep_and_look(seconds: float) -> None:
            seen.append((actor._side_channel_missed, await actor._healthy(engine)))
            await original(0)

        monkeypatch.setattr(module.asyncio, "sleep", sleep_and_look)
        await actor._watch_side_channel()

    with pytest.raises(Exited):
        asyncio.run(watch())
    # (missed so far, /health) before each probe: a miss, an answer, a miss, a flood (busy), then four misses
    assert seen == [(0, True), (1, True), (0, True), (1, True), (0, True), (1, True), (2, False), (3, False)]
    assert asyncio.run(actor._healthy(_Engine(dead=True))) is False
