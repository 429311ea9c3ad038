"""The test bed's command line (``scripts/hosts.py``): up, status, exec, kill, restart, down."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from testlib import testbed
from testlib.testbed import HostsError


def _pairs(values: list[str], what: str, parts: int) -> list[list[str]]:
    out = [value.split("=", parts - 1) for value in values]
    for value, items in zip(values, out, strict=True):
        if len(items) != parts or not items[0]:
            raise HostsError(f"bad {what} {value!r}")
    return out


def _up(args: argparse.Namespace) -> None:
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    default_cpus, per_host = testbed.DEFAULT_CPUS, {}
    for value in args.cpus:
        if "=" in value:
            host, count = _pairs([value], "--cpus", 2)[0]
            per_host[host] = int(count)
        else:
            default_cpus = int(value)
    labels: dict[str, dict[str, str]] = {}
    for host, key, value in _pairs(args.labels, "--labels", 3):
        labels.setdefault(host, {})[key] = value
    resources: dict[str, dict[str, float]] = {}
    for host, key, value in _pairs(args.resources, "--resources", 3):
        resources.setdefault(host, {})[key] = float(value)
    data = testbed.up(
        hosts,
        cpus=(dict.fromkeys(hosts, default_cpus) | per_host) if per_host else default_cpus,
        gpus={host: int(count) for host, count in _pairs(args.gpus, "--gpus", 2)},
        labels=labels,
        resources=resources,
        object_store_mb=args.object_store_mb,
        auth=args.auth,
        ray_env={k: v for k, v in _pairs(args.ray_env, "--ray-env", 2)},
        timeout_s=args.timeout,
        fresh=args.fresh,
    )
    if args.json == "-":
        print(json.dumps(data, indent=2))
        return
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    print(f"bed {'reused' if data['reused'] else 'up'} in {data['up_s']} s")
    env = " ".join(f"{k}={v}" for k, v in data["env"].items())
    print(f"RAY_ADDRESS={data['ray_address']}")
    print(f"client env: {env}")
    for name, host in data["hosts"].items():
        labels_ = ",".join(f"{k}={v}" for k, v in host["labels"].items())
        role = "head" if host["head"] else "worker"
        print(f"  {name:<10} {host['ip']:<14} {role:<6} cpus={host['num_cpus']} labels={labels_}")
    head = next(iter(data["hosts"].values()))
    print(f"run inside a host: {head['exec']} env {env} CMD...   (or: python {sys.argv[0]} exec HOST -- CMD...)")
    print(f"the root namespace reaches the hosts through {data['bridge']} ({data['bridge_ip']})")


def _status(args: argparse.Namespace) -> None:
    result = testbed.status()
    if args.json:
        print(json.dumps(result, indent=2))
    elif not result["up"]:
        print(f"no bed (namespaces: {result['namespaces'] or 'none'}, bridge: {result['bridge']})")
    else:
        print(f"RAY_ADDRESS={result['ray_address']}  bridge {testbed.BRIDGE}: {result['bridge']}")
        for name, host in result["hosts"].items():
            print(f"  {name:<10} {host['ip']:<14} " + " ".join(f"{k}={v}" for k, v in host.items() if k != "ip"))
        for node in result.get("nodes", []):
            state = "alive" if node["alive"] else f"dead ({node['death']})"
            print(f"  node {node['node_id'][:12]} {node['ip']:<14} {state}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="make the bed (reused when the same one runs)")
    p_up.add_argument("--hosts", default=",".join(testbed.DEFAULT_HOSTS), help="comma-separated; the first is the head")
    p_up.add_argument("--cpus", action="append", default=[], help="N for every host, or HOST=N (repeatable)")
    p_up.add_argument("--labels", "--label", action="append", default=[], metavar="HOST=KEY=VALUE")
    p_up.add_argument("--resources", "--resource", action="append", default=[], metavar="HOST=NAME=AMOUNT")
    p_up.add_argument("--gpus", action="append", default=[], metavar="HOST=N", help="logical GPUs of a host")
    p_up.add_argument("--object-store-mb", type=int, default=testbed.DEFAULT_OBJECT_STORE_MB)
    p_up.add_argument("--auth", choices=("token", "disabled"), default="token")
    p_up.add_argument("--ray-env", action="append", default=[], metavar="RAY_X=VALUE")
    p_up.add_argument("--timeout", type=float, default=testbed.START_TIMEOUT_S)
    p_up.add_argument("--fresh", action="store_true", help="tear down and make again even when reusable")
    p_up.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the info as JSON (- : stdout)")
    sub.add_parser("down", help="stop everything, delete namespaces, veths, bridge")
    p_status = sub.add_parser("status", help="namespaces, processes and GCS nodes of the bed")
    p_status.add_argument("--json", action="store_true")
    p_exec = sub.add_parser("exec", help="run a command in a host: exec HOST -- CMD...")
    p_exec.add_argument("host")
    p_exec.add_argument("--no-env", action="store_true", help="without RAY_ADDRESS/RAY_AUTH_* of the bed")
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER)
    p_kill = sub.add_parser("kill", help="SIGKILL every process of a host")
    p_kill.add_argument("host")
    p_kill.add_argument("--wait", action="store_true", help="until the GCS shows its node dead")
    p_restart = sub.add_parser("restart", help="start a killed host's Ray node again")
    p_restart.add_argument("host")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            _up(args)
        elif args.command == "down":
            result = testbed.down()
            counts = f"{len(result['namespaces'])} namespaces, {len(result['pids'])} processes"
            print(f"down in {result['down_s']} s: {counts}")
        elif args.command == "status":
            _status(args)
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("exec HOST -- CMD...")
            argv_ = testbed.exec_argv(args.host, cmd, env=not args.no_env)
            os.execvp(argv_[0], argv_)
        elif args.command == "kill":
            result = testbed.kill_host(args.host, wait_dead=args.wait)
            print(f"killed {len(result['pids'])} processes on {args.host} ({result['ip']})")
        elif args.command == "restart":
            result = testbed.restart_host(args.host)
            print(f"{args.host} ({result['ip']}) back as node {result['node_id']} in {result['restart_s']} s")
    except HostsError as e:
        print(f"hosts.py: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `hosts.py up | head -1`: the work is done, the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
