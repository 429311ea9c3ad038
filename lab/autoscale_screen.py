"""Screen a change of the autoscaling policy on the tuning seeds, cheaply.

The study (``autoscale_study.py``) judges the policy against each trace's best static split, which takes
~16 simulations a trace to find. This screen compares the autoscaler (with moves) against one fixed split
of the whole budget instead (``--against``, 46:18 by default: near the best split of every chat and tail
trace), so one change costs two simulations a trace, and the fixed split's runs can be cached. It reads
only the tuning seeds (1-6 by default): a change chosen here is then judged by the study on the evaluation
and generalization seeds, which it never saw.

    python lab/autoscale_screen.py [--set burst_guard=0.75] [--families diurnal,tenants] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from lab.study import (  # noqa: E402
    COLD_START,
    GENERALIZATION,
    STUDY_FAMILIES,
    TUNING_SEEDS,
    load,
    make_trace,
    meets,
    static_key,
    summary_of,
)
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402


def screen_mix(family: str, mix: str | None = None) -> str:
    """The length mix a family is screened in: ``mix`` when given, else the study's shapes in chat and the
    generalization ones in tail."""
    return mix or ("tail" if family in GENERALIZATION else "chat")


def screen_one(
    family: str,
    seed: int,
    against: tuple[int, int],
    overrides: dict[str, float],
    fixed: dict[str, Any] | None,
    mix: str | None = None,
) -> dict[str, Any]:
    """One tuning trace: the autoscaler with moves, and the fixed split (unless ``fixed`` has its run)."""
    spec, profile = load(overrides)
    trace = make_trace(family, screen_mix(family, mix), seed)
    fixed = fixed or summary_of(simulate_spec(spec, profile, trace, against))
    start = None if family in COLD_START else against
    auto = summary_of(simulate_spec(spec, profile, trace, None, start=start, moves=True))
    ratio = auto["goodput_per_engine_hour"] / fixed["goodput_per_engine_hour"]
    points = 100 * (auto["slo_attainment"] - fixed["slo_attainment"])
    met = meets(family, ratio, points)
    return {"family": family, "seed": seed, "ratio": ratio, "slo_points": points, "fixed": fixed, "met": met}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join((*STUDY_FAMILIES, *GENERALIZATION)))
    parser.add_argument("--seeds", default=",".join(map(str, TUNING_SEEDS)))
    parser.add_argument("--against", default="46:18", help="the fixed split P:D the autoscaler is compared with")
    parser.add_argument("--mix", help="one length mix for every family (long-output: near its best splits, 35:29)")
    parser.add_argument("--set", action="append", default=[], type=lambda s: s.split("=", 1), metavar="KNOB=VALUE")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache", type=Path, help="JSON file of the fixed split's runs, read and extended")
    parser.add_argument("-v", "--verbose", action="store_true", help="also one line per trace")
    args = parser.parse_args()
    overrides = {key: float(value) for key, value in args.set}
    load(overrides)  # a wrong knob fails here
    against = tuple(int(n) for n in args.against.split(":"))
    jobs = [(f, int(s)) for f in args.families.split(",") for s in args.seeds.split(",")]
    keys = [f"{static_key(f, screen_mix(f, args.mix), s)}/{args.against}" for f, s in jobs]
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    started = time.time()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(
            pool.map(
                screen_one,
                *zip(*jobs, strict=True),
                [against] * len(jobs),
                [overrides] * len(jobs),
                [cache.get(k) for k in keys],
                [args.mix] * len(jobs),
            )
        )
    if args.cache:
        cache.update({k: row["fixed"] for k, row in zip(keys, rows, strict=True)})
        args.cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    print(f"| family | goodput/engine-hour vs {args.against} | SLO points | met |\n|---|---:|---:|---:|")
    for family in dict.fromkeys(f for f, _ in jobs):
        mine = [r for r in rows if r["family"] == family]
        if args.verbose:
            for r in mine:
                met = "yes" if r["met"] else ""
                print(f"| {family} seed {r['seed']} | {r['ratio']:.3f}x | {r['slo_points']:+.1f} | {met} |")
        ratio = sum(r["ratio"] for r in mine) / len(mine)
        points = sum(r["slo_points"] for r in mine) / len(mine)
        print(f"| {family} | {ratio:.3f}x | {points:+.2f} | {sum(r['met'] for r in mine)}/{len(mine)} |")
    knobs = "".join(f"; {key}={value:g}" for key, value in overrides.items())
    met = sum(r["met"] for r in rows)
    print(f"\n{met} of {len(rows)} traces meet their target{knobs}; {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
