"""A test's helper process ahead of the engines on the CPU: on a 2-core machine the engines keep both cores busy,
and a client or watcher that waits for a CPU measures its own wait (``testlib.fidelity``) or misses its moment
(``tests/integration/release_when_pinned.py``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

AHEAD_NICE = -10


def run_ahead() -> None:
    """Run this process (and what it starts) ahead of the engines, where it may (as root): its session's autogroup
    first (Linux shares the CPU between sessions' autogroups, so a nice value alone counts only inside its own
    session: a replay at nice -10 in a session of its own still stalled 406 times in 15 minutes), then the process
    itself. Without the right to, as is."""
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(AHEAD_NICE))
    with contextlib.suppress(OSError):
        os.nice(AHEAD_NICE)
