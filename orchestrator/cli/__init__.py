"""The ``pdserve`` command line, a module per command group: ``config`` (validate, schema), ``cluster`` (up,
status, scale, down, secret), ``proxy`` (the proxy alone, without Ray), ``autoscaling`` (profile, simulate,
traces) and ``doctor`` (the KV path on this host). Each group adds its commands' parsers and holds their bodies;
``main`` runs one."""

from __future__ import annotations

import argparse
import sys

from orchestrator.cli import autoscaling, cluster, config, doctor, proxy
from orchestrator.errors import ClusterNotRunning, PdserveError, SpecError

GROUPS = (config, cluster, proxy, autoscaling, doctor)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command``, the other commands' heavy options (whose defaults import the
    proxy, the profiler, the traces) are left out, so that ``pdserve status`` starts in a fraction of a second."""

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode serving on Ray-managed vLLM engines."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(commands, wanted)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except SpecError as e:
        print(f"pdserve: invalid spec:\n{e}", file=sys.stderr)
        return 2
    except ClusterNotRunning as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 3
    except PdserveError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
