"""``testlib.cpu_use.idle_use``: a process tree's CPU, busiest thread and wake-ups, by ``/proc``
accounting, on real child processes (the idle-engine test and ``scripts/bench_control.py`` read it)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from testlib.cpu_use import IdleUse, idle_use

CHILD = """
import os, subprocess, threading, time
def spin():
    while True:
        pass
def tick():
    while True:
        time.sleep(0.01)
threading.Thread(target=tick, name="ticker", daemon=True).start()
if os.environ.get("SPIN"):
    threading.Thread(target=spin, name="spinner", daemon=True).start()
child = subprocess.Popen(["sleep", "60"])  # a descendant: counted, idle
time.sleep(60)
"""


def run(spin: bool) -> IdleUse:
    env = {"SPIN": "1"} if spin else {}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env)
    try:
        time.sleep(0.5)
        return idle_use([proc.pid], 1.5)[proc.pid]
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def test_a_spinning_thread_is_the_busiest_and_uses_most_of_a_core() -> None:
    use = run(spin=True)
    assert use.busiest_thread.startswith("python")  # "process name/thread name" (Python 3.11 names no OS thread)
    assert use.busiest_thread_cpu > 0.3  # a whole core, less what the machine's other work takes
    assert use.cpu >= use.busiest_thread_cpu


def test_a_thread_that_sleeps_10_ms_at_a_time_wakes_about_100_times_a_second_and_uses_little() -> None:
    use = run(spin=False)
    assert 50 < use.wakeups_per_s < 150
    assert use.cpu < 0.1
