"""Cluster life cycle beyond the shared cluster: an engine that cannot start, and Ctrl-C on `pdserve up`."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import PDSERVE, run_pdserve

pytestmark = pytest.mark.integration

SPEC = """
name: {name}
model: smollm2-135m-instruct
proxy: {{port: {base}000}}
prefill: {{port: {base}100, kv_port: {kv}600}}
decode: {{port: {base}200, kv_port: {kv}700}}
engine: {{max_model_len: {max_model_len}}}
"""


def write_spec(tmp_path: Path, name: str, base: int, max_model_len: int) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(SPEC.format(name=name, base=base, kv=base - 3, max_model_len=max_model_len))
    return path


def processes_mentioning(text: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if text in json.dumps(p.info["cmdline"] or [])]


def test_up_fails_with_the_engines_own_error(tmp_path: Path, pdserve_env: dict[str, str]) -> None:
    # vLLM refuses a context longer than the model's (8192 for SmolLM2-135M).
    config = write_spec(tmp_path, "pdserve-broken", base=19, max_model_len=100000)
    env = dict(pdserve_env, PDSERVE_STATE_DIR=str(tmp_path / "state"))
    started = time.monotonic()
    result = run_pdserve("up", str(config), "--detach", env=env, timeout=600)
    took = time.monotonic() - started
    assert result.returncode == 1
    assert "failed to start" in result.stderr
    assert "max_model_len" in result.stderr and "100000" in result.stderr  # vLLM's words, not a timeout
    assert "did not become ready" not in result.stderr
    assert took < 120, f"failure took {took:.0f}s to report"
    # up cleaned up after itself: no state, no Ray head of this cluster.
    assert not (tmp_path / "state" / "cluster.json").exists()
    assert run_pdserve("status", env=env).returncode == 3
    assert processes_mentioning("pdserve-broken") == []


@pytest.mark.after_cluster
def test_ctrl_c_on_a_foreground_up_stops_everything(tmp_path: Path, pdserve_env: dict[str, str]) -> None:
    config = write_spec(tmp_path, "pdserve-fg", base=20, max_model_len=2048)
    env = dict(pdserve_env, PDSERVE_STATE_DIR=str(tmp_path / "state"))
    up = subprocess.Popen(
        [*PDSERVE, "up", str(config)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = []
    try:
        for line in up.stdout:
            output.append(line)
            if "press Ctrl-C" in line:
                break
        assert "is ready" in "".join(output), "".join(output)
        recorded = json.loads((tmp_path / "state" / "cluster.json").read_text())
        with urllib.request.urlopen("http://127.0.0.1:20000/health", timeout=30) as response:
            assert response.status == 200
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=180)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, "".join(output) + rest
    assert "stopping the cluster" in rest and "cluster stopped" in rest
    assert processes_mentioning(recorded["ray_temp_dir"]) == []
    assert processes_mentioning("pdserve-fg") == []
    assert not (tmp_path / "state" / "cluster.json").exists()
