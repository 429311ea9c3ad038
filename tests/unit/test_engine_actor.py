"""Helpers of the engine actor: core parsing, pinning, listening socket, error excerpts, its HTTP server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import uvicorn

from orchestrator.engine_actor import (
    _health_first,
    _once_a_second,
    error_excerpt,
    listen_socket,
    parse_cores,
    pin_process_tree,
)


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


class _Engine:
    def __init__(self, dead: bool = False) -> None:
        self.dead = dead

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.dead:
            raise EngineDeadError()


async def _vllm_app(scope: dict, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 418, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm"})


@pytest.mark.parametrize(("dead", "status"), [(False, 200), (True, 503)])
def test_health_is_answered_before_vllms_app_as_vllm_answers_it(dead: bool, status: int) -> None:
    async def ask() -> list[int]:
        transport = httpx.ASGITransport(app=_health_first(_vllm_app, _Engine(dead)))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return [(await client.request(method, path)).status_code for method, path in
                    [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/health")]]  # fmt: skip

    assert asyncio.run(ask()) == [status, 418, 418]


def test_the_engines_http_server_ticks_once_a_second_and_exits_at_once() -> None:
    async def run() -> tuple[int, float, httpx.Response]:
        sock = listen_socket("127.0.0.1", 0)
        server = _once_a_second(uvicorn.Server)(uvicorn.Config(_vllm_app, log_level="warning", lifespan="off"))
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
