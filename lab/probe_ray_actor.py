"""What an empty, idle Ray actor costs on this machine: the floor under every pdserve engine (an engine is a
Ray actor). Starts a Ray instance of its own, one async actor that does nothing, and measures its process
tree as ``scripts/bench_control.py`` measures engines (``/proc`` accounting over ``--idle-s``).

    python lab/probe_ray_actor.py [--idle-s 30] [--settle-s 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from testlib.cpu_use import idle_use  # noqa: E402


@ray.remote
class Idle:
    async def pid(self) -> int:
        return os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=15.0)
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = Idle.options(enable_task_events=False).remote()
        pid = ray.get(actor.pid.remote())
        time.sleep(args.settle_s)
        use = idle_use([pid], args.idle_s)[pid]
    finally:
        ray.shutdown()
    print(
        f"idle async Ray actor: {100 * use.cpu:.2f} % of a core; busiest thread {use.busiest_thread} "
        f"{100 * use.busiest_thread_cpu:.2f} %; {use.wakeups_per_s:.0f} wake-ups/s"
    )


if __name__ == "__main__":
    main()
