"""`pdserve up` with an engine that cannot start: a clear error, fast, and nothing left behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import run_pdserve

pytestmark = pytest.mark.integration

# vLLM refuses a context longer than the model's (8192 for SmolLM2-135M).
BROKEN = """
name: pdserve-broken
model: smollm2-135m-instruct
proxy: {port: 19000}
prefill: {port: 19100, kv_port: 16600}
decode: {port: 19200, kv_port: 16700}
engine: {max_model_len: 100000}
"""


def test_up_fails_with_the_engines_own_error(tmp_path: Path, pdserve_env: dict[str, str]) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text(BROKEN)
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
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if "pdserve-broken" in json.dumps(p.info["cmdline"])]
    assert leftovers == []
