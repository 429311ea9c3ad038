"""Shared-memory files an engine leaves in ``/dev/shm`` when it stops or dies.

vLLM's engine processes keep state in files directly under ``/dev/shm``: message
queues and tensor arenas (``psm_*``, ``sem.mp-*``), the KV tier's host region
(``vllm_offload_<id>.mmap``). Each is unlinked by the process that made it, on a
clean exit only: an engine stopped by its actor, killed by ``pdserve down`` or
crashed leaves them behind, up to ``host_gib`` each, for every start.

We take no names on trust: ``mapped`` lists the files an engine's processes map or
hold open while they run, and ``remove_unheld`` later removes those of them that no
process on the machine holds any more. Files in sub-directories (the node tier's
``/dev/shm/pdserve-kv``) are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
RECORD_SUFFIX = ".shm"
"""An engine's record of its files, beside its log: ``prefill-0.log.shm``, one path a line."""
NOTE_INTERVAL_S = 2.0
"""While an engine starts, how often it notes the /dev/shm files its processes hold."""


def record_of(log_path: Path) -> Path:
    """Where the engine logging to ``log_path`` records the /dev/shm files its processes held."""
    return log_path.with_name(log_path.name + RECORD_SUFFIX)


def read_record(record: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return record.read_text().split()
    return []


def recorded_in(log_dir: Path) -> set[Path]:
    """Every file the records of a cluster's engines (its log directory) name."""
    return {Path(path) for record in sorted(log_dir.glob("*" + RECORD_SUFFIX)) for path in read_record(record)}


def _held_inodes(pid: int | str) -> set[int]:
    """The inodes of the files under ``/dev/shm`` that process ``pid`` maps or holds open.

    By inode, not by the name ``/proc`` shows: a POSIX semaphore (glibc's ``sem_open``) is made under a
    temporary name, mapped, linked to its real name (``sem.mp-*``) and the temporary name unlinked, so its
    mapping reads ``/dev/shm/sem.XXXXXX (deleted)`` while ``sem.mp-*`` is the same file.
    """
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                inodes.add(int(parts[4]))
    with contextlib.suppress(OSError):
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path).startswith("/dev/shm/"):
                    inodes.add(os.stat(fd.path).st_ino)
    return inodes


def _held(pids: Iterable[int | str]) -> set[Path]:
    """The files directly under ``/dev/shm`` that any of ``pids`` maps or holds open."""
    inodes = set().union(*(_held_inodes(pid) for pid in pids))
    held = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.inode() in inodes:
                    held.add(Path(entry.path))
    return held


def mapped(pids: Iterable[int]) -> set[Path]:
    """The files directly under ``/dev/shm`` that the processes ``pids`` map or hold open now."""
    return _held(pids)


def is_resource_tracker(proc: psutil.Process) -> bool:
    """Python's ``multiprocessing`` resource tracker: it ignores SIGTERM, outlives the processes it serves
    and, when they are gone, removes what they left registered (semaphores, shared memory) and exits."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def stop_resource_tracker(timeout_s: float = 5.0) -> None:
    """Stop this process's resource tracker now, so that it removes what the processes it served left
    registered: Ray kills an actor's child processes with the actor, the tracker among them, before
    it could (vLLM's engine start leaves two semaphores, ``/dev/shm/sem.mp-*``, per engine). A later
    registration starts a new tracker."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker  # private: Python has no public way to stop it
    with tracker._lock:
        if tracker._fd is None:
            return
        pid = tracker._pid
        os.close(tracker._fd)  # our end of its pipe: once no process holds one, it cleans up and exits
        tracker._fd = tracker._pid = None
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(timeout=timeout_s)


def remove_unheld(paths: Iterable[Path], ignore: int | None = None) -> list[Path]:
    """Remove those of ``paths`` (directly under ``/dev/shm``) that no process but ``ignore`` holds;
    the ones removed."""
    candidates = {Path(p) for p in paths if Path(p).parent == SHM_DIR and Path(p).is_file()}
    if not candidates:
        return []
    pids = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit() and entry.name != str(ignore)]
    held = _held(pids)
    removed = []
    for path in sorted(candidates - held):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory file(s) no process holds: %s", len(removed), ", ".join(map(str, removed)))
    return removed


class ShmRecord:
    """An engine actor's record of the /dev/shm files its processes hold (``record_of`` its log), noted while
    they run and removed once no process holds them."""

    def __init__(self, log_path: Path) -> None:
        self.path = record_of(log_path)

    def recorded(self) -> list[str]:
        return read_record(self.path)

    def note(self) -> None:
        """Add the /dev/shm files this process and its descendants hold now to the record."""
        with contextlib.suppress(psutil.Error, OSError):
            pids = [os.getpid(), *(p.pid for p in psutil.Process(os.getpid()).children(recursive=True))]
            held = {str(path) for path in mapped(pids)} | set(self.recorded())
            self.path.write_text("".join(f"{path}\n" for path in sorted(held)))

    async def note_while_starting(self) -> None:
        """Note a start's /dev/shm files as they appear. An engine stopped or killed while it starts (the
        autoscaler shrinking a pool during a scale-up) never reaches ready: noted only there, its message
        queues (``psm_*``, 160-250 MB each) and semaphores would be left behind."""
        while True:
            await asyncio.sleep(NOTE_INTERVAL_S)
            self.note()

    def remove_leftovers(self, region: Path | None = None, this_start_too: bool = True) -> None:
        """Remove the recorded /dev/shm files (and, when this start is over, its tier ``region``) that no process
        holds. Those still held stay in the record for the next look: after a crash, the dead engine's
        children can outlive it by a moment, holding its files when the restarted actor first looks, so the
        engine looks again once it is ready. (A semaphore's mapping shows another name than its file's, so
        ``_held`` finds it by inode.)
        """
        recorded = self.recorded()
        if this_start_too:
            candidates = [*recorded, *([region] if region else [])]
            remove_unheld((Path(path) for path in candidates), ignore=os.getpid())  # this actor is done with them
        else:  # this start's files are in use, and none of them is in the record yet
            remove_unheld(Path(path) for path in recorded)
        if left := [path for path in recorded if Path(path).exists()]:
            self.path.write_text("".join(f"{path}\n" for path in left))
        else:
            self.path.unlink(missing_ok=True)
