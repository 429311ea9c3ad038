"""Role moves on the real CPU demo: how long a move takes, and a load whose mix flips, with moves on and off.

1. **Move time.** The demo's spec with its autoscaler idle (``interval_s`` an hour), prefill grown to 2; then
   ``--moves`` times ``pdserve scale --move prefill->decode`` and back. Per move: the controller's decision to
   serving in the new pool (``pdserve status``'s ``moves``: finishing the old work, here only the check that
   none is left, plus switching), and the CLI's whole call (it returns once the pools show the new sizes).
2. **A flipping mix.** One trace, ``--phase-s`` of long prompts (``--prompt-tokens``, 8 output tokens) then as
   long of long outputs (32-token prompts, ``--output-tokens``), replayed through the demo's autoscaler twice
   in the same run: with moves (``role_moves: true``) and without. Per run: requests failed, SLO attainment
   (TTFT and mean ITL both within the spec's targets; a failed request counts as missed), the moves, starts and
   stops the controller made; beside it, what ``pdserve simulate``'s model predicts for the same trace.

    python scripts/bench_moves.py [--config configs/local-cpu-autoscale.yaml] [--moves 5] [--phase-s 240]
        [--prompt-rps 0.7] [--output-rps 0.5] [--itl-target 0.3] [--seed 1] [--sides on,off] [--json out.json]
        [--skip-flip | --skip-timing]

Each part starts its own cluster (``pdserve up --detach``) and stops it; the state directory is a temporary
one, so a cluster of yours keeps running (the demo's ports must be free).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from orchestrator.autoscale.profile import load_profile  # noqa: E402
from orchestrator.autoscale.runner import simulate_spec  # noqa: E402
from orchestrator.autoscale.traces import TraceRequest  # noqa: E402
from orchestrator.spec import ClusterSpec  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.fidelity import replay  # noqa: E402

SHORT_PROMPT, SHORT_OUTPUT = 32, 8


def spec_file(config: Path, directory: Path, **changes: Any) -> Path:
    """A copy of ``config`` with ``changes`` (``autoscaling`` merged), its profile path made absolute."""
    raw = yaml.safe_load(config.read_text())
    scaling = raw["autoscaling"] | changes.pop("autoscaling", {})
    scaling["profile"] = str((config.parent / scaling["profile"]).resolve())
    path = directory / f"spec-{len(list(directory.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(raw | changes | {"autoscaling": scaling}))
    return path


def checked(*args: str, timeout: float = 900) -> str:
    done = pdserve(*args, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"pdserve {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def status() -> dict[str, Any]:
    return json.loads(checked("status", "--json"))


def time_moves(spec: Path, count: int) -> dict[str, Any]:
    """Part 1: ``count`` moves each way on an idle cluster."""
    checked("up", str(spec), "--detach", timeout=1200)
    try:
        checked("scale", "prefill=2", timeout=1200)
        cli_s: list[float] = []
        for _ in range(count):
            for way in ("prefill->decode", "decode->prefill"):
                started = time.perf_counter()
                checked("scale", "--move", way)
                cli_s.append(time.perf_counter() - started)
        moves = status()["moves"]
    finally:
        pdserve("down")
    decided = [m["finishing_s"] + m["switch_s"] for m in moves]
    return {
        "moves": len(moves),
        "decision_to_serving_s": _spread(decided),
        "switch_s": _spread([m["switch_s"] for m in moves]),
        "cli_s": _spread(cli_s),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def flip_trace(phase_s: float, prompt_rps: float, output_rps: float, prompt_tokens: int, output_tokens: int,
               seed: int) -> list[TraceRequest]:  # fmt: skip
    """Poisson arrivals: ``phase_s`` of long prompts at ``prompt_rps``, then ``phase_s`` of long outputs."""
    rng, out, t = random.Random(seed), [], 0.0
    for start, rate, prompt, output in (
        (0.0, prompt_rps, prompt_tokens, SHORT_OUTPUT),
        (phase_s, output_rps, SHORT_PROMPT, output_tokens),
    ):
        t = start
        while (t := t + rng.expovariate(rate)) < start + phase_s:
            out.append(TraceRequest(round(t, 3), prompt, output))
    return out


def run_flip(spec_path: Path, trace: list[TraceRequest]) -> dict[str, Any]:
    """Part 2, one side: replay ``trace`` through the autoscaled cluster; what it attained and did."""
    spec = ClusterSpec.from_file(spec_path)
    targets = spec.autoscaling.targets  # type: ignore[union-attr]
    checked("up", str(spec_path), "--detach", timeout=1200)
    try:
        first = status()
        began = time.time()
        answers = replay(first["proxy_url"], first["model"], trace)
        last = status()
    finally:
        pdserve("down")
    done = [a for a in answers if "failed" not in a]
    good = sum(a["ttft_s"] <= targets.ttft_p90_s and a["itl_s"] <= targets.itl_p90_s for a in done)
    said = [e["message"] for e in last["events"] if e["t"] >= began]
    halves = [[a for a, r in zip(answers, trace, strict=True) if (r.prompt_tokens > SHORT_PROMPT) == long]
              for long in (True, False)]  # fmt: skip
    return {
        "requests": len(answers),
        "failed": len(answers) - len(done),
        "slo_attainment": good / len(answers),
        "by_phase": [_attained(h, targets.ttft_p90_s, targets.itl_p90_s) for h in halves],
        "moves": [f"{m['engine_id']} {m['from']}->{m['to']}" for m in last["moves"]],
        "started": sum(" loading (" in m for m in said),
        "stopped": sum(m.endswith(" stopped") for m in said),
        "events": said,
        "autoscaler_changes": [
            {"t": round(c["t"] - began), "changed": c["changed"], "reasons": c["reasons"]}
            for c in (last.get("autoscaler") or {}).get("changes", [])
            if c["t"] >= began
        ],
    }


def _attained(answers: list[dict], ttft_s: float, itl_s: float) -> float:
    good = sum("failed" not in a and a["ttft_s"] <= ttft_s and a["itl_s"] <= itl_s for a in answers)
    return good / len(answers) if answers else 0.0


def predict(spec_path: Path, trace: list[TraceRequest], moves: bool) -> float:
    """The simulator's SLO attainment for ``trace`` on the spec's cluster."""
    spec = ClusterSpec.from_file(spec_path)
    profile = load_profile(spec.autoscaling.profile)  # type: ignore[union-attr, arg-type]
    return simulate_spec(spec, profile, trace, static=None, moves=moves).summary()["slo_attainment"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/local-cpu-autoscale.yaml"))
    parser.add_argument("--moves", type=int, default=5, help="moves each way in part 1")
    parser.add_argument("--phase-s", type=float, default=240.0)
    parser.add_argument("--prompt-rps", type=float, default=0.7)
    parser.add_argument("--output-rps", type=float, default=0.5)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--itl-target", type=float, default=0.3, help="p90 ITL target of part 2, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-flip", action="store_true")
    parser.add_argument("--sides", default="on,off", help="part 2's runs: moves on, off, or both in turn")
    args = parser.parse_args()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="bench-moves-") as tmp:
        directory = Path(tmp) / "specs"
        directory.mkdir()
        os.environ["PDSERVE_STATE_DIR"] = str(Path(tmp) / "state")
        if not args.skip_timing:
            idle = spec_file(args.config, directory, autoscaling={"interval_s": 3600})
            report["timing"] = time_moves(idle, args.moves)
            print(json.dumps(report["timing"]), flush=True)
        if not args.skip_flip:
            trace = flip_trace(args.phase_s, args.prompt_rps, args.output_rps, args.prompt_tokens,
                               args.output_tokens, args.seed)  # fmt: skip
            targets = {"targets": {"ttft_p90_s": 4.0, "itl_p90_s": args.itl_target}}
            for moves in [side == "on" for side in args.sides.split(",")]:
                spec = spec_file(args.config, directory, role_moves=moves, autoscaling=targets)
                side = run_flip(spec, trace) | {"predicted_slo_attainment": predict(spec, trace, moves)}
                report["moves on" if moves else "moves off"] = side
                print(json.dumps({k: v for k, v in side.items() if k != "events"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
