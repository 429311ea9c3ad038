"""The commands of a running cluster: ``pdserve up``, ``status``, ``scale``, ``down``, and ``secret`` (a cluster
secret for engines and a proxy started by hand). They reach the cluster's controller over its HTTP API
(``orchestrator.cluster``); what they print while they wait is the controller's events (``EventPrinter``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.cli.common import say


def add_commands(commands: Any, wanted: Any) -> None:
    up = commands.add_parser(
        "up",
        help="start the cluster a spec describes",
        description="Start the cluster a spec describes. Its cluster secret is new, unless PDSERVE_CLUSTER_SECRET "
        "or PDSERVE_CLUSTER_SECRET_FILE gives one (`pdserve secret PATH` makes one). A KV tier keeps what it "
        "stored across `down` and `up` whatever the secret: its entries are MAC'd under the tier's own key.",
    )
    up.add_argument("config")
    up.add_argument("--detach", "-d", action="store_true", help="return once ready; `pdserve down` stops it")
    up.set_defaults(func=cmd_up)
    status = commands.add_parser("status", help="show the running cluster")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    scale = commands.add_parser(
        "scale",
        help="resize the pools of the running cluster: pdserve scale prefill=2 decode=1",
        description="Grow a pool (start engines; each joins the proxy when ready) or shrink it (engines leave "
        "the proxy at once, finish their requests, hand over their KV, then stop); or move ready engines from "
        "one pool to the other without restarting them (--move). Waits until done.",
    )
    scale.add_argument("targets", nargs="*", metavar="POOL=N", help="prefill=N and/or decode=N")
    scale.add_argument(
        "--move",
        metavar="FROM->TO[=N]",
        help="move N (default 1) ready engines between the pools, e.g. prefill->decode=2: each leaves FROM's "
        "routing at once, finishes its work there, then serves TO (pools of one shape; spec role_moves)",
    )
    scale.add_argument(
        "--model", metavar="NAME", help="the model whose pools change (its served name or key): a cluster of several"
    )
    scale.add_argument("--no-wait", action="store_true", help="return once the change has started")
    scale.set_defaults(func=cmd_scale)
    down = commands.add_parser("down", help="stop the running cluster and everything it started")
    down.set_defaults(func=cmd_down)
    secret = commands.add_parser(
        "secret",
        help="make a cluster secret file for engines and a proxy started by hand (`pdserve up` makes its own)",
        description="Writes a new random cluster secret to PATH (mode 0600) unless PATH holds one; prints no "
        "secret. Engines read it from PDSERVE_CLUSTER_SECRET_FILE (the pdserve connector's side channels and "
        "transfer parameters); `pdserve proxy --cluster-secret-file PATH` sends engines the key derived from it.",
    )
    secret.add_argument("path", metavar="PATH")
    secret.add_argument("--engine-key-file", metavar="OUT", help="also write the engines' API key (mode 0600)")
    secret.set_defaults(func=cmd_secret)


class EventPrinter:
    """Prints the controller's events as lines; on a terminal (``live``) also a last line, redrawn in place,
    with the phase each starting engine has reached (``status``)."""

    def __init__(self, live: bool | None = None) -> None:
        self.t0 = time.time()
        self.live = sys.stdout.isatty() if live is None else live
        self._line = ""

    def __call__(self, event: dict[str, Any]) -> None:
        self._erase()
        say(f"[{event['t'] - self.t0:6.1f}s] {event['message']}")
        self._draw()

    def status(self, status: dict[str, Any]) -> None:
        if not self.live:
            return
        starting = [e for e in status.get("engines", []) if e["state"] in ("pending", "starting")]
        parts = [f"{e['engine_id']}: {(e.get('phases') or [{'phase': 'asked for'}])[-1]['phase']}" for e in starting]
        self._erase()
        self._line = f"[{time.time() - self.t0:6.1f}s] starting: " + "; ".join(parts) if parts else ""
        self._draw()

    def _erase(self) -> None:
        if self.live and self._line:
            sys.stdout.write("\r\033[K")

    def _draw(self) -> None:
        if self.live and self._line:
            sys.stdout.write(self._line[: shutil.get_terminal_size().columns - 1])
            sys.stdout.flush()


def _usage_hint(status: dict[str, Any]) -> str:
    url = status["proxy_url"]
    model = (status.get("models") or [{"name": status["model"]}])[0]["name"]  # several: the first
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return (
        f"pdserve: cluster {status['name']!r} is ready in {status['ready_s']:.1f}s; "
        f"OpenAI API at {url}/v1\n"
        f"  curl {url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"
    )


def _follow(get_status: Callable[[], dict[str, Any]], printer: EventPrinter, seen: int) -> None:
    """Foreground `up`: keep printing the cluster's events until Ctrl-C or SIGTERM."""
    while True:
        time.sleep(1.0)
        status = get_status()
        for event in status["events"][seen:]:
            printer(event)
        seen = len(status["events"])


def cmd_up(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    printer = EventPrinter()

    def on_ready_wait(get_status: Callable[[], dict[str, Any]]) -> None:
        status = get_status()
        say(_usage_hint(status))
        say("pdserve: press Ctrl-C to stop the cluster")
        try:
            _follow(get_status, printer, len(status["events"]))
        except KeyboardInterrupt:
            say("\npdserve: stopping the cluster")

    cluster.install_stop_signals()
    try:
        status = cluster.up(
            args.config, on_event=printer, follow=None if args.detach else on_ready_wait, on_status=printer.status
        )
    except KeyboardInterrupt:
        say("pdserve: interrupted; the cluster was stopped")
        return 130
    if args.detach:
        say(_usage_hint(status))
        say("pdserve: running in the background; `pdserve status` shows it, `pdserve down` stops it")
    else:
        say("pdserve: cluster stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    status = cluster.status()
    if args.json:
        say(json.dumps(status, indent=2))
        return 0
    ready = f" (ready in {status['ready_s']:.1f}s)" if status["ready_s"] else ""
    say(f"cluster {status['name']}: {status['phase']}{ready}")
    say(f"model     {status['model']}   connector {status['connector']}")
    say(f"proxy     {status['proxy_url']}")
    say(f"logs      {status['log_dir']}")
    models = status.get("models") or [{"name": status["model"], "pools": status.get("pools", {})}]
    for model in models:
        pools = model["pools"]
        say(
            ("pools     " if len(models) == 1 else f"{model['name']}: ")
            + ", ".join(
                f"{role} {p['ready']}/{p['target']} ready (max {p['max']}"
                + (f", {p['moving']} moving in" if p.get("moving") else "")
                + (f", {p['draining']} draining)" if p["draining"] else ")")
                for role, p in pools.items()
            )
        )
    width = max([11, *(len(e["engine_id"]) for e in status["engines"])])
    say(f"{'ENGINE':<{width}} {'ROLE':<8} {'STATE':<11} {'URL':<24} {'CORES':<6} {'LOAD':>7} {'RESTARTS':>8}")
    for e in status["engines"]:
        load = f"{e['load_s']:.1f}s" if e["load_s"] else "-"
        say(
            f"{e['engine_id']:<{width}} {e['role']:<8} {e['state']:<11} {e['url'] or '-':<24} "
            f"{e['cpu_bind'] or '-':<6} {load:>7} {e['restarts']:>8}"
        )
    for e in status["engines"]:
        if blocks := e.get("kv_quarantined_blocks"):
            say(
                f"{e['engine_id']} has {blocks} KV block(s) quarantined: an aborted KV read may still land in them, "
                "so they are out of use until the engine restarts"
            )
    if moves := status.get("moves"):
        say(
            "moves: "
            + "; ".join(
                time.strftime("%H:%M:%S ", time.localtime(m["at"]))
                + f"{m['engine_id']} {m['from']}->{m['to']} ({m['finishing_s']:.1f}s finishing, "
                f"{m['switch_s'] * 1000:.0f} ms switching)"
                for m in moves[-5:]
            )
        )
    for model in status.get("models") or [{"name": status["model"], "autoscaler": status.get("autoscaler")}]:
        if model.get("autoscaler"):
            if len(status.get("models") or ()) > 1:
                say(f"{model['name']}:")
            _print_decisions(model["autoscaler"])
    if status["error"]:
        say(f"error: {status['error']}")
    return 0


def _print_decisions(autoscaler: dict[str, Any], last: int = 3) -> None:
    """The autoscaler's last decisions, newest last, each with what it saw and why."""
    decisions = autoscaler["decisions"]
    say(
        f"autoscaler: a decision every {autoscaler['interval_s']:g}s; "
        f"the last {min(last, len(decisions))} of {len(decisions)}:"
    )
    for d in decisions[-last:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["t"]))
        seen = d["observed"]
        ttft = "-" if seen["ttft_p90_s"] is None else f"{seen['ttft_p90_s']:.2f}s"
        itl = "-" if seen["itl_p90_s"] is None else f"{seen['itl_p90_s'] * 1000:.0f}ms"
        change = ", ".join(f"{role} {a}->{b}" for role, (a, b) in d["changed"].items()) or "no change"
        say(
            f"  {when} prefill {d['prefill']} decode {d['decode']} ({change}); saw {seen['arrival_rps']:.2f} req/s, "
            f"p90 TTFT {ttft}, p90 ITL {itl}"
        )
        for reason in d["reasons"]:
            say(f"      {reason}")
        if d.get("error"):
            say(f"      could not scale: {d['error']}")
    if changes := autoscaler.get("changes"):
        say(
            "autoscaler changes: "
            + "; ".join(
                time.strftime("%H:%M:%S ", time.localtime(c["t"]))
                + ", ".join(f"{role} {a}->{b}" for role, (a, b) in c["changed"].items())
                for c in changes[-5:]
            )
        )


def cmd_scale(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    if bool(args.targets) == bool(args.move):
        print("pdserve scale: give POOL=N targets or --move FROM->TO[=N], one of the two", file=sys.stderr)
        return 2
    if args.move:
        source, arrow, rest = args.move.partition("->")
        destination, sep, count = rest.partition("=")
        if not arrow or {source, destination} != {"prefill", "decode"} or (sep and not count.isdigit()):
            print(f"pdserve scale: --move {args.move!r}: expected prefill->decode[=N] or decode->prefill[=N]",
                  file=sys.stderr)  # fmt: skip
            return 2
        status = cluster.move(
            source, destination, int(count or 1), on_event=EventPrinter(), wait=not args.no_wait, model=args.model
        )
    else:
        targets: dict[str, int] = {}
        for item in args.targets:
            role, sep, count = item.partition("=")
            if not sep or role not in ("prefill", "decode") or not count.isdigit():
                print(f"pdserve scale: {item!r}: expected prefill=N or decode=N", file=sys.stderr)
                return 2
            targets[role] = int(count)
        status = cluster.scale(targets, on_event=EventPrinter(), wait=not args.no_wait, model=args.model)
    pools = cluster.model_pools(status, args.model)
    sizes = ", ".join(f"{role} {p['ready']}/{p['target']} ready" for role, p in pools.items())
    say(f"pdserve: {args.model + ': ' if args.model else ''}{sizes}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    for line in cluster.down():
        say(f"pdserve: {line}")
    return 0


def cmd_secret(args: argparse.Namespace) -> int:
    """Make a cluster secret file (mode 0600), or keep the one there; never prints the secret."""
    from contract.auth import ENGINE_KEY_ENV, MissingSecret, engine_key, new_secret, read_secret_file, write_secret
    from contract.private_files import write_private

    path = Path(args.path)
    if path.exists():
        try:
            secret = read_secret_file(path)
        except MissingSecret as e:
            print(f"pdserve secret: {e}", file=sys.stderr)
            return 1
        say(f"pdserve secret: {path} already holds a cluster secret; kept")
    else:
        secret = new_secret()
        write_secret(path, secret)
        say(f"pdserve secret: wrote a new cluster secret to {path} (mode 0600)")
    if args.engine_key_file:
        key_path = Path(args.engine_key_file)
        write_private(key_path, engine_key(secret) + "\n")  # 0600, even over an older file of another mode
        say(
            f"pdserve secret: wrote its engine key to {key_path} (engines: {ENGINE_KEY_ENV}=$(cat {key_path}); "
            f"a proxy: pdserve proxy --engine-key-file {key_path})"
        )
    return 0
