"""The simulator against the real cluster: traces at three loads through both, p50 and p90 of TTFT and ITL.

The cluster of ``--config`` is started (``pdserve up --detach``) and, unless
``--profile`` names one, profiled (``pdserve profile``: the simulator's model of
these engines as fast as they run today). Each trace is replayed against its
proxy in real time (``testlib.fidelity.replay``: streamed
completions of random token ids, no prefix cache help, exactly
``output_tokens`` tokens), and the cluster is stopped. The same trace then goes
through ``pdserve simulate``'s model of that cluster (the profile, the spec's pool
sizes held fixed). Per request, TTFT is arrival to the first streamed token and
ITL the mean gap between tokens; the table compares their medians and p90s (the
issue's bar: within 20 %). The loads (``LOADS``), as shares of what the prefill
pool computes by the profile: light, near saturation (the prefill engine busy
most of the time) and overloaded (arrivals above what it computes: a queue
builds up).

With ``--autoscale`` the spec's autoscaler runs on both sides (its SLO attainment
is compared too), and both read the same profile: ``--profile``, or one measured
first on the same engines without the autoscaler (a copy of the spec without its
``autoscaling`` section, started, profiled and stopped); the cluster then runs a
copy of the spec whose ``autoscaling.profile`` is that file. The ``bursty`` load
(0.3 of the prefill pool's capacity, 4x bursts) is the one meant for it:

    python lab/validate_simulator.py --config configs/local-cpu-autoscale.yaml --autoscale --loads bursty \\
        --duration 900 --out lab/results/autoscale-fidelity.json

The machine's speed moves (one command on the same code: the cluster attained 22 % and 70 %, 40
minutes apart). With ``--profile-after`` the engines are profiled again after the replay, the simulator's
engines run at the mean of the two profiles while its autoscaler reads the first (the one the cluster's
read), and the report gives the drift between them.

    python lab/validate_simulator.py [--config configs/local-cpu.yaml] [--profile FILE | --profile-out FILE] \\
        [--loads light,...] [--duration 180 | --trace FILE] [--out lab/results/simulator-fidelity.json] [--json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from lab.study import holds_from, merge, minutes_holding  # noqa: E402
from orchestrator.autoscale import traces  # noqa: E402
from orchestrator.autoscale.policy import AutoscalePolicy, StaticPolicy  # noqa: E402
from orchestrator.autoscale.profile import PerformanceProfile, load_profile  # noqa: E402
from orchestrator.autoscale.runner import moves_allowed, shared_cores, simulate_spec  # noqa: E402
from orchestrator.autoscale.sim_model import EVEN_SHARE, SharedCore, SimulationResult, SloTargets  # noqa: E402
from orchestrator.autoscale.simulator import simulate  # noqa: E402
from orchestrator.engine_metrics import scrape  # noqa: E402
from orchestrator.spec import ClusterSpec  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.fidelity import (  # noqa: E402
    TOLERANCE,
    compare,
    decode_capacity_rps,
    latency_quantiles,
    mean_profile,
    prefill_capacity_rps,
    quantile,
    replay_apart,
    within,
)
from testlib.specs import spec_copy  # noqa: E402

# Arrival rate as a share of what the spec's prefill pool computes (by the profile, one prompt per pass).
LOADS = {"light": 0.2, "near saturation": 0.8, "overloaded": 1.2}
MIX = traces.MIXES["short"]


# The ``cold`` load: the demo started at its spec's 1 + 1 engines under prompts that want a second prefill engine,
# then answers that need most of what a decode engine computes: a start under load, then the turn.
COLD_PROMPTS = traces.LengthMix(
    "prompts", ((1.0, traces.LengthDist(160, 0.3, 64, 512), traces.LengthDist(16, 0.3, 8, 32)),)
)
COLD_ANSWERS = traces.LengthMix(
    "answers", ((1.0, traces.LengthDist(64, 0.5, 16, 256), traces.LengthDist(120, 0.3, 32, 512)),)
)
# The prompts' rate as a share of what one prefill engine computes of COLD_PROMPTS; the answers' as a share of what
# a decode engine answers (``decode_capacity_rps``). The answers were once at 0.8 of the prompts' prefill rate:
# ~506 tokens/s, where a CPU core decodes ~390 at most, and two decode engines on one core no more (2.0x slower
# each: lab/results/decode-pair-probe.json). The cold runs of 2026-12-04 held only because the replay then kept at
# most 64 requests in flight (testlib.fidelity.replay).
COLD_LOADS = (0.7, 0.8)


def load_trace(
    name: str, profile: PerformanceProfile, prefill_engines: int, duration_s: float, seed: int
) -> tuple[float, list[traces.TraceRequest]]:
    """``(rate, trace)``: Poisson at a share (``LOADS``) of what the spec's prefill pool computes of ``MIX``,
    ``bursty``: 0.3 of it with 4x bursts (1.2x what the prefill pool computes: a queue builds that a larger pool
    would not have) of ~1 min every ~2 min, or ``cold``: ``COLD_PROMPTS`` for the first half, at
    ``COLD_LOADS[0]`` of what one prefill engine computes of them, and ``COLD_ANSWERS`` for the second, at
    ``COLD_LOADS[1]`` of what one decode engine answers."""
    capacity_rps = prefill_capacity_rps(profile, prefill_engines, MIX, seed)
    if name == "bursty":
        rate = 0.3 * capacity_rps
        trace = traces.bursty(
            rate, duration_s, burst_factor=4.0, mean_burst_s=60.0, mean_gap_s=120.0, mix=MIX, seed=seed
        )
        return rate, trace
    if name == "cold":
        one = prefill_capacity_rps(profile, 1, COLD_PROMPTS, seed)
        half = duration_s / 2
        prompts = traces.poisson(COLD_LOADS[0] * one, half, COLD_PROMPTS, seed=seed)
        answers_rps = COLD_LOADS[1] * decode_capacity_rps(profile, COLD_ANSWERS, seed)
        answers = traces.poisson(answers_rps, half, COLD_ANSWERS, seed=seed + 1)
        shifted = [dataclasses.replace(r, t=r.t + half) for r in answers]
        return COLD_LOADS[0] * one, merge(prompts, shifted)
    rate = LOADS[name] * capacity_rps
    return rate, traces.poisson(rate, duration_s, MIX, seed=seed)


ENGINE_SAMPLES = {  # what --sample-engines reads off each engine's /metrics (summed over label sets)
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefill_s_sum": "vllm:request_prefill_time_seconds_sum",
    "prefill_s_count": "vllm:request_prefill_time_seconds_count",
    "queue_s_sum": "vllm:request_queue_time_seconds_sum",
    "steps": "vllm:iteration_tokens_total_count",  # engine steps (a prefill pass, a decode step)
    "step_tokens": "vllm:iteration_tokens_total_sum",  # the tokens they computed
    "waiting": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv_usage": "vllm:kv_cache_usage_perc",
}


class EngineSampler:
    """Every ``interval_s`` while the traces replay: each serving engine's ``ENGINE_SAMPLES`` (the
    controller's status says which engines serve, at what URL); ``rows`` of [t, engine, *values]. From
    the same status, the autoscaler's ``decisions`` by time (the controller keeps only its last 20)."""

    def __init__(self, interval_s: float) -> None:
        from orchestrator.state import ClusterState

        self.interval_s, self.rows, self._client = interval_s, [], ClusterState.load().client()
        self.decisions: dict[float, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                status = self._client.status()
            except Exception:  # noqa: BLE001 - a missed sample, not a failed run
                continue
            self.decisions.update((d["t"], d) for d in (status.get("autoscaler") or {}).get("decisions", []))
            engines = [e for e in status["engines"] if e["state"] in ("ready", "draining")]
            for engine in engines:
                try:
                    values = scrape(engine["url"], list(ENGINE_SAMPLES.values()), timeout_s=5)
                except OSError:
                    continue
                t = round(time.monotonic() - start, 1)
                self.rows.append([t, engine["engine_id"], *(round(values[n], 4) for n in ENGINE_SAMPLES.values())])

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _per(b: dict, a: dict, num: str, den: str) -> float:
    """``num``'s rise from sample ``a`` to ``b`` over ``den``'s (NaN where ``den`` did not rise)."""
    d = b[den] - a[den]
    return (b[num] - a[num]) / d if d > 0 else float("nan")


def engines_by_minute(samples: dict, window_s: float = 60.0) -> None:
    """``--sample-engines``' readings by minute, per engine: prompt tokens computed per second, mean prefill
    and queue time of the requests that finished prefill in it, most requests waiting, mean KV-cache use."""
    columns = samples["columns"]
    by_engine: dict[str, list[dict]] = collections.defaultdict(list)
    for row in samples["rows"]:
        by_engine[row[1]].append(dict(zip(columns, row, strict=True)))
    steps = "steps" in columns  # reports from before 2026-11-27 have no step counts
    print(
        "engine | from t | prompt tok/s | prefill s / request | queue s / request | waiting (max) | KV use"
        + (" | steps / s | tokens / step" if steps else "")
    )
    for engine, rows in sorted(by_engine.items()):
        for start in range(0, int(rows[-1]["t"] + window_s), int(window_s)):
            here = [r for r in rows if start <= r["t"] < start + window_s]
            before = [r for r in rows if r["t"] < start][-1:] or here[:1]
            if not here or not before:
                continue
            a, b = before[0], here[-1]
            span = max(b["t"] - a["t"], 1e-9)
            per = {k: _per(b, a, k, "prefill_s_count") for k in ("prefill_s_sum", "queue_s_sum")}
            print(
                f"{engine} | {start:5d} | {(b['prompt_tokens'] - a['prompt_tokens']) / span:6.0f} | "
                f"{per['prefill_s_sum']:6.2f} | {per['queue_s_sum']:6.2f} | {max(r['waiting'] for r in here):4.0f} | "
                f"{statistics.mean(r['kv_usage'] for r in here):.1%}"
                + (
                    f" | {(b['steps'] - a['steps']) / span:5.2f} | {_per(b, a, 'step_tokens', 'steps'):6.0f}"
                    if steps
                    else ""
                )
            )


DECISION_COLUMNS = ["t", "prefill", "decode", "arrival_rps", "ttft_p90_s", "prefill_waiting", "decode_waiting"]


def decision_rows(decisions: Iterable[dict]) -> dict:
    """Decisions of an autoscaler, the cluster's or the simulator's, as rows of ``DECISION_COLUMNS`` and the
    reasons that concern prefill or feedback (the others hold every interval)."""
    rows = [
        [round(d["t"], 2)]
        + [round(v, 3) if isinstance(v := d.get(key), float) else v for key in DECISION_COLUMNS[1:]]
        + [[r for r in d["reasons"] if r.startswith(("prefill:", "feedback:", "trend:"))]]
        for d in decisions
        if d["t"] >= 0
    ]
    return {"columns": [*DECISION_COLUMNS, "reasons"], "rows": rows}


def predict(
    spec: ClusterSpec,
    profile: PerformanceProfile,
    trace: list,
    shared: SharedCore,
    physics: PerformanceProfile | None = None,
    first_decision_s: float | None = None,
    cores: dict | None = None,
) -> SimulationResult:
    """The autoscaled cluster in the simulator: its autoscaler reads ``profile`` (as the cluster's did), its
    engines run at ``physics`` (default: the same profile), and it first decides at ``first_decision_s``."""
    # The cluster's policy moves engines where the spec allows it (the controller's role_moves): so does this one.
    policy = AutoscalePolicy(spec.autoscaling, profile, moves=moves_allowed(spec))
    return simulate_spec(
        spec,
        physics or profile,
        trace,
        None,
        cores=cores,
        policy=policy,
        shared=shared,
        first_decision_s=first_decision_s,
    )


def slo_attainment(spec: ClusterSpec, result: SimulationResult) -> float:
    targets = spec.autoscaling.targets
    return attainment([(r.ttft_s, r.itl_s) for r in result.records], targets.ttft_p90_s, targets.itl_p90_s)


def phases(interval_s: float, n: int = 5) -> list[float]:
    return [round(interval_s * k / n, 3) for k in range(1, n + 1)]


def decision_phase(decisions: list[dict], start: float, interval_s: float) -> float | None:
    """Where the controller's clock ticked into the replay: seconds from its start to the first decision. The
    autoscaler ticks at a fixed rate, so any decision's time since ``start``, modulo the interval, gives it."""
    offsets = [(d["t"] - start) % interval_s for d in decisions if d["t"] >= start]
    if not offsets:
        return None
    return round(offsets[-1], 3) or interval_s


def drift(before: PerformanceProfile, after: PerformanceProfile) -> dict:
    """How much the engines' speed moved between two profiles: after / before, per decode batch (at the
    grid's middle context) and per prefill pass of one sequence, and both start-up times."""
    context = before.decode.cols[len(before.decode.cols) // 2]
    return {
        "decode_step_at_context": context,
        "decode_step": {
            str(round(b)): round(after.decode_step_seconds(b, context) / before.decode_step_seconds(b, context), 3)
            for b in before.decode.rows
        },
        "prefill_pass": {
            str(round(t)): round(after.prefill_seconds(t, 1) / before.prefill_seconds(t, 1), 3)
            for t in before.prefill.rows
        },
        "startup_s": [round(before.engine.startup_s, 1), round(after.engine.startup_s, 1)],
    }


def report_json(report: dict) -> str:
    """The report as indented JSON, each innermost list on one line (a request's row, an engine's sample)."""
    return re.sub(
        r"\[\n\s*([^\[\]{}]*?)\n\s*\]",  # a newline is never inside a JSON string: only lists match
        lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]",
        json.dumps(report, indent=2),
    )


def per_request(trace: list, replayed: list[dict], simulated: list) -> list[list]:
    """Per request, in arrival order: t, prompt and output tokens, then TTFT and ITL (s) on the cluster (None
    where it failed) and in the simulator; what a later look at a gap starts from."""
    pairs = sorted(zip(trace, replayed, strict=True), key=lambda pair: pair[0].t)
    return [
        [round(r.t, 3), r.prompt_tokens, r.output_tokens]
        + [None if "failed" in m else round(m[k], 4) for k in ("ttft_s", "itl_s")]
        + [round(s.ttft_s, 4), round(s.itl_s, 4)]
        for (r, m), s in zip(pairs, sorted(simulated, key=lambda s: s.arrival), strict=True)
    ]


def by_minute(report_path: str, window_s: float = 60.0) -> None:
    """A saved report's ``per_request`` by minute of arrival: TTFT p50 / p90 on both sides, and the prompt
    tokens whose first token came in that minute (what the prefill engines got through) per second."""
    with open(report_path) as f:
        report = json.load(f)
    for name, load in report["loads"].items():
        rows = load.get("per_request")
        if not rows:
            sys.exit(f"{report_path}: {name}: no per_request (reports from before 2026-11-26 have none)")
        print(f"{name}: from t | requests | TTFT p50 | TTFT p90 (s) | prompt tok/s prefilled; each cluster / simulator")
        last = max(t + ttft for t, _, _, ttft, _, _, _ in rows if ttft is not None)
        for start in range(0, int(last + window_s), int(window_s)):
            here = [r for r in rows if start <= r[0] < start + window_s]
            done = [
                sum(r[1] for r in rows if r[col] is not None and start <= r[0] + r[col] < start + window_s) / window_s
                for col in (3, 5)
            ]
            ttft = [
                [quantile([r[col] for r in here if r[col] is not None] or [0.0], q) for col in (3, 5)]
                for q in (0.5, 0.9)
            ]
            cells = " | ".join(f"{a:.1f} / {b:.1f}" if here else "-" for a, b in ttft)
            print(f"{start:5d} | {len(here):4d} | {cells} | {done[0]:.0f} / {done[1]:.0f}")
        if "simulator_prefill_passes" in load:
            passes_by_minute(load["simulator_prefill_passes"], window_s)
    if "engine_samples" in report:
        engines_by_minute(report["engine_samples"], window_s)


def pass_rows(result: SimulationResult) -> dict:
    """``result.prefill_passes`` as a report's table, by time."""
    return {
        "columns": ["t", "engine", "passes", "tokens", "sequences", "seconds", "seconds_x_sequences"],
        "rows": [
            [t, f"prefill-{replica}", *(round(v, 3) for v in tally)]
            for (replica, t), tally in sorted(result.prefill_passes.items(), key=lambda kv: kv[0][::-1])
        ],
    }


def passes_by_minute(passes: dict, window_s: float) -> None:
    """The simulator's prefill passes by minute of their start, per engine: passes per second, tokens and
    sequences per pass, seconds per pass, and per request (what vllm:request_prefill_time_seconds reads)."""
    print("simulator: engine | from t | passes / s | tokens / pass | sequences / pass | s / pass | s / request")
    sums: dict[tuple[str, int], list[float]] = {}
    for t, engine, *tally in passes["rows"]:
        key = (engine, int(t // window_s * window_s))
        sums[key] = [a + b for a, b in zip(sums.get(key, [0.0] * len(tally)), tally, strict=True)]
    for (engine, start), (n, tokens, seqs, seconds, weighted) in sorted(sums.items()):
        print(
            f"{engine} | {start:5d} | {n / window_s:5.2f} | {tokens / n:6.0f} | {seqs / n:4.2f} | "
            f"{seconds / n:5.2f} | {weighted / seqs:5.2f}"
        )


def attainment(pairs: list[tuple[float, float]], ttft_s: float, itl_s: float) -> float:
    """The share of (TTFT, ITL) pairs within both targets."""
    return sum(1 for ttft, itl in pairs if ttft <= ttft_s and itl <= itl_s) / len(pairs)


def load_shared_core(paths: list[str] | None) -> SharedCore:
    """The slowdowns beside a busy engine that probes measured (their ``shared_core``:
    ``lab/probe_shared_start.py --out`` on a core, ``lab/probe_host_load.py --other-core --out`` on the
    host), each field the mean over the probes that measured it, or the simulator's default (the core split
    evenly, the host no slower) where none did."""
    if not paths:
        return EVEN_SHARE
    values: dict[str, list[float]] = collections.defaultdict(list)
    over_up: dict[str, list[float]] = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            probe = json.load(f)
        measured = probe.get("shared_core")
        if not isinstance(measured, dict):
            sys.exit(f"{path}: no 'shared_core' (written by lab/probe_shared_start.py or probe_host_load.py --out)")
        try:
            SharedCore(**measured)
        except (TypeError, ValueError) as e:
            sys.exit(f"{path}: shared_core: {e}")
        # older probes divided the start-up by a scale-up's beside an idle engine, not by the profile's
        newer = "at_up" in probe.get("prefill_1_startup_s", {})
        for name, value in measured.items():
            (over_up if name == "startup" and newer else values)[name].append(value)
    values.update(over_up)  # a newer probe's start-up, where there is one
    return SharedCore(**{name: round(statistics.mean(v), 3) for name, v in values.items()})


@dataclasses.dataclass
class SavedRun:
    """What the simulator needs to run an ``--autoscale`` report's replay again: its spec (with the proxy's
    routing as the run had it), the profile its autoscaler read, the engines' speed, their cores, and per load
    the trace it replayed."""

    report: dict
    spec: ClusterSpec
    profile: PerformanceProfile
    physics: PerformanceProfile
    cores: dict | None
    traces: dict[str, list]

    def predict(self, name: str, shared: SharedCore, first_decision_s: float | None = None) -> SimulationResult:
        phase = self.report.get("decision_phase_s") if first_decision_s is None else first_decision_s
        return predict(self.spec, self.profile, self.traces[name], shared, self.physics, phase, self.cores)


def saved_run(report_path: str, core_plan: str | None, seed: int, duration_s: float) -> SavedRun:
    with open(report_path) as f:
        report = json.load(f)
    spec = ClusterSpec.from_file(report["config"])
    # The proxy's routing as the run had it (reports before it was saved: the demo's round robin then).
    prefill, decode = report.get("routing", ("round_robin", "round_robin"))
    routing = spec.proxy.routing.model_copy(update={"prefill": prefill, "decode": decode})
    spec = spec.model_copy(update={"proxy": spec.proxy.model_copy(update={"routing": routing})})
    profile = load_profile(report["profile"].split(" (")[0])
    physics = profile  # the engines' speed: around the replay where the run profiled them after it, too
    if after := report.get("profile_after"):
        physics = mean_profile(profile, load_profile(after), "around-the-replay", f"mean of the profiles and {after}")
    seed, duration_s = report.get("seed", seed), report.get("duration_s", duration_s)  # the run's own
    if spec.autoscaling is None:
        sys.exit(f"{report['config']}: no autoscaling section")
    cores = shared_cores(spec)
    core_plan = core_plan or report.get("core_plan", "").split(" (")[0]
    if core_plan:
        plan = dict(item.split(":") for item in core_plan.split())
        cores = {engine: frozenset((0, int(c)) for c in plan_cores.split(",")) for engine, plan_cores in plan.items()}
    replayed = {}
    for name, load in report["loads"].items():
        if "per_request" in load:  # the requests it replayed (a load's definition may have changed since)
            trace = [traces.TraceRequest(t, prompt, output) for t, prompt, output, *_ in load["per_request"]]
        else:
            _, trace = load_trace(name, profile, spec.prefill.replicas, duration_s, seed)
        if len(trace) != load["requests"]:
            sys.exit(f"{name}: {len(trace)} requests, the report replayed {load['requests']}: --seed / --duration?")
        replayed[name] = trace
    return SavedRun(report, spec, profile, physics, cores, replayed)


def resimulate(report_path: str, core_plan: str | None, seed: int, duration_s: float, shared: SharedCore) -> None:
    run = saved_run(report_path, core_plan, seed, duration_s)
    spec, cores = run.spec, run.cores
    for name, load in run.report["loads"].items():
        result = run.predict(name, shared)
        records, sim = result.records, slo_attainment(spec, result)
        real = load["slo_attainment"]["cluster"]
        rows = {
            "TTFT p50": statistics.median(r.ttft_s for r in records),
            "ITL p50": statistics.median(r.itl_s for r in records),
        }
        measured = {key: load["quantiles"][key]["cluster_s"] for key in rows}
        print(
            f"{name}: SLO attainment cluster {100 * real:.1f} %, simulator {100 * sim:.1f} % "
            f"({100 * (sim - real):+.1f} points); "
            + ", ".join(f"{k} {1000 * measured[k]:.0f} / {1000 * v:.0f} ms" for k, v in rows.items())
            + f"; cores {sorted((e, sorted(c for _, c in cs)) for e, cs in (cores or {}).items())}"
        )
        by_phase = {t: slo_attainment(spec, run.predict(name, shared, t)) for t in phases(spec.autoscaling.interval_s)}
        print("  first decision at " + ", ".join(f"{t:g} s: {100 * a:.1f} %" for t, a in by_phase.items()))
        passes_by_minute(pass_rows(result), 60.0)


# What --sensitivity varies: how much slower than alone an engine works beside a busy one on its core (the last
# only where it is given; else a decode step beside a decode engine takes ``decode`` and moves with it).
SENSITIVE_FIELDS = ("prefill", "decode", "decode_beside_decode")


def sensitivity(run: SavedRun, shared: SharedCore, step: float) -> dict[str, dict[str, dict[str, float]]]:
    """Per load, per slowdown of ``SENSITIVE_FIELDS`` that ``shared`` gives, per quantile (``"TTFT p50"``...):
    its elasticity, ``ln(q_high / q_low) / ln(high / low)`` with the quantile simulated at the slowdown ``step``
    lower (``low``) and ``step`` higher (``high``). 2: a 5 % error in the slowdown is a 10 % error in the quantile."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    fields = [field for field in SENSITIVE_FIELDS if getattr(shared, field) is not None]
    for name in run.traces:
        out[name] = {}
        for field in fields:
            low, high = (max(1.0, getattr(shared, field) * factor) for factor in (1 - step, 1 + step))
            q_low, q_high = (
                latency_quantiles(run.predict(name, dataclasses.replace(shared, **{field: value})).records)
                for value in (low, high)
            )
            out[name][field] = {q: round(math.log(q_high[q] / q_low[q]) / math.log(high / low), 2) for q in q_low}
    return out


def decode_slowdowns(run: SavedRun, busy: int = 15, window_s: float = 60.0) -> list[float]:
    """How many times slower than the profile has it alone the cluster's decode steps ran, from a report's
    ``engine_samples``: per pair of an engine's readings with ``busy`` requests or more running at both, the
    seconds per step between them over the profile's step for their mean batch, at the mean context of a
    sequence found running (prompt plus half the output, weighted by output: E[o^2] / 2 E[o]) among the requests
    that arrived in the ``window_s`` before."""
    samples = run.report.get("engine_samples")
    if not samples or "steps" not in samples["columns"]:
        return []
    arrivals = [r for trace in run.traces.values() for r in trace]
    last: dict[str, dict] = {}
    out = []
    for values in samples["rows"]:
        row = dict(zip(samples["columns"], values, strict=True))
        before, last[row["engine"]] = last.get(row["engine"]), row
        if before is None or min(row["running"], before["running"]) < busy or row["steps"] <= before["steps"]:
            continue
        recent = [r for r in arrivals if row["t"] - window_s <= r.t < row["t"]]
        if not recent:
            continue
        outputs = sum(r.output_tokens for r in recent)
        context = (
            sum(r.prompt_tokens for r in recent) / len(recent) + sum(r.output_tokens**2 for r in recent) / 2 / outputs
        )
        step_s = (row["t"] - before["t"]) / (row["steps"] - before["steps"])
        out.append(step_s / run.physics.decode_step_seconds(round((row["running"] + before["running"]) / 2), context))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument(
        "--profile",
        help="the simulator's profile; by default one measured on the started cluster first (pdserve profile), "
        "so the simulator models the engines as fast as they run in this run (shared machines vary 2x by the day)",
    )
    parser.add_argument("--profile-out", help="where the measured profile goes (default: beside --out, or a temp dir)")
    parser.add_argument("--trace", help="a trace file (JSON lines) instead of the generated loads")
    parser.add_argument(
        "--loads",
        default=",".join(LOADS),
        help="comma-separated, of: "
        + ", ".join(f"{k} ({v:g} x the prefill pool's capacity)" for k, v in LOADS.items())
        + ", bursty, cold",
    )
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of each generated trace")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--autoscale",
        action="store_true",
        help="the spec's autoscaler on both sides (it starts at the spec's replicas); adds SLO attainment",
    )
    parser.add_argument("--out", help="also write the report (JSON) here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--profile-after",
        action="store_true",
        help="with --autoscale: profile the engines again after the replay. The simulator's engines then run at "
        "the mean of the two profiles (the machine's speed around the replay) while its autoscaler reads the "
        "profile before, as the cluster's did; the report adds the drift and the prediction from the profile before",
    )
    parser.add_argument(
        "--resimulate",
        metavar="REPORT",
        help="no cluster: the simulator side of an --autoscale REPORT again (its config, profile, seed and "
        "duration), with today's simulator and --core-plan; against the cluster attainment it measured",
    )
    parser.add_argument(
        "--sensitivity",
        type=float,
        metavar="STEP",
        help="with --resimulate: how much each quantile moves per change of its input: the simulator run with "
        "each slowdown beside a busy engine (SharedCore's prefill, decode, decode_beside_decode where given) STEP "
        "(e.g. 0.05) lower and higher; "
        "prints the elasticities (2: a 5 %% error in the slowdown is a 10 %% error in the quantile)",
    )
    parser.add_argument(
        "--core-plan",
        help="with --resimulate: the engines' cores as the cluster ran them, e.g. 'prefill-0:0 prefill-1:1 "
        "decode-0:0' (default: the report's core_plan, else the plan the code makes for the spec now)",
    )
    parser.add_argument(
        "--shared-core",
        metavar="PROBE",
        nargs="+",
        help="the simulator slows an engine beside a busy one on its core as lab/probe_shared_start.py "
        "--out PROBE measured; of several, the mean (default: the core split evenly)",
    )
    parser.add_argument(
        "--by-minute",
        metavar="REPORT",
        help="no cluster: a saved report's requests by minute (TTFT on both sides, prompt tokens prefilled per s)",
    )
    parser.add_argument(
        "--sample-engines",
        type=float,
        metavar="S",
        help="every S seconds of the replay, read each serving engine's /metrics (prompt tokens, prefill and "
        "queue time, waiting, running, KV use) into the report's engine_samples",
    )
    args = parser.parse_args()
    if args.by_minute:
        by_minute(args.by_minute)
        return
    shared = load_shared_core(args.shared_core)
    if args.resimulate and args.sensitivity:
        run = saved_run(args.resimulate, args.core_plan, args.seed, args.duration)
        for name, fields in sensitivity(run, shared, args.sensitivity).items():
            cluster = {q: row["cluster_s"] for q, row in run.report["loads"][name]["quantiles"].items()}
            print(f"{name}: elasticity of the simulator's quantiles in the slowdowns (cluster's value)")
            print("| slowdown | " + " | ".join(f"{q} ({1000 * v:.0f} ms)" for q, v in cluster.items()) + " |")
            for field, row in fields.items():
                print(f"| {field} {getattr(shared, field):g} | " + " | ".join(f"{e:.2f}" for e in row.values()) + " |")
        if slowdowns := decode_slowdowns(run):
            q1, median, q3 = statistics.quantiles(slowdowns, n=4)
            print(
                f"the cluster's busy decode steps over the profile's alone: median {median:.2f} "
                f"(quartiles {q1:.2f}-{q3:.2f}, {len(slowdowns)} readings)"
            )
        return
    if args.resimulate:
        resimulate(args.resimulate, args.core_plan, args.seed, args.duration, shared)
        return

    spec = ClusterSpec.from_file(args.config)
    split = (spec.prefill.replicas, spec.decode.replicas)
    profile_path = args.profile or args.profile_out
    if profile_path is None:
        profile_path = args.out.removesuffix(".json") + "-profile.yaml" if args.out else tempfile.mktemp(".yaml")
    config = args.config
    if args.autoscale:  # the cluster's autoscaler and the simulator's must read the same profile
        if args.profile is None:  # measured on the same engines, without an autoscaler to move them meanwhile
            profiled = pdserve("profile", spec_copy(args.config, autoscaling=None), "--out", profile_path, timeout=1800)
            if profiled.returncode != 0:
                sys.exit(f"pdserve profile failed:\n{profiled.stdout}\n{profiled.stderr}")
        config = spec_copy(args.config, profile=os.path.abspath(profile_path))
    up = pdserve("up", config, "--detach")
    if up.returncode != 0:
        sys.exit(f"pdserve up failed:\n{up.stdout}\n{up.stderr}")
    measured = {}
    sampler: EngineSampler | None = None
    phase = None  # where the autoscaler's clock ticked into the replay
    try:
        if args.profile is None and not args.autoscale:  # the running cluster's engines, measured now
            profiled = pdserve("profile", config, "--out", profile_path, timeout=1800)
            if profiled.returncode != 0:
                sys.exit(f"pdserve profile failed:\n{profiled.stdout}\n{profiled.stderr}")
        profile = load_profile(profile_path)
        capacity = prefill_capacity_rps(profile, spec.prefill.replicas, MIX, args.seed)
        if args.trace:
            cases = {args.trace: (None, traces.read_trace(args.trace))}
        else:
            cases = {
                name: load_trace(name, profile, spec.prefill.replicas, args.duration, args.seed)
                for name in args.loads.split(",")
            }
        limit = spec.engine.max_model_len
        for name, (_, trace) in cases.items():
            if any(r.prompt_tokens + r.output_tokens > limit for r in trace):
                sys.exit(f"{name}: the trace has requests longer than engine.max_model_len ({limit})")
        status = json.loads(pdserve("status", "--json").stdout)
        replay_start = time.time()
        sampler = EngineSampler(args.sample_engines) if args.sample_engines else None
        stalls = []
        with sampler or contextlib.nullcontext():
            for name, (_, trace) in cases.items():  # one after the other: each replay ends when its last answer did
                measured[name], seen = replay_apart(status["proxy_url"], status["model"], trace)
                stalls += seen
        status = json.loads(pdserve("status", "--json").stdout)
        autoscaler = status.get("autoscaler") or {}
        if autoscaler and spec.autoscaling is not None:
            phase = decision_phase(autoscaler["decisions"], replay_start, spec.autoscaling.interval_s)
        events = [  # what the controller did to the engines while the traces ran, seconds into the replay
            f"{event['t'] - replay_start:.0f}s {event['message']}"
            for event in status["events"]
            if event["t"] >= replay_start and event["message"].startswith(("scaling", "prefill-", "decode-"))
        ]
    finally:
        pdserve("down")
    physics, after = profile, None  # how fast the simulator's engines run; the profile after the replay
    if args.profile_after and args.autoscale:
        after_path = profile_path.removesuffix(".yaml") + "-after.yaml"
        profiled = pdserve("profile", spec_copy(args.config, autoscaling=None), "--out", after_path, timeout=1800)
        if profiled.returncode != 0:  # the replay is not lost: the report says so and uses the profile before
            print(f"pdserve profile after the replay failed:\n{profiled.stdout}\n{profiled.stderr}", file=sys.stderr)
        else:
            after = load_profile(after_path)
            physics = mean_profile(profile, after, "around-the-replay", f"mean of {profile_path} and {after_path}")

    report = {
        "config": args.config,
        "profile": profile_path if args.profile else f"{profile_path} (measured in this run)",
        "prefill_capacity_rps": round(capacity, 3),
        "tolerance": TOLERANCE,
        "seed": args.seed,
        "duration_s": args.duration,
        "shared_core": {"probes": args.shared_core or [], **dataclasses.asdict(shared)},  # the probes, their mean
        "routing": [spec.proxy.routing.prefill, spec.proxy.routing.decode],
        "decision_phase_s": phase,
        "core_plan": " ".join(
            f"{engine}:{','.join(str(c) for _, c in sorted(cs))}" for engine, cs in (shared_cores(spec) or {}).items()
        ),
        "loads": {},
        # when the replaying client got no CPU (testlib.fidelity.client_stalls): seconds into the replay, how long
        "client_stalls_s": [[round(start - replay_start, 1), round(end - start, 2)] for start, end in stalls],
    }
    if after is not None:
        report["profile_after"] = after_path
        report["drift"] = drift(profile, after)
    if sampler is not None:
        report["engine_samples"] = {"columns": ["t", "engine", *ENGINE_SAMPLES], "rows": sampler.rows}
        if sampler.decisions:  # every decision of the cluster's autoscaler in the replay, beside the simulator's
            report["cluster_decisions"] = decision_rows(
                {**d["observed"], **d, "t": t - replay_start} for t, d in sorted(sampler.decisions.items())
            )
    if args.autoscale:  # what the cluster's autoscaler changed, in order
        report["cluster_changes"] = [change["changed"] for change in autoscaler.get("changes", [])]
        report["cluster_events"] = events
    for name, (rate, trace) in cases.items():
        replayed = measured[name]  # in the trace's order
        failed = [m["failed"] for m in replayed if "failed" in m]
        measured[name] = [m for m in replayed if "failed" not in m]
        if args.autoscale and spec.autoscaling is not None:
            result = predict(spec, profile, trace, shared, physics, phase)
            simulated, scaled = result.records, result.timeline
        else:
            simulated = simulate(profile, StaticPolicy(*split), trace, SloTargets(1e9, 1e9), split).records
        rows = compare(measured[name], simulated)
        report["loads"][name] = {
            "rate_rps": None if rate is None else round(rate, 3),
            "requests": len(trace),
            "failed": failed,
            "paths": dict(collections.Counter(m["path"] for m in measured[name])),
            "mean_prompt_tokens": round(statistics.mean(r.prompt_tokens for r in trace), 1),
            "mean_output_tokens": round(statistics.mean(r.output_tokens for r in trace), 1),
            "quantiles": rows,
            "within_tolerance": within(rows),
            "per_request": per_request(trace, replayed, simulated),
            # requests the client sent after their time (a stall of its own; its threads all busy): TTFT is
            # timed from the send, so a queue in the client would not show in it
            "sent_late": {
                "over_0.25_s": sum(1 for m in measured[name] if m["late_s"] > 0.25),
                "max_s": round(max((m["late_s"] for m in measured[name]), default=0.0), 3),
            },
        }
        if args.autoscale and spec.autoscaling is not None:
            report["loads"][name]["simulator_prefill_passes"] = pass_rows(result)
            targets = spec.autoscaling.targets
            real = attainment(
                [(m["ttft_s"], m["itl_s"]) for m in measured[name]], targets.ttft_p90_s, targets.itl_p90_s
            )
            sim = slo_attainment(spec, result)
            rows_of = report["loads"][name]["per_request"]  # t, prompt, output, cluster TTFT, ITL, simulator's
            report["loads"][name]["holds_from_s"] = {  # the first minute from which every later one holds
                side: holds_from(
                    minutes_holding(
                        [(r[0], r[3 + k], r[4 + k]) for r in rows_of if r[3 + k] is not None],
                        targets.ttft_p90_s,
                        targets.itl_p90_s,
                    )[:-1]  # the last minute is cut by the trace's end
                )
                for side, k in (("cluster", 0), ("simulator", 2))
            }
            report["loads"][name]["slo_attainment"] = {
                "cluster": round(real, 4),
                "simulator": round(sim, 4),
                "points": round(100 * (sim - real), 1),
                **(
                    {}
                    if physics is profile
                    else {
                        "simulator_profile_before": round(
                            slo_attainment(spec, predict(spec, profile, trace, shared, None, phase)), 4
                        )
                    }
                ),
                # how much the prediction moves with where the controller's clock ticks into the trace
                "simulator_by_first_decision_s": {
                    str(t): round(slo_attainment(spec, predict(spec, profile, trace, shared, physics, t)), 4)
                    for t in phases(spec.autoscaling.interval_s)
                },
                "simulator_prefill_sizes": sorted({row["prefill"] for row in scaled}),
                "simulator_decisions": decision_rows(
                    {**row, "prefill_waiting": row["prefill_queue"], "decode_waiting": row["decode_queue"]}
                    for row in scaled
                ),
                "simulator_changes": [  # (seconds into the trace, prefill, decode) at each change of a target
                    (round(row["t"]), row["prefill"], row["decode"])
                    for before, row in zip([None, *scaled], scaled, strict=False)
                    if before is None or (before["prefill"], before["decode"]) != (row["prefill"], row["decode"])
                ],
            }
    if args.out:
        with open(args.out, "w") as f:
            f.write(report_json(report) + "\n")
    if args.json:
        print(report_json(report))
        return
    print(f"{args.config}, profile {report['profile']}; cluster / simulator (simulator / cluster):")
    print("| load | req/s | requests | " + " | ".join(next(iter(report["loads"].values()))["quantiles"]) + " |")
    for name, load in report["loads"].items():
        cells = [
            f"{row['cluster_s'] * 1000:.0f} / {row['simulator_s'] * 1000:.0f} ms ({row['ratio']:.2f})"
            for row in load["quantiles"].values()
        ]
        print(f"| {name} | {load['rate_rps']} | {load['requests']} | " + " | ".join(cells) + " |")
        if "slo_attainment" in load:
            print(f"  SLO attainment: {load['slo_attainment']}")
            print(f"  every minute holds the targets from (s): {load['holds_from_s']}")
    if stalled := report["client_stalls_s"]:  # the cluster's figures then measure the client's waits as well
        print(f"the client stalled {len(stalled)} times in the replay, {sum(s for _, s in stalled):.1f} s in all")


if __name__ == "__main__":
    main()
