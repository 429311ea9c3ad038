"""The processes in the hosts' namespaces: finding them and stopping them (always, SIGKILL at the end)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from testlib.testbed.config import KILL_WAIT_S, HostsError
from testlib.testbed.netns import ip


def netns_pids(netns: str) -> list[int]:
    result = ip("netns", "pids", netns, check=False)
    own = _own_lineage()
    # Not the `ip` that listed them (it is in the namespace too when this runs inside a host: gone now).
    return [int(p) for p in result.stdout.split() if p.isdigit() and int(p) not in own and _exists(int(p))]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_lineage() -> set[int]:
    """This process and its ancestors: never signalled, even when run inside a host."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _is_gcs(pid: int) -> bool:
    return "gcs_server" in cmdline(pid).split(" ", 1)[0]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _terminate(find, *, grace_s: float, signalled: set[int]) -> None:
    """Signal what ``find()`` returns until it returns nothing: SIGTERM (once per pid), SIGKILL after
    ``grace_s`` (at once when 0). A raylet may start a worker while the rest stops: the loop finds it."""
    deadline = time.monotonic() + grace_s
    give_up = deadline + KILL_WAIT_S
    while True:
        pids = [p for p in find() if not _zombie(p)]  # killed, waiting for a parent to reap it: gone
        if not pids:
            return
        now = time.monotonic()
        if now >= give_up:
            raise HostsError(f"processes still there {KILL_WAIT_S:g} s after SIGKILL: {pids}")
        if now >= deadline:
            _signal_all(pids, signal.SIGKILL)
        else:
            _signal_all([p for p in pids if p not in signalled], signal.SIGTERM)
        signalled.update(pids)
        time.sleep(0.05)


def stop_processes(netns_list: list[str], *, grace_s: float) -> list[int]:
    """Stop every process in the namespaces; return the pids signalled.

    With a grace period, in Ray's order: the worker nodes first (their raylets unregister from the
    GCS), then the head's processes but the GCS, then the GCS. All at once, a SIGTERM'd raylet hangs
    on the GCS that stops beside it, and every stop waited out the grace (5 s instead of < 1 s).
    """
    signalled: set[int] = set()

    def in_ns(names: list[str]) -> list[int]:
        return [p for ns in names for p in netns_pids(ns)]

    if grace_s > 0:
        head_ns = [ns for ns in netns_list if any(_is_gcs(p) for p in netns_pids(ns))]
        others = [ns for ns in netns_list if ns not in head_ns]
        _terminate(lambda: in_ns(others), grace_s=grace_s, signalled=signalled)
        _terminate(lambda: [p for p in in_ns(head_ns) if not _is_gcs(p)], grace_s=grace_s, signalled=signalled)
    _terminate(lambda: in_ns(netns_list), grace_s=grace_s, signalled=signalled)
    # Ray's daemons are children of init, which reaps them a moment later: wait for that, so that no
    # <defunct> raylet is left for a `pgrep raylet` right after.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in signalled):
        time.sleep(0.05)
    return sorted(signalled)
