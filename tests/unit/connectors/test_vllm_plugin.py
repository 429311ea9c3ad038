"""pdserve's vLLM plugin: the engine core of a CPU engine pdserve launched forks its workers (vLLM's default
outside Ray) instead of spawning them as the engine actor, a Ray worker, must; elsewhere it does nothing."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from connectors import vllm_plugin
from connectors.vllm_plugin import FORK_WORKERS_ENV

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv(METHOD, "spawn")  # what the engine core inherits from the engine actor
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    return monkeypatch


def test_an_engine_core_of_ours_forks_its_workers(env: pytest.MonkeyPatch) -> None:
    env.setenv(FORK_WORKERS_ENV, "1")
    vllm_plugin.register()
    assert vllm_plugin.os.environ[METHOD] == "fork"


def test_a_vllm_process_of_someone_elses_is_left_alone(env: pytest.MonkeyPatch) -> None:
    env.delenv(FORK_WORKERS_ENV, raising=False)
    vllm_plugin.register()
    assert vllm_plugin.os.environ[METHOD] == "spawn"


def test_the_engine_actor_a_ray_worker_still_spawns(env: pytest.MonkeyPatch) -> None:
    env.setenv(FORK_WORKERS_ENV, "1")
    env.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    vllm_plugin.register()
    assert vllm_plugin.os.environ[METHOD] == "spawn"


def test_vllm_finds_the_plugin_and_it_imports_only_the_standard_library() -> None:
    from importlib.metadata import entry_points

    (ours,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "pdserve"]
    assert ours.value == "connectors.vllm_plugin:register"
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, connectors.vllm_plugin as p; p.register(); print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    modules = set(eval(loaded.stdout))  # noqa: S307 - our own child's list of names
    assert {m.split(".")[0] for m in modules} & {"ray", "vllm", "torch", "pydantic", "zmq", "numpy"} == set()
    assert {m for m in modules if m.startswith("connectors")} == {"connectors", "connectors.vllm_plugin"}


def test_with_vllms_nixl_connector_its_agents_get_a_progress_thread_that_sleeps() -> None:
    """vLLM builds its agent through ``nixl._api``'s bindings, which the plugin wraps (in a child: the wrap is
    for the life of the process)."""
    child = (
        "import os; os.environ['PDSERVE_CALM_NIXL'] = '1'\n"
        "from nixl import _api\n"
        "import connectors.vllm_plugin as p; p.register(); p.register()\n"
        "from connectors.transport.nixl import WakeEvery\n"
        "bind = _api.nixlBind\n"
        "assert isinstance(bind, WakeEvery) and not isinstance(bind._bindings, WakeEvery), bind\n"
        "class Config: pthrDelay = 0\n"
        "config = Config()\n"
        "bind._bindings = type('B', (), {'nixlAgent': staticmethod(lambda name, c: c.pthrDelay)})()\n"
        "print(bind.nixlAgent('vllm-agent', config))\n"
    )
    woken = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert int(woken.stdout) == 10_000  # microseconds: at least every 10 ms, and at each UCX event
