"""What the host's unpinned processes take of the cores while the CPU demo streams answers: the proxy, the replay
client, Ray's daemons (none of them pinned; every engine's processes are, each to its cores); and where each
request's time goes on the way.

Starts ``--config`` (the autoscaled CPU demo by default, its autoscaler held still: prefill-0 on core 0, decode-0
on core 1), then for each of ``--rates`` replays a steady Poisson load of short prompts and long answers through
the proxy as ``validate_simulator.py`` does (``testlib.fidelity.replay_apart``: its client in a session of its own,
ahead of the engines), and reads from ``/proc`` the CPU seconds every process used in the middle ``--window`` of
it, by group: engines (pinned; also by part, ``api@C`` the engine actor's process with vLLM's HTTP server, ``core@C``
its engine core, on core C), proxy, client, Ray, other. Also idle, before the first load. Around each window it
reads the engines' and the proxy's ``/metrics`` (``TIMES``): per engine the mean queue, prefill, TTFT and KV load
times of the requests in it, and its steps; and the client's TTFT and ITL quantiles.

Its ``host``: the unpinned processes' use idle (cores) and their CPU seconds per answer token streamed (fitted by
least squares over the loads); ``api``: each API server's, per token and per request. On 2026-12-05 the host took
0.07-0.09 of the 2 cores at 144-309 answer tokens/s and each API server under 0.05 of its core
(``lab/results/host-cpu-probe.json``): neither explains why the cluster's latencies under load were longer than the
simulator's. The times did: decode-0's queue was 2 steps where the simulator has 1 (a load showed a step late,
``connector_options.load_wait_s``; before it, ``host-cpu-probe-no-wait.json``).

    python lab/probe_host_cpu.py [--rates 1,2,3] [--output 120] [--out lab/results/host-cpu-probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.probe_shared_start import up_held_still  # noqa: E402
from orchestrator.autoscale import traces  # noqa: E402
from orchestrator.autoscale.profile import load_profile  # noqa: E402
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402
from orchestrator.autoscale.traces import TraceRequest  # noqa: E402
from orchestrator.engine_metrics import scrape  # noqa: E402
from orchestrator.spec import ClusterSpec  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.fidelity import replay_apart  # noqa: E402

# Where a request's time goes, read off the engines' and the proxy's /metrics around each window: the mean of each
# histogram (its _sum over its _count), and the engine steps (a prefill pass or a decode step) and their tokens.
TIMES = {
    "queue_s": "vllm:request_queue_time_seconds",  # arrival at the engine core to its first scheduled step
    "prefill_s": "vllm:request_prefill_time_seconds",  # first scheduled to first token
    "ttft_s": "vllm:time_to_first_token_seconds",  # the engine's API server: request in to first token out
    "e2e_s": "vllm:e2e_request_latency_seconds",
    "kv_load_s": "pdserve:kv_transfer_seconds",  # a decode engine's read of one request's KV
    "proxy_ttft_s": "pdserve_proxy_time_to_first_token_seconds",
}
COUNTS = {"steps": "vllm:iteration_tokens_total_count", "step_tokens": "vllm:iteration_tokens_total_sum"}
GROUPS = ("engines", "proxy", "client", "ray", "other")
HOST = GROUPS[1:]  # the unpinned processes
SETTLE_S = 15.0  # a load runs this long before its window
COLD_PROFILE = "lab/results/autoscale-fidelity-cold-profile.yaml"  # the demo's, as its cold-room run had it


def group_of(proc: psutil.Process, cores: int) -> str:
    """Which of ``GROUPS`` a process counts in; an engine's (pinned) processes also by part and core:
    ``api@0`` for the engine actor's process on core 0 (vLLM's HTTP server and ``AsyncLLM``: tokenizing,
    detokenizing, streaming), ``core@0`` for its engine core and workers."""
    affinity = proc.cpu_affinity()
    if len(affinity) < cores:
        part = "api" if proc.cmdline()[:1] and proc.cmdline()[0].startswith("ray::") else "core"
        return f"{part}@{'+'.join(map(str, sorted(affinity)))}"
    line = " ".join(proc.cmdline())
    if "ProxyActor" in line:
        return "proxy"
    if "testlib.fidelity" in line:
        return "client"
    if "ray" in line.lower():
        return "ray"
    return "other"


def cpu_by_group() -> dict[int, tuple[str, float]]:
    """Every process now: its group and CPU seconds so far (children that ended are not counted)."""
    cores, table = psutil.cpu_count(), {}
    for proc in psutil.process_iter():
        try:
            times = proc.cpu_times()
            table[proc.pid] = (group_of(proc, cores), times.user + times.system)
        except (psutil.Error, OSError):
            continue
    return table


def measure(seconds: float) -> dict[str, float]:
    """Cores used by each group over ``seconds`` of wall time (1.0: one core busy); processes that started
    meanwhile count from zero."""
    before, began = cpu_by_group(), time.monotonic()
    time.sleep(seconds)
    after, wall = cpu_by_group(), time.monotonic() - began
    use = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, used) in after.items():
        cores = (used - before.get(pid, (group, 0.0))[1]) / wall
        use[group] = use.get(group, 0.0) + cores
        if group not in GROUPS:
            use["engines"] += cores
    return {group: round(cores, 3) for group, cores in sorted(use.items())}


def steady(rate: float, seconds: float, prompt: int, output: int, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` of requests all ``prompt`` tokens long, each answered in ``output`` tokens."""
    prompts, answers = traces.LengthDist(prompt, 0.0, prompt, prompt), traces.LengthDist(output, 0.0, output, output)
    fixed = traces.LengthMix("fixed", ((1.0, prompts, answers),))
    return traces.poisson(rate, seconds, fixed, seed=seed)


def read_metrics(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each ``urls`` entry's ``TIMES`` (_sum and _count) and ``COUNTS`` now."""
    names = [f"{n}{end}" for n in TIMES.values() for end in ("_sum", "_count")] + list(COUNTS.values())
    return {who: scrape(url, names, timeout_s=10) for who, url in urls.items()}


def times_between(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict:
    """Per engine (and the proxy) over a window: the mean of every ``TIMES`` histogram that counted something,
    and steps per second with their mean tokens."""
    out: dict[str, dict[str, float]] = {}
    for who, now in after.items():
        was, row = before[who], {}
        for key, name in TIMES.items():
            count = now[f"{name}_count"] - was[f"{name}_count"]
            if count > 0:
                row[key] = round((now[f"{name}_sum"] - was[f"{name}_sum"]) / count, 4)
        steps = now[COUNTS["steps"]] - was[COUNTS["steps"]]
        if steps > 0:
            row["steps_per_s"] = round(steps / seconds, 2)
            row["tokens_per_step"] = round((now[COUNTS["step_tokens"]] - was[COUNTS["step_tokens"]]) / steps, 2)
        out[who] = row
    return out


def streamed_per_s(answers: list[dict], start: float, end: float) -> tuple[float, float]:
    """Answer tokens streamed and requests sent per second within [start, end) of the wall clock, each answer's
    chunks taken as spread evenly over its stream."""
    tokens = 0.0
    for a in answers:
        if "failed" in a or a["chunks"] < 2:
            continue
        first = a["sent_at"] + a["ttft_s"]
        span = max(a["ended_at"] - first, 1e-9)
        overlap = max(0.0, min(end, a["ended_at"]) - max(start, first))
        tokens += a["chunks"] * overlap / span
    sent = sum(1 for a in answers if "failed" not in a and start <= a["sent_at"] < end)
    return tokens / (end - start), sent / (end - start)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def replay_into(done: dict, status: dict, trace: list[TraceRequest]) -> None:
    done["out"] = replay_apart(status["proxy_url"], status["model"], trace)


def fit(xs: list[float], ys: list[float]) -> float:
    """``k`` of ``y = k x`` by least squares through the origin: the unpinned processes' CPU seconds per answer
    token streamed from (host cores - idle) against tokens/s, an API server's from its own. (A term per request
    as well was tried for the host: over three loads it came out below zero.)"""
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)


def per_unit(rows: list[dict], idle: dict[str, float], group: str, unit: str) -> float:
    """``group``'s CPU seconds beyond its idle use per ``unit`` (``tokens_per_s``, ``requests_per_s``)."""
    return fit([r[unit] for r in rows], [r["cores"].get(group, 0.0) - idle.get(group, 0.0) for r in rows])


def simulate_probe(path: str, profile_path: str) -> list[dict]:
    """The simulator on each load of the probe's result at ``path``: the same Poisson trace (seed: the load's
    index), prefill-0 on core 0 and decode-0 on core 1 held still; TTFT and ITL quantiles of the requests sent
    in the window, beside the cluster's."""
    with open(path) as f:
        probe = json.load(f)
    spec, profile = ClusterSpec.from_file(probe["config"]), load_profile(profile_path)
    cores = {"prefill-0": frozenset({(0, 0)}), "decode-0": frozenset({(0, 1)})}
    window = probe.get("window", 40.0)
    rows = []
    for n, load in enumerate(probe["loads"]):
        trace = steady(load["rate"], SETTLE_S + window + 10, probe["prompt"], probe["output"], seed=n)
        records = simulate_spec(spec, profile, trace, (1, 1), cores=cores).records
        inside = [r for r in records if SETTLE_S <= r.arrival < SETTLE_S + window]
        row = {"rate": load["rate"]}
        for key, values in (("ttft", [r.ttft_s for r in inside]), ("itl", [r.itl_s for r in inside])):
            for q in (0.5, 0.9):
                name = f"{key}_p{round(100 * q)}_s"
                if name in load:
                    row[name] = {"cluster": load[name], "simulator": round(quantile(values, q), 4)}
                    row[name]["ratio"] = round(row[name]["simulator"] / load[name], 2)
        rows.append(row)
        print(json.dumps(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu-autoscale.yaml")
    parser.add_argument("--rates", default="1,2,3", help="requests per second, one steady load each")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=120, help="answer tokens per request")
    parser.add_argument("--window", type=float, default=40.0, help="seconds of each load whose CPU is read")
    parser.add_argument("--out", metavar="FILE", help="also write the result here (JSON)")
    parser.add_argument(
        "--simulate", metavar="FILE", help="no cluster: the simulator on the loads of a result written by --out"
    )
    parser.add_argument("--profile", default=COLD_PROFILE, help="the profile --simulate times the engines by")
    args = parser.parse_args()
    if args.simulate:
        simulate_probe(args.simulate, args.profile)
        return

    config = up_held_still(args.config)
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        urls = {e["engine_id"]: e["url"] for e in status["engines"]} | {"proxy": status["proxy_url"]}
        time.sleep(SETTLE_S)
        idle = measure(args.window / 2)
        idle_host = sum(idle[g] for g in HOST)
        print(f"idle: {idle}", flush=True)
        rows = []
        for n, rate in enumerate(float(r) for r in args.rates.split(",")):
            trace = steady(rate, SETTLE_S + args.window + 10, args.prompt, args.output, seed=n)
            done: dict = {}
            thread = threading.Thread(target=replay_into, args=(done, status, trace))
            thread.start()
            time.sleep(SETTLE_S)
            start, metrics_before = time.time(), read_metrics(urls)
            use = measure(args.window)
            end, metrics_after = time.time(), read_metrics(urls)
            thread.join()
            answers, _ = done["out"]
            tokens, requests = streamed_per_s(answers, start, end)
            host = sum(use[g] for g in HOST)
            served = [a for a in answers if "failed" not in a and start <= a["sent_at"] < end and a["chunks"] > 1]
            row = {
                "rate": rate,
                "ttft_p50_s": round(quantile([a["ttft_s"] for a in served], 0.5), 4),
                "ttft_p90_s": round(quantile([a["ttft_s"] for a in served], 0.9), 4),
                "itl_p50_s": round(quantile([a["itl_s"] for a in served], 0.5), 4),
                "requests_per_s": round(requests, 3),
                "tokens_per_s": round(tokens, 1),
                "failed": sum("failed" in a for a in answers),
                "cores": use,
                "times": times_between(metrics_before, metrics_after, end - start),
                "host_cores": round(host, 3),
                "idle_host_cores": round(idle_host, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pdserve("down")
        os.unlink(config)
    result = {
        "config": args.config,
        "measured": time.strftime("%Y-%m-%d"),
        "cores": psutil.cpu_count(),
        "prompt": args.prompt,
        "window": args.window,
        "output": args.output,
        "idle": idle,
        "loads": rows,
        "host": {
            "idle_cores": round(idle_host, 3),
            "cpu_s_per_token": round(
                fit([r["tokens_per_s"] for r in rows], [r["host_cores"] - r["idle_host_cores"] for r in rows]), 6
            ),
        },
        # each engine's API server (the actor's process) beyond its idle use: per answer token streamed and per
        # request, fitted alone each (the decode engine's streams tokens, the prefill engine's answers requests)
        "api": {
            group: {
                "cpu_s_per_token": round(per_unit(rows, idle, group, "tokens_per_s"), 6),
                "cpu_s_per_request": round(per_unit(rows, idle, group, "requests_per_s"), 6),
            }
            for group in sorted(idle)
            if group.startswith("api@")
        },
    }
    print(json.dumps({"host": result["host"], "api": result["api"]}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
