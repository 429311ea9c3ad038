"""The ``pdserve`` command line: validate, up, status, down, proxy (the proxy alone, without Ray), schema,
simulate (a spec's cluster on a request trace, no Ray), traces (write a trace) and profile
(measure a cluster's engines into a performance profile)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import ClusterNotRunning, PdserveError, SpecError

DEFAULT_PROXY_WORKERS = 1


def _print(*parts: object) -> None:
    print(*parts, flush=True)


class _EventPrinter:
    """Prints the controller's events as lines; on a terminal (``live``) also a last line, redrawn in place,
    with the phase each starting engine has reached (``status``)."""

    def __init__(self, live: bool | None = None) -> None:
        self.t0 = time.time()
        self.live = sys.stdout.isatty() if live is None else live
        self._line = ""

    def __call__(self, event: dict[str, Any]) -> None:
        self._erase()
        _print(f"[{event['t'] - self.t0:6.1f}s] {event['message']}")
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
    body = json.dumps(
        {"model": status["model"], "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    )
    return (
        f"pdserve: cluster {status['name']!r} is ready in {status['ready_s']:.1f}s; "
        f"OpenAI API at {url}/v1\n"
        f"  curl {url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"
    )


def cmd_validate(args: argparse.Namespace) -> int:
    from contract.wire import url_host
    from orchestrator.launch import plan_engines
    from orchestrator.placement import assign, host_plan
    from orchestrator.spec import ClusterSpec

    spec = ClusterSpec.from_file(args.config)
    engines = plan_engines(spec, host=None)
    _print(f"{args.config}: valid: cluster {spec.name!r}, model {spec.model_name!r}, connector {spec.connector}")
    placed = None
    if args.ray_address:
        from orchestrator.ray_head import cluster_nodes

        nodes = cluster_nodes(args.ray_address)
        _print(f"  placed on the Ray cluster at {args.ray_address} ({sum(n.alive for n in nodes)} alive nodes):")
        placed = assign(spec, nodes)
    for line in host_plan(spec, engines, placed):
        _print(line)
    _print(f"  proxy      listens on {url_host(spec.proxy.host)}:{spec.proxy.port}")
    if spec.autoscaling is not None:
        from orchestrator.cluster import autoscaling_profile

        on = autoscaling_profile(spec, args.config) is not None
        mode = f"on, profile {spec.profile_path(args.config)}" if on else "off (no autoscaling.profile)"
        _print(
            f"  autoscaler {mode}"
            f"; prefill {spec.min_replicas('prefill')}..{spec.max_replicas('prefill')}, "
            f"decode {spec.min_replicas('decode')}..{spec.max_replicas('decode')}"
        )
    return 1 if placed is not None and placed[1] else 0


def _follow(get_status: Callable[[], dict[str, Any]], printer: _EventPrinter, seen: int) -> None:
    """Foreground `up`: keep printing the cluster's events until Ctrl-C or SIGTERM."""
    while True:
        time.sleep(1.0)
        status = get_status()
        for event in status["events"][seen:]:
            printer(event)
        seen = len(status["events"])


def cmd_up(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    printer = _EventPrinter()

    def on_ready_wait(get_status: Callable[[], dict[str, Any]]) -> None:
        status = get_status()
        _print(_usage_hint(status))
        _print("pdserve: press Ctrl-C to stop the cluster")
        try:
            _follow(get_status, printer, len(status["events"]))
        except KeyboardInterrupt:
            _print("\npdserve: stopping the cluster")

    cluster.install_stop_signals()
    try:
        status = cluster.up(
            args.config, on_event=printer, follow=None if args.detach else on_ready_wait, on_status=printer.status
        )
    except KeyboardInterrupt:
        _print("pdserve: interrupted; the cluster was stopped")
        return 130
    if args.detach:
        _print(_usage_hint(status))
        _print("pdserve: running in the background; `pdserve status` shows it, `pdserve down` stops it")
    else:
        _print("pdserve: cluster stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    status = cluster.status()
    if args.json:
        _print(json.dumps(status, indent=2))
        return 0
    ready = f" (ready in {status['ready_s']:.1f}s)" if status["ready_s"] else ""
    _print(f"cluster {status['name']}: {status['phase']}{ready}")
    _print(f"model     {status['model']}   connector {status['connector']}")
    _print(f"proxy     {status['proxy_url']}")
    _print(f"logs      {status['log_dir']}")
    pools = status.get("pools", {})
    _print(
        "pools     "
        + ", ".join(
            f"{role} {p['ready']}/{p['target']} ready (max {p['max']}"
            + (f", {p['moving']} moving in" if p.get("moving") else "")
            + (f", {p['draining']} draining)" if p["draining"] else ")")
            for role, p in pools.items()
        )
    )
    _print(f"{'ENGINE':<11} {'ROLE':<8} {'STATE':<11} {'URL':<24} {'CORES':<6} {'LOAD':>7} {'RESTARTS':>8}")
    for e in status["engines"]:
        load = f"{e['load_s']:.1f}s" if e["load_s"] else "-"
        _print(
            f"{e['engine_id']:<11} {e['role']:<8} {e['state']:<11} {e['url'] or '-':<24} "
            f"{e['cpu_bind'] or '-':<6} {load:>7} {e['restarts']:>8}"
        )
    if moves := status.get("moves"):
        _print(
            "moves: "
            + "; ".join(
                time.strftime("%H:%M:%S ", time.localtime(m["at"]))
                + f"{m['engine_id']} {m['from']}->{m['to']} ({m['finishing_s']:.1f}s finishing, "
                f"{m['switch_s'] * 1000:.0f} ms switching)"
                for m in moves[-5:]
            )
        )
    if status.get("autoscaler"):
        _print_decisions(status["autoscaler"])
    if status["error"]:
        _print(f"error: {status['error']}")
    return 0


def _print_decisions(autoscaler: dict[str, Any], last: int = 3) -> None:
    """The autoscaler's last decisions, newest last, each with what it saw and why."""
    decisions = autoscaler["decisions"]
    _print(
        f"autoscaler: a decision every {autoscaler['interval_s']:g}s; "
        f"the last {min(last, len(decisions))} of {len(decisions)}:"
    )
    for d in decisions[-last:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["t"]))
        seen = d["observed"]
        ttft = "-" if seen["ttft_p90_s"] is None else f"{seen['ttft_p90_s']:.2f}s"
        itl = "-" if seen["itl_p90_s"] is None else f"{seen['itl_p90_s'] * 1000:.0f}ms"
        change = ", ".join(f"{role} {a}->{b}" for role, (a, b) in d["changed"].items()) or "no change"
        _print(
            f"  {when} prefill {d['prefill']} decode {d['decode']} ({change}); saw {seen['arrival_rps']:.2f} req/s, "
            f"p90 TTFT {ttft}, p90 ITL {itl}"
        )
        for reason in d["reasons"]:
            _print(f"      {reason}")
        if d.get("error"):
            _print(f"      could not scale: {d['error']}")
    if changes := autoscaler.get("changes"):
        _print(
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
        status = cluster.move(source, destination, int(count or 1), on_event=_EventPrinter(), wait=not args.no_wait)
    else:
        targets: dict[str, int] = {}
        for item in args.targets:
            role, sep, count = item.partition("=")
            if not sep or role not in ("prefill", "decode") or not count.isdigit():
                print(f"pdserve scale: {item!r}: expected prefill=N or decode=N", file=sys.stderr)
                return 2
            targets[role] = int(count)
        status = cluster.scale(targets, on_event=_EventPrinter(), wait=not args.no_wait)
    sizes = ", ".join(f"{role} {p['ready']}/{p['target']} ready" for role, p in status["pools"].items())
    _print(f"pdserve: {sizes}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator import cluster

    for line in cluster.down():
        _print(f"pdserve: {line}")
    return 0


def proxy_settings(args: argparse.Namespace) -> Any:
    """``pdserve proxy``'s settings: ``--config FILE``'s, with the flags given laid over them."""
    from pydantic import ValidationError

    from orchestrator.errors import read_mapping
    from orchestrator.model_flags import given, overlay
    from proxy.config import ProxySettings

    source = args.config or "the command line"
    raw = read_mapping(args.config) if args.config else {}
    try:
        return ProxySettings.model_validate(overlay(raw, given(args)))
    except ValidationError as e:
        raise SpecError.of(source, e) from e


def cmd_proxy(args: argparse.Namespace) -> int:
    import logging

    from proxy.admin import parse_networks
    from proxy.auth import load_engine_key, load_keys
    from proxy.config import ProxyConfig
    from proxy.errors import ProxyConfigError
    from proxy.server import serve
    from proxy.standalone import (
        StandaloneError,
        StandaloneSettings,
        app_factory,
        model_name_from_engines,
        normalize_url,
        parse_kv_endpoints,
    )

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from contract.auth import PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV, SECRET_ENV, SECRET_FILE_ENV

    try:
        settings = proxy_settings(args)
    except SpecError as e:
        print(f"pdserve proxy: invalid settings:\n{e}", file=sys.stderr)
        return 2
    # The workers inherit these; only the files' names travel. The engine key alone is enough (least
    # privilege: `pdserve secret PATH --engine-key-file OUT`); a secret file is read only to derive it.
    if args.engine_key_file:
        os.environ[PROXY_ENGINE_KEY_FILE_ENV] = args.engine_key_file
    if args.cluster_secret_file:
        os.environ[SECRET_FILE_ENV] = args.cluster_secret_file
    engine_auth = any(
        os.environ.get(name) for name in (PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV, SECRET_ENV, SECRET_FILE_ENV)
    )
    try:
        prefill = [normalize_url(url) for url in args.prefill]
        decode = [normalize_url(url) for url in args.decode]
        decode_kv = parse_kv_endpoints(args.decode_kv, len(decode))
        model = args.model or model_name_from_engines(
            prefill + decode,
            args.wait_s,
            engine_key=load_engine_key() if engine_auth else None,
            on_wait=lambda missing: _print(
                f"pdserve proxy: waiting up to {args.wait_s:g}s for {', '.join(missing)} to answer /v1/models "
                "(--model skips this)"
            ),
        )
    except StandaloneError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 1
    config = ProxyConfig.of(settings, model_name=model, engine_auth=engine_auth, max_model_len=args.max_model_len)
    try:  # here, not only in each worker: a key that cannot be read stops the command with its reason
        load_keys(config.api_key_env, config.api_key_file)
        load_keys(config.admin_key_env, config.admin_key_file)
        parse_networks(config.admin_engine_networks)
        if engine_auth:
            load_engine_key()
    except ProxyConfigError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 1
    standalone = StandaloneSettings(tuple(prefill), tuple(decode), config, decode_kv)

    def ready(url: str) -> None:
        _print(f"pdserve proxy: serving {model!r} on {url}/v1 ({args.workers} worker(s))")
        _print(f"  prefill: {' '.join(prefill)}")
        _print(f"  decode:  {' '.join(decode)}")
        _print(f"  routing: prefill {config.routing.prefill}, decode {config.routing.decode}")

    try:
        return serve(app_factory(standalone), config.host, config.port, args.workers, on_ready=ready)
    except OSError as e:
        print(f"pdserve proxy: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1


def cmd_schema(args: argparse.Namespace) -> int:
    from orchestrator import reference

    _print(
        reference.markdown().rstrip("\n") if args.markdown else json.dumps(reference.json_schema(args.which), indent=2)
    )
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
        _print(f"pdserve secret: {path} already holds a cluster secret; kept")
    else:
        secret = new_secret()
        write_secret(path, secret)
        _print(f"pdserve secret: wrote a new cluster secret to {path} (mode 0600)")
    if args.engine_key_file:
        key_path = Path(args.engine_key_file)
        write_private(key_path, engine_key(secret) + "\n")  # 0600, even over an older file of another mode
        _print(
            f"pdserve secret: wrote its engine key to {key_path} (engines: {ENGINE_KEY_ENV}=$(cat {key_path}); "
            f"a proxy: pdserve proxy --engine-key-file {key_path})"
        )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from orchestrator.autoscale.runner import load_spec_and_profile, parse_policy, simulate_spec
    from orchestrator.autoscale.traces import read_trace

    static = parse_policy(args.policy)
    spec, profile = load_spec_and_profile(args.config, args.profile)
    if args.plot:
        from orchestrator.autoscale.plot import require_matplotlib

        require_matplotlib()  # fail before simulating, not after
    result = simulate_spec(spec, profile, read_trace(args.trace), static, moves=not args.no_moves)
    summary = result.summary()
    if args.json:
        _print(json.dumps(result.to_json(), indent=2))
    else:
        _print(f"{args.trace}: {args.policy} on {args.config} (profile {profile.name})")
        _print(f"  requests                 {summary['requests']}")
        _print(f"  SLO attainment           {summary['slo_attainment']:.2%}")
        _print(f"  goodput                  {summary['goodput_rps']:.2f} req/s")
        _print(f"  engine-hours             {summary['engine_hours']:.2f}")
        _print(f"  goodput per engine-hour  {summary['goodput_per_engine_hour']:.0f} requests")
        _print(f"  p90 TTFT / ITL           {summary['ttft_p90_s']:.3f} s / {summary['itl_p90_s'] * 1000:.1f} ms")
        changes = [
            row for i, row in enumerate(result.timeline) if i == 0 or _split(row) != _split(result.timeline[i - 1])
        ]
        _print(f"  replica changes          {len(changes) - 1}")
    if args.plot:
        from orchestrator.autoscale.plot import plot_result

        plot_result(result, args.plot, title=f"{args.policy} on {args.trace}")
        if not args.json:
            _print(f"  plot                     {args.plot}")
    return 0


def _split(row: dict[str, Any]) -> tuple[int, int]:
    return row["prefill"], row["decode"]


def cmd_traces(args: argparse.Namespace) -> int:
    from orchestrator.autoscale import traces

    mix = traces.MIXES[args.mix]
    if args.kind == "poisson":
        requests = traces.poisson(args.rate, args.duration, mix=mix, seed=args.seed)
    elif args.kind == "bursty":
        requests = traces.bursty(
            args.rate,
            args.duration,
            burst_factor=args.burst_factor,
            mean_burst_s=args.mean_burst_s,
            mean_gap_s=args.mean_gap_s,
            ramp_s=args.ramp_s,
            mix=mix,
            seed=args.seed,
        )
    else:
        requests = traces.diurnal(args.rate, args.peak, args.duration, period_s=args.period_s, mix=mix, seed=args.seed)
    n = traces.write_trace(requests, args.out)
    _print(f"pdserve traces: wrote {n} requests ({args.kind}, {args.mix} mix, seed {args.seed}) to {args.out}")
    return 0


def default_profile_path(config: str, name: str) -> Path:
    """``configs/local-cpu.yaml`` -> ``configs/profiles/local-cpu.yaml``: beside the shipped profiles."""
    return Path(config).resolve().parent / "profiles" / f"{name}.yaml"


def cmd_profile(args: argparse.Namespace) -> int:
    import asyncio

    from orchestrator import cluster
    from orchestrator.autoscale import profiler
    from orchestrator.autoscale.profile import load_profile
    from orchestrator.spec import ClusterSpec

    spec = ClusterSpec.from_file(args.config)
    grid = profiler.grid_with(
        profiler.QUICK_GRID if args.quick else profiler.DEFAULT_GRID,
        prefill_tokens=args.prefill_tokens,
        prefill_batch=args.prefill_batch,
        decode_batch=args.decode_batch,
        decode_context=args.decode_context,
        transfer_tokens=args.transfer_tokens,
        repeats=args.repeats,
        decode_tokens=args.decode_tokens,
    )
    grid.check(*profiler.batch_limits(spec), spec.engine.max_model_len, spec.proxy.decode_only_below_tokens)
    out = Path(args.out) if args.out else default_profile_path(args.config, spec.name)
    started_here = False
    try:
        status = cluster.status()
    except ClusterNotRunning:
        _print(f"pdserve profile: no cluster is running; starting {args.config} (stopped again at the end)")
        status = cluster.up(args.config, on_event=_EventPrinter())
        started_here = True
    try:
        running = (status["name"], status["model"], status["connector"])
        if running != (spec.name, spec.model_name, spec.connector):
            raise PdserveError(
                f"the running cluster {running[0]!r} (model {running[1]!r}, connector {running[2]}) is not the one "
                f"{args.config} describes; `pdserve down` it first"
            )
        from contract.auth import engine_key
        from orchestrator.state import load_cluster_secret

        endpoints = profiler.ClusterEndpoints.from_status(status, engine_key(load_cluster_secret()))
        engines = f"{endpoints.prefill_url} (prefill), {endpoints.decode_url} (decode), {endpoints.proxy_url} (proxy)"
        _print(f"pdserve profile: measuring {engines}")
        profile = asyncio.run(
            profiler.measure(spec, endpoints, grid, name=args.name, on_progress=lambda line: _print("  " + line))
        )
    finally:
        if started_here:
            for line in cluster.down():
                _print(f"pdserve: {line}")
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    load_profile(out)  # what was written is what `simulate` and the autoscaler will read
    _print(f"pdserve profile: wrote {out}")
    for line in profiler.format_profile(profile):
        _print("  " + line)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value:g}")
    return value


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command``, the other commands' heavy options (whose defaults import the
    proxy, the profiler, the traces) are left out, so that ``pdserve status`` starts in a fraction of a second."""

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode serving on Ray-managed vLLM engines."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check a cluster spec and show the engines it plans")
    validate.add_argument("config")
    validate.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="also place the plan on this running Ray cluster's nodes (labels, resources, GPUs) and show it per host",
    )
    validate.set_defaults(func=cmd_validate)
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
    scale.add_argument("--no-wait", action="store_true", help="return once the change has started")
    scale.set_defaults(func=cmd_scale)
    down = commands.add_parser("down", help="stop the running cluster and everything it started")
    down.set_defaults(func=cmd_down)
    proxy = commands.add_parser(
        "proxy",
        help="run the P/D proxy alone (no Ray) in front of vLLM servers started with a KV connector",
        description="Serve the OpenAI API; send each request's prefill to a --prefill server and its decode "
        "to a --decode server (round robin, or as --routing-prefill / --routing-decode say), carrying the KV "
        "transfer parameters between them.",
    )
    proxy.set_defaults(func=cmd_proxy)
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
    schema = commands.add_parser(
        "schema",
        help="print the JSON schema of a cluster spec or of `pdserve proxy --config` (editors validate YAML with it)",
    )
    schema.add_argument("which", nargs="?", choices=["cluster", "proxy"], default="cluster")
    schema.add_argument(
        "--markdown", action="store_true", help="print the configuration reference instead (docs/configuration.md)"
    )
    schema.set_defaults(func=cmd_schema)
    if wanted("proxy"):
        _add_proxy_args(proxy)
    simulate = commands.add_parser(
        "simulate",
        help="run a request trace through a model of the spec's cluster (no Ray, no engines)",
        description="Discrete-event simulation of the spec's cluster, timed by the autoscaling profile, "
        "driven by a JSON-lines trace of {t, prompt_tokens, output_tokens}.",
    )
    simulate.add_argument("config", help="cluster spec with an 'autoscaling' section")
    simulate.add_argument("--trace", required=True, metavar="FILE", help="JSON-lines request trace")
    simulate.add_argument(
        "--policy", default="autoscale", help="'autoscale' or 'static:P,D' fixed pools (default: %(default)s)"
    )
    simulate.add_argument("--profile", metavar="FILE", help="performance profile (default: autoscaling.profile)")
    simulate.add_argument(
        "--no-moves", action="store_true", help="engines never move between the pools (as with role_moves: false)"
    )
    simulate.add_argument("--json", action="store_true", help="print the results and the replica timeline as JSON")
    simulate.add_argument("--plot", metavar="FILE.png", help="draw load, replicas and latencies (needs matplotlib)")
    simulate.set_defaults(func=cmd_simulate)
    make_traces = commands.add_parser(
        "traces", help="write a synthetic request trace for `pdserve simulate` (deterministic with --seed)"
    )
    make_traces.set_defaults(func=cmd_traces)
    if wanted("traces"):
        _add_traces_args(make_traces)
    _add_profile_parser(commands, wanted("profile"))
    return parser


PROXY_FLAG_ALIASES = {
    "routing.prefill": ("--prefill-policy",),
    "routing.decode": ("--decode-policy",),
    "routing.prefix_overload_factor": ("--prefix-overload-factor",),
    "admin_engine_networks": ("--admin-engine-network",),
}
"""The flags these settings had before the flags were generated from ``ProxySettings``; they still work."""


def _add_proxy_args(proxy: argparse.ArgumentParser) -> None:
    from orchestrator.model_flags import add_model_flags
    from proxy.config import ProxySettings

    engines = proxy.add_argument_group("engines (pdserve proxy only)")
    engines.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers' URLs")
    engines.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers' URLs")
    engines.add_argument(
        "--decode-kv", nargs="+", default=[], metavar="TCP[,TCP...]",
        help="for decode servers of the pdserve connector: each one's side channel, tcp://host:kv_port per TP "
        "rank (comma-separated), one value per --decode server in its order; streams then carry X-PDServe-KV",
    )  # fmt: skip
    engines.add_argument("--model", help="the served model's name (default: asked from the engines' /v1/models)")
    engines.add_argument(
        "--wait-s",
        type=float,
        default=600.0,
        help="without --model: how long to wait for the engines to answer /v1/models (default: %(default)s)",
    )
    engines.add_argument(
        "--max-model-len", type=_positive_int, help="the engines' context length: refuse what plainly exceeds it"
    )
    engines.add_argument(
        "--engine-key-file", metavar="PATH",
        help="the engines' key, which the proxy sends them (`pdserve secret SECRET --engine-key-file PATH` "
        "writes it; or PDSERVE_ENGINE_KEY): all the proxy needs, rather than the cluster secret",
    )  # fmt: skip
    engines.add_argument(
        "--cluster-secret-file", metavar="PATH",
        help="the cluster secret (`pdserve secret PATH` makes one; or PDSERVE_CLUSTER_SECRET): the proxy sends "
        "the engine key derived from it (hand-started engines: VLLM_API_KEY from "
        "`pdserve secret PATH --engine-key-file OUT`); --engine-key-file, when given, is used instead",
    )  # fmt: skip
    engines.add_argument(
        "--workers", type=_positive_int, default=DEFAULT_PROXY_WORKERS, help="proxy processes (default: %(default)s)"
    )
    settings = proxy.add_argument_group(
        "settings (a cluster spec's `proxy` section; keys are read from the environment or a file, never the "
        "command line)"
    )
    settings.add_argument(
        "--config", metavar="FILE",
        help="a YAML file of these settings, keyed as a cluster spec's `proxy` section (`pdserve schema proxy`); "
        "flags override it",
    )  # fmt: skip
    add_model_flags(settings, ProxySettings, PROXY_FLAG_ALIASES)


def _add_traces_args(make_traces: argparse.ArgumentParser) -> None:
    from orchestrator.autoscale.traces import MIXES

    make_traces.add_argument("kind", choices=["poisson", "bursty", "diurnal"])
    make_traces.add_argument("--out", required=True, metavar="FILE", help="JSON-lines file to write")
    make_traces.add_argument("--duration", type=float, default=3600.0, help="seconds (default: %(default)s)")
    make_traces.add_argument(
        "--rate",
        type=float,
        default=10.0,
        help="req/s: the rate, bursty's base, diurnal's trough (default: %(default)s)",
    )
    make_traces.add_argument("--peak", type=float, default=40.0, help="diurnal: peak req/s (default: %(default)s)")
    make_traces.add_argument("--period-s", type=float, default=86400.0, help="diurnal: period (default: %(default)s)")
    make_traces.add_argument("--burst-factor", type=float, default=3.0, help="bursty: rate x (default: %(default)s)")
    make_traces.add_argument("--mean-burst-s", type=float, default=180.0, help="bursty (default: %(default)s)")
    make_traces.add_argument("--mean-gap-s", type=float, default=600.0, help="bursty (default: %(default)s)")
    make_traces.add_argument("--ramp-s", type=float, default=0.0, help="bursty: rise time (default: %(default)s)")
    make_traces.add_argument("--mix", choices=sorted(MIXES), default="chat", help="length mix (default: %(default)s)")
    make_traces.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")


def _add_profile_parser(commands: Any, with_args: bool) -> None:
    def axis(grid: Any, name: str) -> str:
        return " ".join(map(str, getattr(grid, name)))

    profile = commands.add_parser(
        "profile",
        help="measure the cluster's engines and write a performance profile for `simulate` and the autoscaler",
        description="Measure prefill pass time (by tokens and batch), decode step time (by batch and context) "
        "and KV transfer time (by bytes) on the real engines, and write a pdserve-profile/1 file. Uses the "
        "running cluster if there is one (it must be the one CONFIG describes); otherwise starts CONFIG's "
        "cluster and stops it at the end. Nothing else should use the engines meanwhile.",
    )
    profile.set_defaults(func=cmd_profile)
    if not with_args:
        return
    from orchestrator.autoscale.profiler import DEFAULT_GRID, QUICK_GRID

    profile.add_argument("config", help="cluster spec (the engines' settings come from it)")
    profile.add_argument("--out", metavar="FILE", help="where to write (default: profiles/NAME.yaml beside CONFIG)")
    profile.add_argument("--name", help="the profile's name (default: the cluster's)")
    profile.add_argument(
        "--quick", action="store_true", help="a smaller grid, one run each: a smoke test, not a profile to ship"
    )
    grid = profile.add_argument_group("grid (defaults: full / --quick)")
    for name, help_text in (
        ("prefill_tokens", "prompt tokens of one prefill pass"),
        ("prefill_batch", "sequences sharing that pass"),
        ("decode_batch", "sequences decoding together"),
        ("decode_context", "their prompt tokens"),
        ("transfer_tokens", "prompt tokens of the disaggregated requests timed"),
    ):
        grid.add_argument(
            "--" + name.replace("_", "-"), type=_positive_int, nargs="+", metavar="N",
            help=f"{help_text} ({axis(DEFAULT_GRID, name)} / {axis(QUICK_GRID, name)})",
        )  # fmt: skip
    grid.add_argument(
        "--repeats", type=_positive_int, help=f"runs of each point ({DEFAULT_GRID.repeats} / {QUICK_GRID.repeats})"
    )
    grid.add_argument(
        "--decode-tokens", type=_positive_int, metavar="N",
        help=f"output tokens of each decode request ({DEFAULT_GRID.decode_tokens} / {QUICK_GRID.decode_tokens})",
    )  # fmt: skip


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


if __name__ == "__main__":
    sys.exit(main())
