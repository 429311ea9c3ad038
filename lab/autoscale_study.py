"""The autoscaling study: the autoscaler against the best static split, on load it was not tuned on.

Four trace families (below) x three length mixes (``chat``; ``heavy``, log-normal
with sigma 1.2, prompts up to 8k and outputs up to 2k tokens; ``long-output``, a
quarter of the requests writing 500-8k tokens), each at a rate calibrated so that
a static 32:32 split of the 64 engines attains about 91 % of its SLO (``RATES``,
from ``--calibrate`` on the calibration seed). For each trace: the spec's cluster
(configs/autoscaling-sim.yaml: the illustrative GPU profile, max_engines 64) under
the autoscaler, and under the best static split P:D with P + D = 64.

Seeds are disjoint by role, and the README says which is which:

- ``CALIBRATION_SEED`` sets the rates;
- ``TUNING_SEEDS`` are the only ones a change of the policy may be judged on while
  it is being made (``autoscale_screen.py`` screens a change on them cheaply; 1 and 2
  until 2026-11-28, then 1-6: two seeds a family judged a change by noise);
- ``EVALUATION_SEEDS`` are the ones reported: ``--seeds evaluation`` (the default).

Best static: the split with the most goodput (requests meeting both SLO targets
per second); all static splits run 64 engines for the same time, so it also has
the best goodput per engine-hour and SLO attainment. Found by a scan of every 8th
P, then every 2nd around the best, then its neighbours (goodput rises then falls
with P). The target (issue 15): on every family, at least 1.3x the best static
split's goodput per engine-hour with SLO attainment within 5 points of it.

Every trace runs the autoscaler twice: with role moves (the spec allows them: pools of one shape) and
without (``moves=False``), so the gain of moves shows.

``--families generalization``: shapes the study's families do not hold (``GENERALIZATION``, half an
hour each, the ``tail`` mix: prompts log-normal with median 600 tokens and a tail to 8k, outputs median
180): an 8x swing within 15 minutes, 4x bursts of about a minute, the swing with a long-prompt tenant on
top, and a cold start (the spec's 16 + 6) under a steady load near the budget's capacity. Their rates are
set by hand (no calibration), their seeds are ``GENERALIZATION_SEEDS``; nothing is tuned on them.

``--bounds`` adds what a right-sized static fleet and, on the bursty family, an oracle that knows
the bursts reach (``bounds_one``); ``--set KNOB=VALUE`` changes one of the autoscaler's knobs for a run.

    python lab/autoscale_study.py [--seeds evaluation|tuning|3,4] [--families bursty,...]
        [--mixes chat,...] [--jobs 2] [--static-cache FILE] [--set KNOB=VALUE] [--bounds] [--json out.json]
        [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from lab.study import (  # noqa: E402
    BURSTS,
    CALIBRATION_SEED,
    CALIBRATION_TARGET,
    COLD_START,
    CONFIG,
    EVALUATION_SEEDS,
    FAMILIES,
    GENERALIZATION,
    GENERALIZATION_SEEDS,
    GENERALIZATION_TARGET,
    HOUR,
    MIX_NAMES,
    RATES,
    STUDY_FAMILIES,
    TARGET_RATIO,
    TARGET_SLO_POINTS,
    TARGETS,
    TUNING_SEEDS,
    best_static,
    burst_windows,
    load,
    make_trace,
    meets,
    static_key,
    summary_of,
)
from orchestrator.autoscale.observation import ClusterObservation, ScalingDecision
from orchestrator.autoscale.runner import load_spec_and_profile, simulate_spec
from orchestrator.autoscale.traces import TraceRequest


def study_one(
    family: str, mix: str, seed: int, cached: dict[str, Any] | None = None, overrides: dict[str, float] | None = None
) -> dict[str, Any]:
    spec, profile = load(overrides)
    trace = make_trace(family, mix, seed)
    if cached is not None:
        split, static, runs = cached["split"], cached["static"], 0
    else:
        split, static, runs = best_static(spec, profile, trace)
    # Both start alike: the autoscaler with the engines of the static split it is judged against (a cold
    # start: with the spec's replicas).
    start = None if family in COLD_START else (split, spec.autoscaling.max_engines - split)
    auto = simulate_spec(spec, profile, trace, None, start=start, moves=True)
    fixed = simulate_spec(spec, profile, trace, None, start=start, moves=False)
    summary, no_moves = summary_of(auto), summary_of(fixed)
    changes = sum(
        1
        for a, b in zip(auto.timeline, auto.timeline[1:], strict=False)
        if (a["prefill"], a["decode"]) != (b["prefill"], b["decode"])
    )
    return {
        "family": family,
        "mix": mix,
        "seed": seed,
        "rate_rps": RATES[(family, mix)],
        "best_static": f"{split}:{spec.autoscaling.max_engines - split}",
        "static_runs": runs,
        "split": split,
        "static": static,
        "autoscale": summary,
        "ratio": summary["goodput_per_engine_hour"] / static["goodput_per_engine_hour"],
        "slo_points": 100 * (summary["slo_attainment"] - static["slo_attainment"]),
        "replica_changes": changes,
        "moves": sum(1 for row in auto.timeline if row.get("moved")),
        "no_moves": {
            **no_moves,
            "ratio": no_moves["goodput_per_engine_hour"] / static["goodput_per_engine_hour"],
            "slo_points": 100 * (no_moves["slo_attainment"] - static["slo_attainment"]),
        },
    }


class BurstOracle:
    """A policy that knows the bursty family's bursts (``lab.study.burst_windows``): the ``burst`` split from
    ``lead_s`` before each burst to its end, the ``quiet`` split otherwise. ``lead_s`` 0 is the best a policy
    that only reacts can do (it sees a burst at the first decision inside it, with no samples to wait
    for); ``lead_s`` of a startup plus an interval foresees every onset, which exponential gaps make
    impossible."""

    def __init__(
        self, windows: list[tuple[float, float]], burst: tuple[int, int], quiet: tuple[int, int], lead_s: float
    ) -> None:
        self.windows, self.burst, self.quiet, self.lead_s = windows, burst, quiet, lead_s

    def decide(self, obs: ClusterObservation) -> ScalingDecision:
        inside = any(start - self.lead_s <= obs.t < end for start, end in self.windows)
        prefill, decode = self.burst if inside else self.quiet
        return ScalingDecision(obs.t, prefill, decode, [f"oracle: {'burst' if inside else 'quiet'} {prefill}:{decode}"])


class LoadOracle:
    """A yardstick, not a policy one can build: it knows the trace's requests. Each pool is sized in proportion
    to its own work over a trailing window of ``WINDOW_S``: prefill to the prompt tokens arriving, decode to
    the requests that would be decoding at once if each output token took ``TOKEN_S``. ``headroom`` 1.0 gives
    a pool the best static split's engines at the hour's 95th-percentile window of its work. ``lead_s`` 0:
    the window that ended at the decision (what a policy that reacts would read, without noise or a trend to
    estimate); ``lead_s`` > 0: the busiest window until ``lead_s`` ahead (it foresees every change). When
    both pools want more than the budget, it is shared in proportion to their wishes."""

    WINDOW_S, TOKEN_S, BIN_S = 30.0, 0.035, 5.0

    def __init__(
        self,
        trace: list[TraceRequest],
        best: tuple[int, int],
        budget: int,
        headroom: float,
        lead_s: float,
        sqrt: bool = False,
    ) -> None:
        end = max(r.t for r in trace) + 1.0
        bins = int(end / self.BIN_S) + 2
        prompt, active = [0.0] * bins, [0.0] * (bins + 1)
        for r in trace:
            first = int(r.t / self.BIN_S)
            prompt[first] += r.prompt_tokens
            last = min(bins, int((r.t + r.output_tokens * self.TOKEN_S) / self.BIN_S) + 1)
            active[first] += 1
            active[last] -= 1
        running = 0.0
        for i in range(bins):
            running += active[i]
            active[i] = running
        width = max(1, round(self.WINDOW_S / self.BIN_S))
        self.work = [_trailing_means(prompt, width), _trailing_means(active[:bins], width)]
        refs = [sorted(series)[int(0.95 * (len(series) - 1))] or 1.0 for series in self.work]
        # Square-root staffing (``sqrt``): n = a + sqrt(a) engines for an offered load of a engines, the best
        # split's pool being that at the 95th percentile; ``linear``: n in proportion to a.
        loads = [((math.sqrt(1 + 4 * n) - 1) / 2) ** 2 if sqrt else n for n in best]
        self.scale = [load / ref for load, ref in zip(loads, refs, strict=True)]
        self.budget, self.lead_s, self.headroom, self.sqrt = budget, lead_s, headroom, sqrt

    def sizes(self, t: float) -> tuple[int, int]:
        first = min(int(t / self.BIN_S), len(self.work[0]) - 1)
        last = min(int((t + self.lead_s) / self.BIN_S), len(self.work[0]) - 1)
        pools = zip(self.scale, self.work, strict=True)
        loads = [scale * max(series[first : last + 1]) for scale, series in pools]
        wishes = [max(1.0, self.headroom * (a + math.sqrt(a) if self.sqrt else a)) for a in loads]
        if sum(wishes) > self.budget:
            wishes = [w * self.budget / sum(wishes) for w in wishes]
        prefill = max(1, min(self.budget - 1, math.ceil(wishes[0])))
        return prefill, max(1, min(self.budget - prefill, math.ceil(wishes[1])))

    def decide(self, obs: ClusterObservation) -> ScalingDecision:
        prefill, decode = self.sizes(obs.t)
        return ScalingDecision(obs.t, prefill, decode, [f"oracle: {prefill}:{decode}"])


def _trailing_means(values: list[float], width: int) -> list[float]:
    """values' mean over each index's last ``width`` entries; the first full window's mean before it (the
    load before the trace began taken as its first window's)."""
    means, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        means.append(total / width)
    first = means[min(width, len(means)) - 1]
    return [first] * (width - 1) + means[width - 1 :]


def smallest_holding(
    largest: int, run: Callable[[int], dict[str, Any]], static: dict[str, Any], step: int = 4
) -> tuple[int, dict[str, Any]] | None:
    """The smallest size from ``largest`` down, every ``step``th and then half a step below the last that
    held, whose ``run(size)`` stays within TARGET_SLO_POINTS of ``static``'s SLO attainment; with its
    summary (None when ``largest`` does not). Stops at the first miss: fewer engines attain less."""

    def holds(size: int) -> dict[str, Any] | None:
        summary = run(size)
        return summary if 100 * (summary["slo_attainment"] - static["slo_attainment"]) >= TARGET_SLO_POINTS else None

    held = None
    for size in range(largest, 1, -step):
        summary = holds(size)
        if summary is None:
            break
        held = size, summary
    if held is not None and step > 1 and held[0] - step // 2 > 1 and (summary := holds(held[0] - step // 2)):
        held = held[0] - step // 2, summary
    return held


# LoadOracle's headrooms: from 1.2 down to the first that misses the SLO; when 1.2 misses, up until one holds.
LOAD_HEADROOMS = (1.2, 1.1, 1.05, 1.0, 0.95, 0.9, 0.8)
LOAD_HEADROOMS_ABOVE = (1.3, 1.4, 1.6, 2.0)


def best_headroom(
    run: Callable[[float], dict[str, Any]], static: dict[str, Any], points: float, **extra: Any
) -> dict[str, Any]:
    """The headroom whose ``run`` has the most goodput per engine-hour within ``points`` of ``static``'s SLO
    (``LOAD_HEADROOMS`` down to the first miss, or ``LOAD_HEADROOMS_ABOVE`` up to the first that holds), judged;
    ``held`` False: none held (the largest tried, to say by how much)."""

    def judged(headroom: float) -> dict[str, Any]:
        result = _judged(run(headroom), static, headroom=headroom, **extra)
        return result | {"held": result["slo_points"] >= points}

    best = judged(LOAD_HEADROOMS[0])
    if not best["held"]:
        for headroom in LOAD_HEADROOMS_ABOVE:
            if (best := judged(headroom))["held"]:
                break
        return best
    for headroom in LOAD_HEADROOMS[1:]:
        lower = judged(headroom)
        if not lower["held"]:
            break
        best = max(best, lower, key=lambda r: r["ratio"])
    return best


def _judged(summary: dict[str, Any], static: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "summary": summary,
        "ratio": summary["goodput_per_engine_hour"] / static["goodput_per_engine_hour"],
        "slo_points": 100 * (summary["slo_attainment"] - static["slo_attainment"]),
    }


def bounds_one(
    family: str, mix: str, seed: int, cached: dict[str, Any] | None = None, overrides: dict[str, float] | None = None
) -> dict[str, Any]:
    """What any policy could reach on one trace, against the best static split of the whole budget:

    - ``right_sized``: the smallest static fleet (every 4th size, split as the best split is) whose SLO
      attainment stays within 5 points: on a load that does not change, no policy does much better;
    - steady family only, ``target_sized``: the best split (searched near the best split's proportion) of
      the largest fleet whose engine-hours leave room for the target ratio (``budget / TARGET_RATIO``): when
      even it misses the SLO by more than 5 points, no fleet small enough for the target holds that load;
    - bursty family only, ``reactive`` and ``foresight``: ``BurstOracle`` with the best split in bursts and
      the smallest quiet fleet (every 4th size) that keeps the SLO within 5 points;
    - every family, ``load_reacting`` and ``load_foreseeing``: ``LoadOracle`` (pools sized to the work the
      trace brings, read without noise, at once or ahead) at the headroom of ``LOAD_HEADROOMS`` with the most
      goodput per engine-hour within the family's SLO points (``TARGETS``): ``best_headroom``, from 1.2 down
      to the first miss, or up from 1.2 until one holds."""
    row = study_one(family, mix, seed, cached, overrides)
    spec, profile = load(overrides)
    trace, budget = make_trace(family, mix, seed), spec.autoscaling.max_engines
    static, split = row["static"], row["split"]

    def scaled(size: int) -> tuple[int, int]:
        prefill = min(max(1, round(size * split / budget)), size - 1)
        return prefill, size - prefill

    def static_run(size: int) -> dict[str, Any]:
        return summary_of(simulate_spec(spec, profile, trace, scaled(size)))

    # None holding below the budget: the budget is the right size (the best split itself).
    held = smallest_holding(budget - 4, static_run, static) or (budget, static)
    row["right_sized"] = _judged(held[1], static, engines=held[0])
    if family == "steady":
        size = int(budget / TARGET_RATIO)
        p, summary, _ = best_static(spec, profile, trace, size, near=scaled(size)[0])
        row["target_sized"] = _judged(summary, static, engines=size, split=f"{p}:{size - p}")
    budget_split = (split, budget - split)
    points = TARGETS.get(family, GENERALIZATION_TARGET)[1]
    ahead = profile.engine.startup_s + spec.autoscaling.interval_s
    for name, lead in (("load_reacting", 0.0), ("load_foreseeing", ahead)):
        best = None
        for sqrt in (False, True):

            def run(headroom: float, lead: float = lead, sqrt: bool = sqrt) -> dict[str, Any]:
                oracle = LoadOracle(trace, budget_split, budget, headroom, lead, sqrt)
                summary = simulate_spec(spec, profile, trace, None, start=oracle.sizes(0.0), policy=oracle)
                return summary_of(summary)

            found = best_headroom(run, static, points, sqrt=sqrt)
            if best is None or (found["held"], found["ratio"]) > (best["held"], best["ratio"]):
                best = found
        row[name] = best
    if family != "bursty":
        return row
    windows = burst_windows(HOUR, seed=seed, **BURSTS)

    def oracle_run(burst: int, quiet: int, lead: float) -> dict[str, Any]:
        policy = BurstOracle(windows, scaled(burst), scaled(quiet), lead)
        return summary_of(simulate_spec(spec, profile, trace, None, start=scaled(quiet), policy=policy))

    # Reacting: every burst fleet from the budget down to the right-sized static's (each with its smallest
    # quiet fleet); foreseeing: the budget in bursts (it is an upper bound, not a policy to tune).
    best = None
    for burst in range(budget, held[0] - 1, -4):
        quiet = smallest_holding(burst - 4, lambda q, b=burst: oracle_run(b, q, 0.0), static)
        if quiet is not None:
            judged = _judged(quiet[1], static, burst=burst, quiet=quiet[0])
            best = judged if best is None or judged["ratio"] > best["ratio"] else best
    row["reactive"] = best or _judged(held[1], static, burst=held[0], quiet=held[0])
    lead = profile.engine.startup_s + spec.autoscaling.interval_s
    quiet = smallest_holding(budget - 4, lambda q: oracle_run(budget, q, lead), static) or (budget, static)
    row["foresight"] = _judged(quiet[1], static, burst=budget, quiet=quiet[0])
    return row


BOUNDS = ("right_sized", "target_sized", "reactive", "foresight", "load_reacting", "load_foreseeing")


def bounds_table(rows: list[dict[str, Any]]) -> str:
    """Per trace: the autoscaler, and the bounds of ``bounds_one`` (ratio of goodput per engine-hour to the
    best static split's, SLO points against it)."""

    def cell(row: dict[str, Any], name: str) -> str:
        bound = row.get(name)
        if bound is None:
            return "-"
        if "split" in bound:
            fleet = bound["split"]
        elif "engines" in bound:
            fleet = f"{bound['engines']} engines"
        elif "headroom" in bound:
            form = "square-root" if bound["sqrt"] else "linear"
            fleet = f"{form}, headroom {bound['headroom']:g}" + ("" if bound["held"] else ", misses")
        else:
            fleet = f"{bound['quiet']} quiet, {bound['burst']} in bursts"
        return f"{bound['ratio']:.2f}x, {bound['slo_points']:+.1f} ({fleet})"

    lines = [
        "| family | mix | seed | best static | autoscaler | right-sized static | target-sized static | "
        "burst oracle, reacting | burst oracle, foreseeing | load oracle, reacting | load oracle, foreseeing |",
        "|---|---|---:|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['mix']} | {row['seed']} | {row['best_static']}, "
            f"{100 * row['static']['slo_attainment']:.1f} % | {row['ratio']:.2f}x, {row['slo_points']:+.1f} | "
            + " | ".join(cell(row, name) for name in BOUNDS)
            + " |"
        )
    return "\n".join(lines)


SUMMARY_BOUNDS = (
    ("right_sized", "right-sized static"),
    ("reactive", "burst oracle, reacting"),
    ("foresight", "burst oracle, foreseeing"),
    ("load_reacting", "load oracle, reacting"),
    ("load_foreseeing", "load oracle, foreseeing"),
)


def bounds_summary(rows: list[dict[str, Any]]) -> str:
    """Per (family, mix), over its seeds: the autoscaler and each bound (mean [min, max] of the ratio to the
    best static split and of the SLO points); a load oracle that missed the SLO at every headroom on some
    seeds says on how many."""

    def cell(runs: list[dict[str, Any]]) -> str:
        if not runs:
            return "-"
        text = f"{_spread([r['ratio'] for r in runs], '.2f')}x, {_spread([r['slo_points'] for r in runs], '+.1f')}"
        missed = sum(1 for r in runs if r.get("held") is False)
        return text + (f" (misses on {missed} of {len(runs)})" if missed else "")

    lines = [
        "| family | mix | autoscaler | " + " | ".join(title for _, title in SUMMARY_BOUNDS) + " |",
        "|---|---|" + "---|" * (1 + len(SUMMARY_BOUNDS)),
    ]
    for (family, mix), group in _by_family_and_mix(rows).items():
        cells = [cell(group)] + [cell([r[name] for r in group if name in r]) for name, _ in SUMMARY_BOUNDS]
        lines.append(f"| {family} | {mix} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_tables(rows: list[dict[str, Any]], bounds: bool) -> None:
    """The study's table of ``rows``; with ``bounds``, the bounds per trace and their summary too."""
    print(table(rows))
    if bounds:
        print()
        print(bounds_table(rows))
        print()
        print(bounds_summary(rows))


def calibrate_one(family: str, mix: str) -> float:
    """The rate at which static 32:32 attains CALIBRATION_TARGET on CALIBRATION_SEED (bisection)."""
    spec, profile = load_spec_and_profile(CONFIG)
    half = spec.autoscaling.max_engines // 2

    def attainment(rate: float) -> float:
        trace = make_trace(family, mix, CALIBRATION_SEED, rate)
        return simulate_spec(spec, profile, trace, (half, half)).summary()["slo_attainment"]

    low, high = 1.0, 2.0
    if attainment(low) <= CALIBRATION_TARGET:
        raise ValueError(f"{family}/{mix}: static {half}:{half} misses {CALIBRATION_TARGET:.0%} even at {low} req/s")
    while attainment(high) > CALIBRATION_TARGET:
        low, high = high, high * 2
    for _ in range(7):
        mid = (low + high) / 2
        low, high = (mid, high) if attainment(mid) > CALIBRATION_TARGET else (low, mid)
    return round((low + high) / 2, 2)


def _spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def _by_family_and_mix(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``rows`` grouped by (family, mix), in their order: a group's rows are its seeds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["family"], row["mix"]), []).append(row)
    return groups


def table(rows: list[dict[str, Any]]) -> str:
    """Per (family, mix), over its seeds: the autoscaler with moves and without (``no_moves``) against the best
    static split, and how many seeds meet the family's target (``TARGETS``)."""
    lines = [
        "| family | mix | req/s | best static (per seed) | static SLO | target | autoscale SLO | goodput/engine-hour "
        "vs best static | SLO points vs best static | met | without moves: SLO | goodput/engine-hour | "
        "SLO points | met |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (family, mix), group in _by_family_and_mix(rows).items():
        target_ratio, target_points = TARGETS.get(family, GENERALIZATION_TARGET)
        cells = []
        for runs in ([(r, r["autoscale"]) for r in group], [(r["no_moves"], r["no_moves"]) for r in group]):
            met = sum(1 for judged, _ in runs if meets(family, judged["ratio"], judged["slo_points"]))
            cells.append(
                f"{_spread([100 * summary['slo_attainment'] for _, summary in runs], '.1f')} % | "
                f"{_spread([judged['ratio'] for judged, _ in runs], '.2f')}x | "
                f"{_spread([judged['slo_points'] for judged, _ in runs], '+.1f')} | {met}/{len(group)}"
            )
        lines.append(
            f"| {family} | {mix} | {group[0]['rate_rps']:g} | {', '.join(r['best_static'] for r in group)} | "
            f"{_spread([100 * r['static']['slo_attainment'] for r in group], '.1f')} % | "
            f">= {target_ratio:g}x, {target_points:+g} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def _seeds(text: str) -> tuple[int, ...]:
    named = {"evaluation": EVALUATION_SEEDS, "tuning": TUNING_SEEDS, "generalization": GENERALIZATION_SEEDS}
    return named[text] if text in named else tuple(int(s) for s in text.split(","))


def _knob(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    try:
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KNOB=NUMBER") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=_seeds, default=EVALUATION_SEEDS, help="evaluation (default), tuning, generalization, or 3,4"
    )
    parser.add_argument(
        "--families",
        default=",".join(STUDY_FAMILIES),
        help="comma-separated: " + ", ".join(FAMILIES) + "; or 'generalization' (its shapes, the tail mix)",
    )
    parser.add_argument("--mixes", default=",".join(MIX_NAMES), help="comma-separated: " + ", ".join(MIX_NAMES))
    parser.add_argument("--jobs", type=int, default=1, help="simulations in parallel (processes)")
    parser.add_argument("--calibrate", action="store_true", help="find RATES again (on the calibration seed)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        type=_knob,
        metavar="KNOB=VALUE",
        help="an autoscaler knob of the spec's autoscaling section for this run (burst_memory_s=3600); repeatable",
    )
    parser.add_argument(
        "--bounds",
        action="store_true",
        help="also what a right-sized static fleet, on the steady family the best split of a fleet small enough "
        "for the target, on the bursty family an oracle that knows the bursts, and on every family an oracle that "
        "sizes the pools to the load the trace brings (at once, or a start-up ahead) reach",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--static-cache",
        type=Path,
        help="JSON file of best static splits, read and extended (they do not depend on the policy: a change "
        "of it is then judged in one simulation per trace); keyed by trace, config, profile and simulator",
    )
    parser.add_argument(
        "--tables",
        type=Path,
        metavar="JSON",
        help="print the tables of rows an earlier run wrote with --json (its bounds too, if it ran them), and stop",
    )
    args = parser.parse_args()
    if args.tables:
        rows = json.loads(args.tables.read_text())
        print_tables(rows, bounds=any("load_reacting" in row for row in rows))
        return 0
    if set(args.seeds) & {CALIBRATION_SEED, *TUNING_SEEDS} and args.seeds != TUNING_SEEDS:
        print(f"note: seeds {args.seeds} include calibration or tuning seeds", file=sys.stderr)
    try:
        load(dict(args.set))  # a wrong knob fails here, not in every worker
    except (ValueError, ValidationError) as e:
        parser.error(str(e))
    started = time.time()
    if args.families == "generalization":  # its shapes in the tail mix, unless --mixes says otherwise
        families = ",".join(GENERALIZATION)
        mixes = "tail" if args.mixes == ",".join(MIX_NAMES) else args.mixes
    else:
        families, mixes = args.families, args.mixes
    cases = [(f, m) for f in families.split(",") for m in mixes.split(",")]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        if args.calibrate:
            rates = list(pool.map(calibrate_one, *zip(*cases, strict=True)))
            for (family, mix), rate in zip(cases, rates, strict=True):
                print(f'    ("{family}", "{mix}"): {rate},')
            return 0
        cache = json.loads(args.static_cache.read_text()) if args.static_cache and args.static_cache.exists() else {}
        jobs = [(f, m, s) for f, m in cases for s in args.seeds]
        cached = [cache.get(static_key(*job)) for job in jobs]
        overrides = dict(args.set)
        results = pool.map(
            bounds_one if args.bounds else study_one, *zip(*jobs, strict=True), cached, [overrides] * len(jobs)
        )
        rows = []
        for job, row in zip(jobs, results, strict=True):
            rows.append(row)
            if args.static_cache:  # after each trace: an interrupted run keeps the splits it found
                cache[static_key(*job)] = {"split": row["split"], "static": row["static"]}
                args.static_cache.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    knobs = "".join(f"; {key}={value:g}" for key, value in args.set)
    print(f"seeds {', '.join(map(str, args.seeds))}{knobs}; {time.time() - started:.0f} s", file=sys.stderr)
    print_tables(rows, args.bounds)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
