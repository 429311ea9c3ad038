"""pdserve's vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its
processes, and it acts only in the engine-core process of an engine pdserve launched on CPU.

A CPU engine is three processes: the engine actor (vLLM's API server, in a Ray actor), the engine core,
and its worker. vLLM starts the engine core with ``spawn`` (it must: the actor is a Ray worker), sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for that, and the engine core inherits it, so its worker is
spawned too and imports vLLM and torch a third time: 16-19 s of a 65-s start on one core here. The
engine core is not a Ray worker; outside Ray, vLLM forks its workers (its default). This plugin gives the
engine core that default back. vLLM still forces ``spawn`` where it must (CUDA initialized, WSL, NUMA
binding).

Also, with ``connector: vllm-nixl`` on CPU, it gives vLLM's NIXL agents a progress thread that sleeps
(``_calm_nixl``).

Imports nothing beyond the standard library unless asked: it runs in every vLLM process of the environment,
and does nothing where neither variable is set (a user's own ``vllm serve``, GPU engines).
"""

from __future__ import annotations

import os
import sys

# Set by the launch plan (orchestrator.launch) in a CPU engine's environment.
FORK_WORKERS_ENV = "PDSERVE_FORK_WORKERS"
CALM_NIXL_ENV = "PDSERVE_CALM_NIXL"  # and, with connector vllm-nixl, this one


def register() -> None:
    if os.environ.get(CALM_NIXL_ENV) == "1":
        _calm_nixl()
    if os.environ.get(FORK_WORKERS_ENV) != "1":
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return  # the engine actor itself: a Ray worker, which must spawn
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


def _calm_nixl() -> None:
    """vLLM's NixlConnector builds its NIXL agent with a progress thread that never sleeps: on CPU it spins
    the engine's own core (and, on a small machine, starves every other process). Its agents get the
    progress thread our connector's have, woken by UCX's events and at least every 10 ms."""
    from connectors.transport.nixl import wake_every_agent

    wake_every_agent()
