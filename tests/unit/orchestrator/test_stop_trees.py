"""``terminate_trees``: a stage at a time, SIGKILL for what outlives the grace (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from orchestrator import ray_head

# Notes when SIGTERM reached it, then exits; or, with "stubborn", ignores SIGTERM.
CHILD = """
import signal, sys, time
def on_term(*_):
    open(sys.argv[1], "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else on_term)
open(sys.argv[1] + ".up", "w").close()
time.sleep(120)
"""


def start(tmp_path: Path, name: str, how: str = "polite") -> tuple[psutil.Process, Path]:
    note = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(note), how])
    deadline = time.monotonic() + 30
    while not Path(str(note) + ".up").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return psutil.Process(proc.pid), note


def test_a_later_stage_is_signalled_only_once_the_earlier_one_is_gone(tmp_path, monkeypatch):
    first, first_note = start(tmp_path, "first")
    last, last_note = start(tmp_path, "last")
    monkeypatch.setattr(ray_head, "STOP_GRACE_S", 5.0)
    ray_head.terminate_trees([last, first], stage=lambda p: 1 if p.pid == last.pid else 0)
    assert not first.is_running() and not last.is_running()
    assert float(first_note.read_text()) <= float(last_note.read_text())


def test_what_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    stubborn, note = start(tmp_path, "stubborn", "stubborn")
    monkeypatch.setattr(ray_head, "STOP_GRACE_S", 0.5)
    started = time.monotonic()
    ray_head.terminate_trees([stubborn])
    assert not stubborn.is_running() and not note.exists()
    assert time.monotonic() - started < 5


def test_the_gcs_is_the_last_stage_of_a_ray_head():
    class Named:
        def __init__(self, name: str) -> None:
            self._name = name

        def name(self) -> str:
            return self._name

    stages = {name: ray_head._ray_stop_stage(Named(name)) for name in ("raylet", "python3", "gcs_server")}
    assert stages["gcs_server"] > stages["raylet"] == stages["python3"]
