"""What the host's unpinned processes take of the cores while the CPU demo streams answers: the proxy, the replay
client, Ray's daemons (none of them pinned; every engine's processes are, each to its cores).

Starts ``--config`` (the autoscaled CPU demo by default, its autoscaler held still: prefill-0 on core 0, decode-0
on core 1), then for each of ``--rates`` replays a steady Poisson load of short prompts and long answers through
the proxy as ``validate_simulator.py`` does (``testlib.fidelity.replay_apart``: its client in a session of its own,
ahead of the engines), and reads from ``/proc`` the CPU seconds every process used in the middle ``--window`` of
it, by group: engines (pinned), proxy, client, Ray, other. Also idle, before the first load.

Its ``host``: the unpinned processes' use idle (cores) and their CPU seconds per answer token streamed (fitted by
least squares over the loads). On 2026-12-05 they took 0.07-0.08 of the 2 cores at 96-303 answer tokens/s
(``lab/results/host-cpu-probe.json``): the host's own load does not explain why the cluster's latencies under
load are longer than the simulator's.

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
from orchestrator.autoscale.traces import TraceRequest  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.fidelity import replay_apart  # noqa: E402

GROUPS = ("engines", "proxy", "client", "ray", "other")
SETTLE_S = 15.0  # a load runs this long before its window


def group_of(proc: psutil.Process, cores: int) -> str:
    """Which of ``GROUPS`` a process counts in."""
    if len(proc.cpu_affinity()) < cores:
        return "engines"
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
        use[group] += (used - before.get(pid, (group, 0.0))[1]) / wall
    return {group: round(cores, 3) for group, cores in use.items()}


def steady(rate: float, seconds: float, prompt: int, output: int, seed: int) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` of requests all ``prompt`` tokens long, each answered in ``output`` tokens."""
    prompts, answers = traces.LengthDist(prompt, 0.0, prompt, prompt), traces.LengthDist(output, 0.0, output, output)
    fixed = traces.LengthMix("fixed", ((1.0, prompts, answers),))
    return traces.poisson(rate, seconds, fixed, seed=seed)


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


def replay_into(done: dict, status: dict, trace: list[TraceRequest]) -> None:
    done["out"] = replay_apart(status["proxy_url"], status["model"], trace)


def fit(rows: list[dict]) -> float:
    """The unpinned processes' CPU seconds per answer token streamed: (host cores - idle) = k x tokens/s, by least
    squares through the origin. (A term per request as well was tried: over three loads it came out below zero.)"""
    return sum(r["tokens_per_s"] * (r["host_cores"] - r["idle_host_cores"]) for r in rows) / sum(
        r["tokens_per_s"] ** 2 for r in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu-autoscale.yaml")
    parser.add_argument("--rates", default="1,2,3", help="requests per second, one steady load each")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=120, help="answer tokens per request")
    parser.add_argument("--window", type=float, default=40.0, help="seconds of each load whose CPU is read")
    parser.add_argument("--out", metavar="FILE", help="also write the result here (JSON)")
    args = parser.parse_args()

    config = up_held_still(args.config)
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        time.sleep(SETTLE_S)
        idle = measure(args.window / 2)
        idle_host = sum(v for g, v in idle.items() if g != "engines")
        print(f"idle: {idle}", flush=True)
        rows = []
        for n, rate in enumerate(float(r) for r in args.rates.split(",")):
            trace = steady(rate, SETTLE_S + args.window + 10, args.prompt, args.output, seed=n)
            done: dict = {}
            thread = threading.Thread(target=replay_into, args=(done, status, trace))
            thread.start()
            time.sleep(SETTLE_S)
            start = time.time()
            use = measure(args.window)
            end = time.time()
            thread.join()
            answers, _ = done["out"]
            tokens, requests = streamed_per_s(answers, start, end)
            host = sum(v for g, v in use.items() if g != "engines")
            row = {
                "rate": rate,
                "requests_per_s": round(requests, 3),
                "tokens_per_s": round(tokens, 1),
                "failed": sum("failed" in a for a in answers),
                "cores": use,
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
        "output": args.output,
        "idle": idle,
        "loads": rows,
        "host": {"idle_cores": round(idle_host, 3), "cpu_s_per_token": round(fit(rows), 6)},
    }
    print(json.dumps(result["host"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
