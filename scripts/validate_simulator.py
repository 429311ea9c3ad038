"""The simulator against the real cluster: one trace through both, p50 TTFT and ITL compared.

The cluster of ``--config`` is started (``pdserve up --detach``), the trace is
replayed against its proxy in real time (each request at its ``t``: a streamed
completion of ``prompt_tokens`` random token ids, fresh per request so no prefix
cache helps, and exactly ``output_tokens`` tokens with ``ignore_eos``), and the
cluster is stopped. The same trace then goes through ``pdserve simulate``'s model
of that cluster (``--profile``, the spec's pool sizes held fixed). Per request,
TTFT is arrival to the first streamed token and ITL the mean gap between tokens;
the table compares their medians (the issue's bar: within 20 %).

    python scripts/validate_simulator.py [--config configs/local-cpu.yaml] \\
        [--profile configs/profiles/local-cpu.yaml] [--rate 0.2 --duration 180 | --trace FILE] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import time
import urllib.request

from bench_latency import pdserve

from orchestrator.autoscale import traces
from orchestrator.autoscale.policy import StaticPolicy
from orchestrator.autoscale.profile import load_profile
from orchestrator.autoscale.simulator import SloTargets, simulate
from orchestrator.spec import ClusterSpec

TOLERANCE = 0.20
# Token ids well inside SmolLM2's vocabulary and clear of its special tokens.
TOKEN_IDS = (1000, 40000)


def replay(proxy_url: str, model: str, trace: list[traces.TraceRequest], seed: int) -> list[dict]:
    """Send every request at its time; return each one's TTFT and mean ITL (seconds)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(r.prompt_tokens)] for r in trace]
    start = time.perf_counter()

    def one(index: int) -> dict:
        request = trace[index]
        time.sleep(max(0.0, start + request.t - time.perf_counter()))
        sent = time.perf_counter()
        body = {
            "model": model,
            "prompt": prompts[index],
            "max_tokens": request.output_tokens,
            "min_tokens": request.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        http = urllib.request.Request(
            proxy_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        stamps = []
        with urllib.request.urlopen(http, timeout=900) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        return {"ttft_s": stamps[0] - sent, "itl_s": statistics.mean(gaps) if gaps else 0.0, "chunks": len(stamps)}

    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        return list(pool.map(one, range(len(trace))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--profile", default="configs/profiles/local-cpu.yaml")
    parser.add_argument("--trace", help="a trace file (JSON lines); default: a Poisson trace of the short mix")
    parser.add_argument("--rate", type=float, default=0.2, help="req/s of the generated trace")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of the generated trace")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spec = ClusterSpec.from_file(args.config)
    profile = load_profile(args.profile)
    if args.trace:
        trace = traces.read_trace(args.trace)
    else:
        trace = traces.poisson(args.rate, args.duration, traces.MIXES["short"], seed=args.seed)
    limit = spec.engine.max_model_len
    if any(r.prompt_tokens + r.output_tokens > limit for r in trace):
        sys.exit(f"the trace has requests longer than engine.max_model_len ({limit})")

    split = (spec.prefill.replicas, spec.decode.replicas)
    simulated = simulate(profile, StaticPolicy(*split), trace, SloTargets(1e9, 1e9), split).records

    up = pdserve("up", args.config, "--detach")
    if up.returncode != 0:
        sys.exit(f"pdserve up failed:\n{up.stdout}\n{up.stderr}")
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        measured = replay(status["proxy_url"], status["model"], trace, args.seed)
    finally:
        pdserve("down")

    rows = {}
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        real = statistics.median(m[key] for m in measured)
        sim = statistics.median(getattr(r, key) for r in simulated)
        rows[name] = {"cluster_p50_s": round(real, 4), "simulator_p50_s": round(sim, 4), "ratio": round(sim / real, 3)}
    report = {
        "config": args.config,
        "profile": args.profile,
        "requests": len(trace),
        "mean_prompt_tokens": round(statistics.mean(r.prompt_tokens for r in trace), 1),
        "mean_output_tokens": round(statistics.mean(r.output_tokens for r in trace), 1),
        "p50": rows,
        "within_20_percent": all(abs(row["ratio"] - 1) <= TOLERANCE for row in rows.values()),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{report['requests']} requests (mean {report['mean_prompt_tokens']:.0f} prompt / "
        f"{report['mean_output_tokens']:.0f} output tokens) on {args.config}, profile {args.profile}"
    )
    print(f"{'':6} {'cluster p50':>12} {'simulator p50':>14} {'sim/real':>9}")
    for name, row in rows.items():
        print(
            f"{name:6} {row['cluster_p50_s'] * 1000:>10.0f}ms {row['simulator_p50_s'] * 1000:>12.0f}ms "
            f"{row['ratio']:>9.2f}"
        )
    print(f"within {TOLERANCE:.0%}: {'yes' if report['within_20_percent'] else 'NO'}")


if __name__ == "__main__":
    main()
