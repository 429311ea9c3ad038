"""``pdserve doctor [CONFIG]``: the KV path on this host, measured, with what to fix (``orchestrator.doctor``)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from orchestrator.cli.common import say


def add_commands(commands: Any, wanted: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check the KV path a spec implies on this host: transports, UCX underneath, a measurement, fixes",
    )
    doctor.add_argument(
        "config",
        nargs="?",
        help="a cluster spec (default: the running cluster's, on every node of its Ray cluster; else pdserve's "
        "defaults on this host)",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-measure", action="store_true", help="decide only; move no KV")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from orchestrator.doctor import examine, examine_cluster, render
    from orchestrator.doctor.diagnose import BROKEN
    from orchestrator.spec import ClusterSpec
    from orchestrator.state import ClusterState

    # With --json, standard output carries the JSON alone: what NIXL, UCX and Ray log there goes to stderr.
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        if args.config is None and ClusterState.path().exists():
            examination = examine_cluster(measured=not args.no_measure)
            args.config = f"the running cluster ({ClusterState.load().config})"
        else:
            spec = ClusterSpec.from_file(args.config) if args.config else None
            examination = examine(spec, measured=not args.no_measure)
    if args.json:
        say(json.dumps(examination.to_json(), indent=2))
    else:
        for line in render(examination, args.config):
            say(line)
    return 1 if any(report.verdict == BROKEN for report in examination.reports) else 0


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to this process's standard output (file descriptor 1) to standard error until the
    block ends: NIXL's and UCX's logs, whether Python's or their native libraries' own, and those of the
    processes a measurement spawns, which inherit the descriptor."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        _flush_c_stdio()  # what a native library left in its stdio buffer goes where it was written: stderr
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
