"""What a process tree uses, by ``/proc`` accounting: CPU, its busiest thread, wake-ups. For the idle-engine
measurements (``tests/integration/test_control.py``, ``scripts/bench_control.py``, ``lab/probe_ray_actor.py``);
nothing in the installed package needs it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from orchestrator.ray_head import process_trees

__all__ = ["IdleUse", "context_switches", "idle_use"]


@dataclass(frozen=True, slots=True)
class IdleUse:
    """What a process tree used while idle: CPU (in cores: 1.0 is one core busy), its busiest thread
    (``process name/thread name``) and that thread's share, and wake-ups (context switches) per second,
    which unlike CPU time do not depend on how fast the machine is that day."""

    cpu: float
    busiest_thread: str
    busiest_thread_cpu: float
    wakeups_per_s: float


def context_switches(task: Path) -> int:
    """Voluntary and involuntary context switches so far of the thread at ``task`` (``/proc/<pid>/task/<tid>``):
    how often it woke."""
    status = (task / "status").read_text().splitlines()
    return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)


def _thread_times(pid: int) -> dict[tuple[int, int], tuple[str, float, int]]:
    """Every thread of ``pid``'s process tree now: its name, CPU seconds and context switches so far."""
    table = {}
    for proc in process_trees([pid]):
        with contextlib.suppress(psutil.Error, OSError):  # a process or thread that ended meanwhile
            name = proc.name()
            for thread in proc.threads():
                task = Path(f"/proc/{proc.pid}/task/{thread.id}")
                comm = (task / "comm").read_text().strip()
                table[(proc.pid, thread.id)] = (
                    f"{name}/{comm}",
                    thread.user_time + thread.system_time,
                    context_switches(task),
                )
    return table


def idle_use(pids: list[int], seconds: float) -> dict[int, IdleUse]:
    """Each process tree's use over ``seconds`` of wall time (an engine's: the Ray actor, vLLM's engine
    core, their threads), by ``/proc`` accounting; threads that start meanwhile count from zero."""
    before = {pid: _thread_times(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    use = {}
    for pid in pids:
        after = _thread_times(pid)
        cpu = {key: (name, used - before[pid].get(key, (name, 0.0, 0))[1]) for key, (name, used, _) in after.items()}
        busiest_name, busiest = max(cpu.values(), key=lambda entry: entry[1], default=("", 0.0))
        switches = sum(n - before[pid].get(key, ("", 0.0, 0))[2] for key, (_, _, n) in after.items())
        use[pid] = IdleUse(sum(used for _, used in cpu.values()) / wall, busiest_name, busiest / wall, switches / wall)
    return use
