"""Idle engines and the control plane, on the shared cluster (our connector; the idle check on vLLM's too).

- Idle engines idle: no thread of an engine's process tree spins (NIXL's
  progress thread used a whole core before), and the tree stays under
  ``IDLE_TREE_BOUND`` over 30 s, by ``/proc`` accounting.
- ``pdserve status --json`` answers over the controller's HTTP API, fast, in
  the documented schema.
- The controller killed with SIGKILL while requests run: Ray restarts it, it
  adopts the running engines and proxy (no engine restarts), every request
  succeeds, and ``status`` answers again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from orchestrator.control import STATUS_SCHEMA
from testlib.cpu_use import idle_use
from tests.integration.conftest import Cluster, http_json, run_pdserve
from tests.status_schema import schema_problems

pytestmark = pytest.mark.integration
ours = pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)

MODEL = "smollm2-135m-instruct"
IDLE_S = 10.0  # what the bounds catch, a thread that never sleeps, shows within a second
# An idle vLLM CPU engine's floor on this VM, measured (docs/idle-engines.md): Ray's worker (its main
# thread takes the GIL 100 times a second to check for signals; its gRPC and event threads; the monitor's
# call once a second), torch's Gloo (13 threads waking every 10 ms), vLLM's HTTP server. It is made of
# wake-ups, each costing what the machine makes it cost: the same engines measured 3.1 % on 2026-11-23 and
# 7.5-10 % on the slower machine of 2026-11-26 (before three of our own wake-up sources went), and CI failed
# at 7.7 % against a 6 % bound. These bounds are for what the issue was about, a thread that never sleeps
# (NIXL's progress thread: 98 % of a core); the benchmark (scripts/bench_control.py) reports the figures.
IDLE_TREE_BOUND = 0.15
IDLE_THREAD_BOUND = 0.10


# Both connectors: vLLM's NixlConnector builds a NIXL agent whose progress thread never sleeps; on CPU pdserve
# gives it the sleeping thread ours has (connectors.vllm_plugin).
def test_idle_engines_use_a_few_percent_of_a_core_and_no_thread_spins(cluster: Cluster) -> None:
    engines = {e["pid"]: e["engine_id"] for e in cluster.refresh()["engines"]}
    for pid, use in idle_use(list(engines), IDLE_S).items():
        assert use.cpu < IDLE_TREE_BOUND, f"{engines[pid]} used {use.cpu:.1%} of a core while idle"
        assert use.busiest_thread_cpu < IDLE_THREAD_BOUND, (
            f"a thread of {engines[pid]} ({use.busiest_thread}) used {use.busiest_thread_cpu:.1%} of a core while idle"
        )


@ours
def test_status_json_answers_fast_in_the_documented_schema(cluster: Cluster) -> None:
    started = time.monotonic()
    result = run_pdserve("status", "--json", env=cluster.env)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["schema"] == STATUS_SCHEMA
    assert schema_problems(status) == []
    assert took < 2.0, f"pdserve status --json took {took:.2f} s"
    state = json.loads((Path(cluster.env["PDSERVE_STATE_DIR"]) / "cluster.json").read_text())
    assert state["api_token"] not in result.stdout + result.stderr  # the token is never printed


@ours
def test_the_controller_killed_under_load_comes_back_and_adopts_the_running_engines(cluster: Cluster) -> None:
    before = cluster.refresh()
    engines_before = {e["engine_id"]: (e["pid"], e["restarts"]) for e in before["engines"]}
    outcomes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        while not stop.is_set():
            status, _, _ = http_json(cluster.proxy_url + "/v1/completions", body, timeout=120)
            outcomes.append(status)

    client = threading.Thread(target=load)
    client.start()
    try:
        while len(outcomes) < 2:  # requests are running
            time.sleep(0.2)
        os.kill(before["controller"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # until the restarted controller answers again
            result = run_pdserve("status", "--json", env=cluster.env)
            if result.returncode == 0:
                after = json.loads(result.stdout)
                if after["controller"]["restarts"] > before["controller"]["restarts"]:
                    break
            assert time.monotonic() < deadline, f"status did not answer again: {result.stderr}"
            time.sleep(1)
        served_after_kill = len(outcomes)
        while len(outcomes) < served_after_kill + 2:  # the proxy goes on serving
            time.sleep(0.2)
    finally:
        stop.set()
        client.join(180)
    assert after["controller"]["pid"] != before["controller"]["pid"]
    assert after["phase"] == "ready"
    assert {e["engine_id"]: (e["pid"], e["restarts"]) for e in after["engines"]} == engines_before
    assert all(e["state"] == "ready" for e in after["engines"])
    assert outcomes and set(outcomes) == {200}, outcomes
    assert any("controller restarted by Ray" in e["message"] for e in after["events"])
    cluster.status = after
