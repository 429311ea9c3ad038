"""The autoscaling commands: ``pdserve profile`` (measure a cluster's engines into a performance profile),
``simulate`` (a spec's cluster on a request trace, no Ray) and ``traces`` (write a synthetic trace)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from orchestrator.cli.cluster import EventPrinter
from orchestrator.cli.common import positive_int, say
from orchestrator.errors import ClusterNotRunning, PdserveError


def add_commands(commands: Any, wanted: Any) -> None:
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
    simulate.add_argument("--model", metavar="NAME", help="a spec of several models: the model to simulate")
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


def cmd_simulate(args: argparse.Namespace) -> int:
    from orchestrator.autoscale.runner import load_spec_and_profile, parse_policy, simulate_spec
    from orchestrator.autoscale.traces import read_trace

    static = parse_policy(args.policy)
    spec, profile = load_spec_and_profile(args.config, args.profile, args.model)
    if args.plot:
        from orchestrator.autoscale.plot import require_matplotlib

        require_matplotlib()  # fail before simulating, not after
    result = simulate_spec(spec, profile, read_trace(args.trace), static, moves=not args.no_moves)
    summary = result.summary()
    if args.json:
        say(json.dumps(result.to_json(), indent=2))
    else:
        say(f"{args.trace}: {args.policy} on {args.config} (profile {profile.name})")
        say(f"  requests                 {summary['requests']}")
        say(f"  SLO attainment           {summary['slo_attainment']:.2%}")
        say(f"  goodput                  {summary['goodput_rps']:.2f} req/s")
        say(f"  engine-hours             {summary['engine_hours']:.2f}")
        say(f"  goodput per engine-hour  {summary['goodput_per_engine_hour']:.0f} requests")
        say(f"  p90 TTFT / ITL           {summary['ttft_p90_s']:.3f} s / {summary['itl_p90_s'] * 1000:.1f} ms")
        changes = [
            row for i, row in enumerate(result.timeline) if i == 0 or _split(row) != _split(result.timeline[i - 1])
        ]
        say(f"  replica changes          {len(changes) - 1}")
    if args.plot:
        from orchestrator.autoscale.plot import plot_result

        plot_result(result, args.plot, title=f"{args.policy} on {args.trace}")
        if not args.json:
            say(f"  plot                     {args.plot}")
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
    say(f"pdserve traces: wrote {n} requests ({args.kind}, {args.mix} mix, seed {args.seed}) to {args.out}")
    return 0


def default_profile_path(config: str, name: str) -> Path:
    """``configs/local-cpu.yaml`` -> ``configs/profiles/local-cpu.yaml``: beside the shipped profiles."""
    return Path(config).resolve().parent / "profiles" / f"{name}.yaml"


def cmd_profile(args: argparse.Namespace) -> int:
    import asyncio

    from orchestrator import cluster
    from orchestrator.autoscale import profiler
    from orchestrator.autoscale.profile import load_profile
    from orchestrator.autoscale.profiler_grid import DEFAULT_GRID, QUICK_GRID, grid_with
    from orchestrator.autoscale.profiler_http import ClusterEndpoints
    from orchestrator.autoscale.profiler_readings import batch_limits
    from orchestrator.spec import ClusterSpec

    cluster_spec = ClusterSpec.from_file(args.config)
    spec = cluster_spec.view(args.model)  # the model measured
    grid = grid_with(
        QUICK_GRID if args.quick else DEFAULT_GRID,
        prefill_tokens=args.prefill_tokens,
        prefill_batch=args.prefill_batch,
        decode_batch=args.decode_batch,
        decode_context=args.decode_context,
        transfer_tokens=args.transfer_tokens,
        repeats=args.repeats,
        decode_tokens=args.decode_tokens,
    )
    grid.check(*batch_limits(spec), spec.engine.max_model_len, spec.proxy.decode_only_below_tokens)
    name = f"{spec.name}-{spec.key}" if spec.key else spec.name
    out = Path(args.out) if args.out else default_profile_path(args.config, name)
    started_here = False
    try:
        status = cluster.status()
    except ClusterNotRunning:
        say(f"pdserve profile: no cluster is running; starting {args.config} (stopped again at the end)")
        status = cluster.up(args.config, on_event=EventPrinter())
        started_here = True
    try:
        running = (status["name"], status["model"], status["connector"])
        if running != (cluster_spec.name, cluster_spec.model_name, cluster_spec.connector):
            raise PdserveError(
                f"the running cluster {running[0]!r} (model {running[1]!r}, connector {running[2]}) is not the one "
                f"{args.config} describes; `pdserve down` it first"
            )
        from contract.auth import engine_key
        from orchestrator.state import load_cluster_secret

        endpoints = ClusterEndpoints.from_status(status, engine_key(load_cluster_secret()), spec.model_name)
        engines = f"{endpoints.prefill_url} (prefill), {endpoints.decode_url} (decode), {endpoints.proxy_url} (proxy)"
        say(f"pdserve profile: measuring {engines}")
        profile = asyncio.run(
            profiler.measure(spec, endpoints, grid, name=args.name, on_progress=lambda line: say("  " + line))
        )
    finally:
        if started_here:
            for line in cluster.down():
                say(f"pdserve: {line}")
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    load_profile(out)  # what was written is what `simulate` and the autoscaler will read
    say(f"pdserve profile: wrote {out}")
    for line in profiler.format_profile(profile):
        say("  " + line)
    return 0


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
    from orchestrator.autoscale.profiler_grid import DEFAULT_GRID, QUICK_GRID

    profile.add_argument("config", help="cluster spec (the engines' settings come from it)")
    profile.add_argument("--out", metavar="FILE", help="where to write (default: profiles/NAME.yaml beside CONFIG)")
    profile.add_argument("--model", metavar="NAME", help="a spec of several models: the model whose engines to measure")
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
            "--" + name.replace("_", "-"), type=positive_int, nargs="+", metavar="N",
            help=f"{help_text} ({axis(DEFAULT_GRID, name)} / {axis(QUICK_GRID, name)})",
        )  # fmt: skip
    grid.add_argument(
        "--repeats", type=positive_int, help=f"runs of each point ({DEFAULT_GRID.repeats} / {QUICK_GRID.repeats})"
    )
    grid.add_argument(
        "--decode-tokens", type=positive_int, metavar="N",
        help=f"output tokens of each decode request ({DEFAULT_GRID.decode_tokens} / {QUICK_GRID.decode_tokens})",
    )  # fmt: skip
