"""A plain vLLM server configured as one of a spec's engines, without pdserve's KV connector: the reference
benchmarks measure pdserve against."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from orchestrator.launch import plan_engines
from orchestrator.spec import ClusterSpec


@contextlib.contextmanager
def plain_vllm(config: str, log: Path, settle_s: float, engine_id: str = "prefill-0") -> Iterator[tuple[int, str]]:
    """A plain vLLM server as the spec's ``engine_id`` is configured (model, settings, core, environment),
    without the KV connector, on a free port; yields (its pid, its URL) once it answers /health and has
    idled ``settle_s``."""
    launch = next(e for e in plan_engines(ClusterSpec.from_file(config), "127.0.0.1") if e.engine_id == engine_id)
    args = list(launch.vllm_args)
    kv = args.index("--kv-transfer-config")
    del args[kv : kv + 2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args[args.index("--port") + 1] = str(port)
    env = {**os.environ, **launch.env}
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *args]  # what `vllm serve` runs
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the plain vLLM server exited ({server.returncode}); its log: {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the plain vLLM server did not answer in 600 s; its log: {log}")
            time.sleep(1)
        time.sleep(settle_s)
        yield server.pid, f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)
        server.wait(60)
