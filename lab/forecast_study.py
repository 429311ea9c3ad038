"""The autoscaler's forecast on multi-day traces: a schedule the user writes (right, or wrong), a season it
learns from the arrivals, and no forecast, against the best static split of the same engines.

Each trace is three days (Monday to Wednesday, UTC) of the same working day: a quiet night at a fifth of the
peak, a jump to the peak at 08:00 within six minutes (faster than engines start: a reacting policy is late for
it), a lunch dip to 60 % from 12:00 to 13:00, and the evening fall from 17:30 to 18:00. ``workday-tenant`` adds
a tenant of long documents (4-8k-token prompts) that bursts every day at 09:30 and 14:00 for four minutes.
The schedules: ``right`` writes the day's levels (night, peak, lunch) as a user who knows the day would; ``wrong``
writes the same shifted three hours later. The season needs two days before it answers: every policy is judged
on the third day only (its requests, and the engine-hours of that day), against the best static split of that
day. The engines: the study's spec and profile (``configs/autoscaling-sim.yaml``) with a budget of 16.

Run from the repository root: ``python lab/forecast_study.py [--seeds 11 12] [--jobs 2] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab import study  # noqa: E402
from orchestrator.autoscale import traces  # noqa: E402
from orchestrator.autoscale.config import AutoscalingConfig  # noqa: E402
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402
from orchestrator.autoscale.traces import TraceRequest  # noqa: E402

DAY = 86400.0
DAYS = 3
MONDAY = 4 * DAY  # 1970-01-05 00:00 UTC
BUDGET = 16
PEAK_RPS = {"workday": 14.0, "workday-tenant": 11.0}
# (hour, share of the peak): linear between the points
WORKDAY = ((0.0, 0.2), (8.0, 0.2), (8.1, 1.0), (12.0, 1.0), (12.05, 0.6), (13.0, 0.6), (13.05, 1.0), (17.5, 1.0),
           (18.0, 0.2), (24.0, 0.2))  # fmt: skip
TENANT_BURSTS = ((9.5, 9.5 + 4 / 60), (14.0, 14.0 + 4 / 60))  # hours of the documents' daily bursts
TENANT_SHARE = 0.3  # the documents' rate in a burst, as a share of the base's peak (the study's tenants: 0.02 x 15)
POLICIES = ("reacting", "schedule", "wrong schedule", "season")


def share(hour: float) -> float:
    for (h0, s0), (h1, s1) in zip(WORKDAY, WORKDAY[1:], strict=False):
        if h0 <= hour <= h1:
            return s0 + (s1 - s0) * (hour - h0) / (h1 - h0)
    return WORKDAY[-1][1]


def make_trace(family: str, seed: int) -> list[TraceRequest]:
    peak = PEAK_RPS[family]
    base = traces.shaped(lambda t: peak * share((t % DAY) / 3600), peak, DAYS * DAY, traces.MIXES["chat"], seed)
    if family == "workday":
        return base

    def documents(t: float) -> float:
        hour = (t % DAY) / 3600
        return TENANT_SHARE * peak if any(a <= hour < b for a, b in TENANT_BURSTS) else 0.0

    return study.merge(base, traces.shaped(documents, TENANT_SHARE * peak, DAYS * DAY, study.DOCUMENTS, seed + 1000))


def schedule(family: str, shift_h: float = 0.0) -> list[dict[str, Any]]:
    """The day's levels as a user would write them (``shift_h`` later: a wrong schedule)."""
    peak = PEAK_RPS[family]

    def at(hour: float) -> str:
        hour = (hour + shift_h) % 24
        return f"{int(hour):02d}:{round(hour % 1 * 60):02d}"

    days = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
    return [
        {"rps": round(peak * 0.6, 2), "start": at(12), "end": at(13), "days": days},
        {"rps": peak, "start": at(8), "end": at(17.5), "days": days},
        {"rps": round(peak * 0.2, 2), "days": days},
    ]


def spec_for(policy: str, family: str) -> tuple[Any, Any]:
    spec, profile = study.load()
    scaling = spec.autoscaling.model_dump()
    scaling.update(max_engines=BUDGET, prefill={"min": 1, "max": BUDGET - 1}, decode={"min": 1, "max": BUDGET - 1})
    if policy == "schedule":
        scaling["schedule"] = schedule(family)
    elif policy == "wrong schedule":
        scaling["schedule"] = schedule(family, shift_h=3.0)
    elif policy == "season":
        scaling["learn_season"] = True
    return spec.model_copy(update={"autoscaling": AutoscalingConfig.model_validate(scaling)}), profile


def last_day(result: Any, interval_s: float, static_engines: int | None = None) -> dict[str, Any]:
    """The third day's attainment, goodput and engine-hours."""
    start, end = (DAYS - 1) * DAY, DAYS * DAY
    records = [r for r in result.records if start <= r.arrival < end]
    targets = result.targets
    good = sum(1 for r in records if r.ttft_s <= targets.ttft_s and r.itl_s <= targets.itl_s)
    if static_engines is not None:
        engine_hours = static_engines * DAY / 3600
    else:
        engine_hours = sum(p["engines"] * interval_s for p in result.timeline if start <= p["t"] < end) / 3600
    return {
        "requests": len(records),
        "slo_attainment": good / len(records),
        "engine_hours": engine_hours,
        "goodput_per_engine_hour": good / engine_hours,
    }


def run_one(family: str, seed: int, policy: str) -> dict[str, Any]:
    trace = make_trace(family, seed)
    spec, profile = spec_for(policy, family)
    if policy == "static":
        day = [TraceRequest(r.t - (DAYS - 1) * DAY, r.prompt_tokens, r.output_tokens) for r in trace
               if r.t >= (DAYS - 1) * DAY]  # fmt: skip
        split, summary, tried = study.best_static(spec, profile, day)
        return {"family": family, "seed": seed, "policy": policy, "split": [split, BUDGET - split], "tried": tried,
                "slo_attainment": summary["slo_attainment"], "requests": summary["requests"],
                "engine_hours": summary["engine_hours"],
                "goodput_per_engine_hour": summary["goodput_per_engine_hour"]}  # fmt: skip
    result = simulate_spec(spec, profile, trace, None, start=(3, 2), start_clock_s=MONDAY)
    return {"family": family, "seed": seed, "policy": policy,
            **last_day(result, spec.autoscaling.interval_s)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(study.EVALUATION_SEEDS[:1]))
    parser.add_argument("--families", nargs="+", default=list(PEAK_RPS))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    jobs = [(f, s, p) for f in args.families for s in args.seeds for p in ("static", *POLICIES)]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run_one, *zip(*jobs, strict=True)))
    static = {(r["family"], r["seed"]): r for r in rows if r["policy"] == "static"}
    print(
        "| trace | seed | policy | SLO attainment | engine-hours | goodput / engine-hour vs best static | SLO points |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s = static[(r["family"], r["seed"])]
        r["ratio"] = r["goodput_per_engine_hour"] / s["goodput_per_engine_hour"]
        r["slo_points"] = 100 * (r["slo_attainment"] - s["slo_attainment"])
        what = f"static {r['split'][0]}:{r['split'][1]}" if r["policy"] == "static" else r["policy"]
        print(f"| {r['family']} | {r['seed']} | {what} | {100 * r['slo_attainment']:.1f} % | "
              f"{r['engine_hours']:.1f} | {r['ratio']:.2f}x | {r['slo_points']:+.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
