"""What engines leave in /dev/shm: found while a process holds it, removed once none does."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import shm
from orchestrator.shm import SHM_DIR, ShmRecord, mapped, record_of, recorded_in, remove_unheld

HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
view = mmap.mmap(fd, 4096)
if sys.argv[2] == "map":
    os.close(fd)  # held by the mapping alone
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def shm_name():
    path = SHM_DIR / f"pdserve-test-{secrets.token_hex(4)}"
    yield path
    path.unlink(missing_ok=True)


def hold(path: Path, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("how", ["map", "open"])
def test_a_file_a_process_holds_is_found_and_kept_until_it_exits(shm_name, how):
    proc = hold(shm_name, how)
    try:
        assert shm_name in mapped([proc.pid])
        assert remove_unheld([shm_name]) == []
        assert shm_name.exists()
    finally:
        proc.kill()
        proc.wait()
    assert remove_unheld([shm_name]) == [shm_name]
    assert not shm_name.exists()


def test_a_semaphore_is_found_under_its_name_though_its_mapping_shows_another():
    """glibc makes a semaphore under a temporary name and links it to ``sem.mp-*``: ``/proc``'s maps show
    the temporary name, deleted. The suite's leftover semaphores were never recorded for that reason."""
    code = "import multiprocessing as mp, time\nlock = mp.get_context('spawn').Lock()\n"
    code += "print(lock._semlock.name, flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = SHM_DIR / ("sem." + proc.stdout.readline().strip().lstrip("/"))
        assert path.exists()
        assert path in mapped([proc.pid])
        assert remove_unheld([path]) == [] and path.exists()  # in use: kept
    finally:
        proc.kill()
        proc.wait()


def test_the_caller_may_ignore_its_own_hold(shm_name):
    fd = os.open(shm_name, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert remove_unheld([shm_name]) == []
        assert remove_unheld([shm_name], ignore=os.getpid()) == [shm_name]
    finally:
        os.close(fd)


def test_files_outside_dev_shm_or_in_its_subdirectories_are_never_removed(tmp_path):
    elsewhere = tmp_path / "kv"
    elsewhere.write_bytes(b"x")
    nested = SHM_DIR / f"pdserve-test-{secrets.token_hex(4)}"
    nested.mkdir()
    try:
        (nested / "entry").write_bytes(b"x")
        assert remove_unheld([elsewhere, nested / "entry", nested]) == []
        assert elsewhere.exists() and (nested / "entry").exists()
    finally:
        (nested / "entry").unlink()
        nested.rmdir()


def test_missing_files_and_gone_processes_are_no_error(shm_name):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    assert mapped([proc.pid]) == set()
    assert remove_unheld([shm_name]) == []


def test_a_stopped_resource_tracker_removes_what_the_processes_it_served_left():
    """An engine actor stops its tracker at stop: Ray kills the tracker with the actor before it cleans up."""
    code = """
import multiprocessing as mp, os, sys
from orchestrator.shm import stop_resource_tracker
lock = mp.get_context("spawn").Lock()   # registered with this process's tracker, still in use
print(lock._semlock.name, flush=True)
stop_resource_tracker()
print(os.path.exists("/dev/shm/sem." + lock._semlock.name.lstrip("/")), flush=True)
os._exit(0)                              # as Ray ends an actor: no finalizers
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    name, still_there = proc.stdout.split()
    assert still_there == "False", proc.stderr
    assert not (SHM_DIR / ("sem." + name.lstrip("/"))).exists()


def test_a_restarted_engine_removes_its_last_lifes_files_once_their_last_holder_is_gone(shm_name, tmp_path):
    record = ShmRecord(tmp_path / "prefill-0.log")
    record.path.write_text(f"{shm_name}\n")
    straggler = hold(shm_name, "map")  # a child of the killed engine, not gone yet
    try:
        record.remove_leftovers()  # the restarted actor's first look
        assert shm_name.exists()
        assert record.recorded() == [str(shm_name)]  # kept for the next look
    finally:
        straggler.kill()
        straggler.wait()
    record.remove_leftovers(this_start_too=False)  # the look once it is ready
    assert not shm_name.exists()
    assert not record.path.exists()


async def test_an_engine_notes_its_files_while_it_starts(shm_name, tmp_path, monkeypatch):
    """Stopped or killed before it is ready (a scale-down during a scale-up), it still left a record."""
    monkeypatch.setattr(shm, "NOTE_INTERVAL_S", 0.05)
    record = ShmRecord(tmp_path / "prefill-1.log")
    noting = asyncio.create_task(record.note_while_starting())
    child = hold(shm_name, "map")  # vLLM's processes, made during the start
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if str(shm_name) in record.recorded():
                break
        assert str(shm_name) in record.recorded()
    finally:
        noting.cancel()
        child.kill()
        child.wait()
    assert recorded_in(tmp_path) == {shm_name}  # what pdserve down removes, once no process holds it
    assert remove_unheld(recorded_in(tmp_path)) == [shm_name]


def test_records_of_a_clusters_engines_are_read_together(tmp_path):
    record_of(tmp_path / "prefill-0.log").write_text("/dev/shm/psm_a\n/dev/shm/sem.mp-b\n")
    record_of(tmp_path / "decode-0.log").write_text("/dev/shm/psm_c\n")
    (tmp_path / "decode-0.log").write_text("not a record\n")
    assert recorded_in(tmp_path) == {Path("/dev/shm/psm_a"), Path("/dev/shm/sem.mp-b"), Path("/dev/shm/psm_c")}
    assert recorded_in(tmp_path / "absent") == set()


def test_an_engines_temp_dir_is_private_emptied_at_each_start_and_removed_by_down(tmp_path, monkeypatch):
    """vLLM's sockets and Gloo files go to the engine's own temp dir (its processes' TMPDIR): a start empties
    it (what a crashed start left goes), and ``pdserve down`` removes those of engines that died unrestarted."""
    import tempfile

    from orchestrator.cluster import remove_engine_temp_dirs
    from orchestrator.paths import engine_temp_dir, fresh_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    temp_dir = engine_temp_dir(logs / "prefill-0.log")
    temp_dir.mkdir()
    (temp_dir / "socket-of-a-crashed-start").touch()
    fresh_temp_dir(temp_dir)
    assert tempfile.tempdir == str(temp_dir)  # this process's temp files go there too while it serves
    assert list(temp_dir.iterdir()) == [] and temp_dir.stat().st_mode & 0o777 == 0o700
    (temp_dir / "vllm_dist_x").touch()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # pdserve down's process
    other = engine_temp_dir(tmp_path / "elsewhere" / "decode-0.log")  # another cluster's engine
    other.mkdir()
    for log in ("prefill-0.log", "proxy.log"):
        (logs / log).touch()
    remove_engine_temp_dirs(logs)
    assert not temp_dir.exists() and other.exists()


def test_compiled_kernels_are_kept_outside_the_temp_dir_each_start_empties(tmp_path, monkeypatch):
    from orchestrator.paths import compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert compile_cache_dir() == tmp_path / "cache" / "pdserve" / "torchinductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"
