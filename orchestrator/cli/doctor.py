"""``pdserve doctor [CONFIG]``: the KV path on this host, measured, with what to fix (``orchestrator.doctor``)."""

from __future__ import annotations

import argparse
import json
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
