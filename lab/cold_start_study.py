"""A cold start under full load: the cluster starts at the spec's sizes (16 prefill, 6 decode of a 64-engine
budget, ``configs/autoscaling-sim.yaml``) while a steady load that needs most of the budget arrives, and the
autoscaler has to grow the fleet and set its ratio. How long until it holds its targets, and does it stay there?

Load levels are shares of each length mix's calibrated steady rate (``study.RATES``: where a static 32:32 split
of the 64 engines attains ~91 %), on three mixes whose prefill:decode needs differ (chat, heavy prompts, long
outputs). A run is judged by minutes (60-s windows of arrivals): a minute holds the targets when its p90 TTFT and
p90 ITL are within them. *Time to target*: the start of the first minute from which every later minute holds
them (the engines start in 60 s: two start-ups are 120 s). Tuning seeds (``study.TUNING_SEEDS``) and evaluation
seeds (``study.EVALUATION_SEEDS``) are apart: ``--seeds tuning|evaluation``.

The bound (``--bound``), for a run that holds only later than two start-ups: the start oracle, which knows the
load at once and goes at the first decision to one fixed split of the whole budget (``BOUND_SPAN`` prefill
engines either side of the split the autoscaler ended on); the earliest any such split holds from.

Run from the repository root: ``python lab/cold_start_study.py [--seeds evaluation] [--jobs 2] [--bound]
[--json FILE]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab import study  # noqa: E402
from orchestrator.autoscale import traces  # noqa: E402
from orchestrator.autoscale.policy import StaticPolicy  # noqa: E402
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402

DURATION_S = 1800.0
MINUTE = study.MINUTE
LEVELS = (0.6, 0.8, 0.95)
BOUND_SPAN = 4
TWO_STARTUPS_S = 120.0  # the engines start in 60 s
MIXES = ("chat", "heavy", "long-output")


def minutes_holding(result: Any) -> list[tuple[float, bool]]:
    """(minute's start, whether its p90 TTFT and ITL are within the targets) of every minute of arrivals."""
    t = result.targets
    return study.minutes_holding([(r.arrival, r.ttft_s, r.itl_s) for r in result.records], t.ttft_s, t.itl_s)


def _trace(mix: str, level: float, seed: int) -> tuple[float, list]:
    rate = level * study.RATES[("steady", mix)]
    return rate, traces.poisson(rate, DURATION_S, mix=traces.MIXES[mix], seed=seed)


def _holds_from(minutes: list[tuple[float, bool]]) -> float | None:
    holds_from = study.holds_from(minutes)
    return holds_from if holds_from < DURATION_S - MINUTE else None


def start_oracle(mix: str, level: float, seed: int, prefill: int) -> dict[str, Any]:
    """The earliest a fixed split of the whole budget, taken at the first decision from the spec's sizes, holds
    from, over ``prefill`` +- ``BOUND_SPAN`` prefill engines: {"time_to_target_s", "split"}."""
    spec, profile = study.load()
    _, trace = _trace(mix, level, seed)
    budget = spec.autoscaling.max_engines
    best: dict[str, Any] = {"time_to_target_s": None, "split": None}
    for p in range(max(1, prefill - BOUND_SPAN), min(budget - 1, prefill + BOUND_SPAN) + 1):
        result = simulate_spec(spec, profile, trace, None, policy=StaticPolicy(p, budget - p))
        holds = _holds_from(minutes_holding(result)[:-1])
        if holds is not None and (best["time_to_target_s"] is None or holds < best["time_to_target_s"]):
            best = {"time_to_target_s": holds, "split": [p, budget - p]}
    return best


def run_one(mix: str, level: float, seed: int) -> dict[str, Any]:
    spec, profile = study.load()
    rate, trace = _trace(mix, level, seed)
    result = simulate_spec(spec, profile, trace, None)  # starts at the spec's replicas
    minutes = minutes_holding(result)[:-1]  # the last minute is cut by the trace's end
    misses = [start for start, ok in minutes if not ok]
    after = [r for r in result.records if r.arrival >= 2 * profile.engine.startup_s]
    t = result.targets
    moved = sum(1 for p in result.timeline if p["moved"])
    last = result.timeline[-1]
    return {
        "mix": mix, "level": level, "seed": seed, "rate": round(rate, 2),
        "time_to_target_s": _holds_from(minutes),
        "minutes_missed": len(misses), "minutes": len(minutes),
        "attainment_after_two_startups": sum(r.ttft_s <= t.ttft_s and r.itl_s <= t.itl_s for r in after) / len(after),
        "final_split": [last["prefill"], last["decode"]], "decisions_with_moves": moved,
        "engine_hours": round(result.engine_hours, 2),
    }  # fmt: skip


def _later_than_two_startups(time_to_target_s: float | None) -> bool:
    """A run that never holds (None) or holds only after two start-ups; one holding from 0 s is not late."""
    return time_to_target_s is None or time_to_target_s > TWO_STARTUPS_S


def _bound_cell(bound: dict[str, Any] | None) -> str:
    if bound is None:
        return "-"
    if bound["time_to_target_s"] is None:
        return "never"
    return f"{bound['time_to_target_s']:.0f} ({bound['split'][0]}:{bound['split'][1]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", choices=("tuning", "evaluation"), default="evaluation")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--bound", action="store_true", help="for the runs that hold later than two start-ups, the start oracle"
    )
    args = parser.parse_args()
    seeds = study.TUNING_SEEDS[:3] if args.seeds == "tuning" else study.EVALUATION_SEEDS
    jobs = [(mix, level, seed) for mix in MIXES for level in LEVELS for seed in seeds]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run_one, *zip(*jobs, strict=True)))
        late = [r for r in rows if args.bound and _later_than_two_startups(r["time_to_target_s"])]
        bounds = [pool.submit(start_oracle, r["mix"], r["level"], r["seed"], r["final_split"][0]) for r in late]
        for row, bound in zip(late, bounds, strict=True):
            row["start_oracle"] = bound.result()
    print(f"{args.seeds} seeds {list(seeds)}; the spec starts at 16 prefill + 6 decode of 64; two start-ups: 120 s")
    print("| mix | load (of the calibrated rate) | req/s | time to target, s (per seed) | minutes missed | "
          "attainment after 120 s | final P:D | start oracle, where later than 120 s: s (split) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mix in MIXES:
        for level in LEVELS:
            cell = [r for r in rows if r["mix"] == mix and r["level"] == level]
            times = ", ".join(
                "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}" for r in cell
            )
            attained = statistics.mean(r["attainment_after_two_startups"] for r in cell)
            splits = ", ".join(f"{r['final_split'][0]}:{r['final_split'][1]}" for r in cell)
            oracle = ", ".join(_bound_cell(r.get("start_oracle")) for r in cell)
            print(f"| {mix} | {level:.2f} | {cell[0]['rate']} | {times} | "
                  f"{', '.join(str(r['minutes_missed']) for r in cell)} of {cell[0]['minutes']} | "
                  f"{100 * attained:.1f} % | {splits} | {oracle} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
