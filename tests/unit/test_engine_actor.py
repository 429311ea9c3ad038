"""Pure helpers of the engine actor: core parsing, pinning, listening socket, error excerpts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from orchestrator.engine_actor import error_excerpt, listen_socket, parse_cores, pin_process_tree


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
