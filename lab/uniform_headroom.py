"""The reacting load oracle with one headroom for every trace: what a policy that reads the work exactly, at once,
but must choose its reserve before it has seen the trace, could meet.

The study's bounds (``autoscale_study.py --bounds``) give the reacting ``LoadOracle`` the best of several
headrooms *for each trace*: the reserve that trace turned out to need (2.0 on a bursty trace, 0.8 on a diurnal one).
A policy has to hold its reserve before the first burst, so this runs the same oracle at each of ``HEADROOMS`` (in
proportion and by square-root staffing) on every evaluation trace, and says for each setting which traces meet
their family's target (``study.TARGETS``) against the best static split (read from ``--static-cache``).

Run from the repository root: ``python lab/uniform_headroom.py --static-cache
lab/results/autoscale-study-static-cache.json [--families bursty,...] [--jobs 2] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.autoscale_study import LoadOracle  # noqa: E402
from lab.study import EVALUATION_SEEDS, MIX_NAMES, STUDY_FAMILIES, load, make_trace, meets, static_key, summary_of  # noqa: E402
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402

HEADROOMS = (1.0, 1.2, 1.4, 1.6, 2.0)
FORMS = {"linear": False, "sqrt": True}


def run_one(family: str, mix: str, seed: int, cached: dict[str, Any]) -> dict[str, Any]:
    spec, profile = load()
    trace, budget = make_trace(family, mix, seed), spec.autoscaling.max_engines
    split, static = cached["split"], cached["static"]
    cells = {}
    for form, sqrt in FORMS.items():
        for headroom in HEADROOMS:
            oracle = LoadOracle(trace, (split, budget - split), budget, headroom, 0.0, sqrt)
            summary = summary_of(simulate_spec(spec, profile, trace, None, start=oracle.sizes(0.0), policy=oracle))
            ratio = summary["goodput_per_engine_hour"] / static["goodput_per_engine_hour"]
            points = 100 * (summary["slo_attainment"] - static["slo_attainment"])
            cells[f"{form} {headroom:g}"] = {
                "ratio": round(ratio, 4),
                "slo_points": round(points, 2),
                "meets": meets(family, ratio, points),
            }
    return {"family": family, "mix": mix, "seed": seed, "cells": cells}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--static-cache", type=Path, required=True, help="the study's best static splits")
    parser.add_argument("--families", default=",".join(STUDY_FAMILIES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    cache = json.loads(args.static_cache.read_text())
    jobs = [(f, m, s) for f in args.families.split(",") for m in MIX_NAMES for s in EVALUATION_SEEDS]
    missing = [job for job in jobs if static_key(*job) not in cache]
    if missing:
        sys.exit(f"{args.static_cache}: no best static split for {missing[0]} (run autoscale_study.py --static-cache)")
    started = time.time()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_one, *zip(*jobs, strict=True), [cache[static_key(*job)] for job in jobs]))
    settings = list(rows[0]["cells"])
    print("| setting | " + " | ".join(args.families.split(",")) + " | all |")
    print("|---|" + "---:|" * (len(args.families.split(",")) + 1))
    for setting in settings:
        counts = [
            sum(r["cells"][setting]["meets"] for r in rows if r["family"] == family)
            for family in args.families.split(",")
        ]
        per = len(MIX_NAMES) * len(EVALUATION_SEEDS)
        print(f"| {setting} | " + " | ".join(f"{c}/{per}" for c in counts) + f" | {sum(counts)}/{len(rows)} |")
    print(f"{time.time() - started:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"headrooms": HEADROOMS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
