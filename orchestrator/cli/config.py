"""``pdserve validate`` (a spec and the engines it plans, optionally placed on a Ray cluster) and ``pdserve schema``
(the JSON schema of a spec or of the standalone proxy's settings, or the configuration reference)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from orchestrator.cli.common import say


def add_commands(commands: Any, wanted: Any) -> None:
    validate = commands.add_parser("validate", help="check a cluster spec and show the engines it plans")
    validate.add_argument("config")
    validate.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="also place the plan on this running Ray cluster's nodes (labels, resources, GPUs) and show it per host",
    )
    validate.set_defaults(func=cmd_validate)
    schema = commands.add_parser(
        "schema",
        help="print the JSON schema of a cluster spec or of `pdserve proxy --config` (editors validate YAML with it)",
    )
    schema.add_argument("which", nargs="?", choices=["cluster", "proxy"], default="cluster")
    schema.add_argument(
        "--markdown", action="store_true", help="print the configuration reference instead (docs/configuration.md)"
    )
    schema.set_defaults(func=cmd_schema)


def cmd_validate(args: argparse.Namespace) -> int:
    from contract.wire import url_host
    from orchestrator.launch import plan_engines
    from orchestrator.placement import assign, host_plan
    from orchestrator.spec import ClusterSpec

    spec = ClusterSpec.from_file(args.config)
    engines = plan_engines(spec, host=None)
    say(f"{args.config}: valid: cluster {spec.name!r}, model {spec.model_name!r}, connector {spec.connector}")
    placed = None
    if args.ray_address:
        from orchestrator.ray_head import cluster_nodes

        nodes = cluster_nodes(args.ray_address)
        say(f"  placed on the Ray cluster at {args.ray_address} ({sum(n.alive for n in nodes)} alive nodes):")
        placed = assign(spec, nodes)
    for line in host_plan(spec, engines, placed):
        say(line)
    say(f"  proxy      listens on {url_host(spec.proxy.host)}:{spec.proxy.port}")
    for view in (v for v in spec.views() if v.autoscaling is not None):
        from orchestrator.cluster import autoscaling_profile

        on = autoscaling_profile(view, args.config) is not None
        mode = f"on, profile {view.profile_path(args.config)}" if on else "off (no autoscaling.profile)"
        say(
            f"  autoscaler {mode}{f' for {view.model_name}' if spec.models else ''}"
            f"; prefill {view.min_replicas('prefill')}..{view.max_replicas('prefill')}, "
            f"decode {view.min_replicas('decode')}..{view.max_replicas('decode')}"
        )
    return 1 if placed is not None and placed[1] else 0


def cmd_schema(args: argparse.Namespace) -> int:
    from orchestrator import reference

    say(reference.markdown().rstrip("\n") if args.markdown else json.dumps(reference.json_schema(args.which), indent=2))
    return 0
