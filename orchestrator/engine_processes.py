"""An engine actor's processes (vLLM's API server, its engine core and workers): confined to the engine's cores,
and ended when a stop comes during a start."""

from __future__ import annotations

import contextlib
import os

from orchestrator.shm import is_resource_tracker


def parse_cores(cpu_bind: str) -> set[int]:
    """``'0-1|4'`` (vLLM's VLLM_CPU_OMP_THREADS_BIND) -> ``{0, 1, 4}``."""
    cores: set[int] = set()
    for part in cpu_bind.replace("|", ",").split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def end_children(kill: bool) -> None:
    """Terminate (``kill``: kill) this process's descendants, all but Python's resource tracker (it removes
    what they registered once they are gone)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(os.getpid()).children(recursive=True):
            if not is_resource_tracker(child):
                with contextlib.suppress(psutil.Error):
                    child.kill() if kill else child.terminate()


def pin_process_tree(pid: int, cores: set[int]) -> int:
    """Confine every thread of ``pid`` and its descendants to ``cores``; return threads pinned.

    vLLM's NixlConnector on CPU moves its worker thread to the last core of each
    NUMA node (to keep KV transfers off the model's cores). On a small machine that
    puts the model of every engine on one shared core; this puts each engine back
    on its own cores.
    """
    import psutil

    pinned = 0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            threads = proc.threads()
        except psutil.Error:
            continue
        for thread in threads:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(thread.id, cores)
                pinned += 1
    return pinned
