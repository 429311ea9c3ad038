"""An engine's start, phase by phase: pdserve's (the engine core forks its worker, ``connectors.vllm_plugin``)
against vLLM's spawn as it is from a Ray actor (``engine.env: {PDSERVE_FORK_WORKERS: "0"}``), in one run.

Each round starts the cluster of ``--config`` once per mode (the order alternates), with ``pdserve up
--detach`` in a private state dir, reads each engine's ``phases`` from ``pdserve status --json`` (seconds
since the engine was asked for), and stops it. Prints the median of each phase per mode and the ratio of the
engines' load times, fork / spawn. ``--connector vllm-nixl`` measures vLLM's connector (its NIXL agents
calmed, ``PDSERVE_CALM_NIXL``) and adds a third mode with them as vLLM builds them (spinning).

Run from the repository root: ``.venv/bin/python scripts/bench_start.py [--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.vllm_plugin import CALM_NIXL_ENV, FORK_WORKERS_ENV  # noqa: E402

PDSERVE = [sys.executable, "-m", "orchestrator.cli"]
MODES = {
    "fork": {},
    "spawn": {FORK_WORKERS_ENV: "0"},
    "spinning NIXL": {CALM_NIXL_ENV: "0"},  # with --connector vllm-nixl only
}


def pdserve(args: list[str], env: dict[str, str], timeout: float = 1800) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run([*PDSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"pdserve {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return time.perf_counter() - started, result.stdout


def one_start(config: dict, mode_env: dict[str, str], root: Path) -> dict:
    """Start the cluster of ``config`` with ``mode_env`` in its engines' environment; its engines' phases,
    the wall time of ``up`` and of ``down``."""
    engine = config.get("engine", {})
    spec = dict(config, engine=dict(engine, env={**engine.get("env", {}), **mode_env}))
    root.mkdir(parents=True)
    (root / "cluster.yaml").write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PDSERVE_STATE_DIR=str(root / "state"))
    env.pop("RAY_ADDRESS", None)
    try:
        up_s, _ = pdserve(["up", str(root / "cluster.yaml"), "--detach"], env)
        _, out = pdserve(["status", "--json"], env)
    finally:
        down_s, _ = pdserve(["down"], env)
    engines = json.loads(out)["engines"]
    return {
        "up_s": up_s,
        "down_s": down_s,
        "load_s": [e["load_s"] for e in engines],
        "phases": [{p["phase"]: p["s"] for p in e["phases"]} for e in engines],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--connector", choices=("pdserve", "vllm-nixl"), default=None, help="default: the config's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    if args.connector:
        config["connector"] = args.connector
    modes = ["fork", "spawn"] + (["spinning NIXL"] if config.get("connector") == "vllm-nixl" else [])
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                run = one_start(config, MODES[mode], Path(tmp) / f"{r}-{mode.replace(' ', '-')}")
                runs[mode].append(run)
                print(f"round {r + 1} {mode}: up {run['up_s']:.1f} s, engines {run['load_s']}", file=sys.stderr)
    summary = {}
    for mode, mode_runs in runs.items():
        phases = [p for run in mode_runs for p in run["phases"]]
        summary[mode] = {
            "up_s": statistics.median(run["up_s"] for run in mode_runs),
            "down_s": statistics.median(run["down_s"] for run in mode_runs),
            "load_s": statistics.median(s for run in mode_runs for s in run["load_s"]),
            "phases": {name: statistics.median(p[name] for p in phases if name in p) for name in phases[0]},
        }
    ratio = summary["fork"]["load_s"] / summary["spawn"]["load_s"]
    if args.json:
        print(json.dumps({"config": args.config, "connector": config.get("connector"), "rounds": args.rounds,
                          "modes": summary, "load_ratio_fork_over_spawn": ratio, "runs": runs}, indent=2))  # fmt: skip
        return
    names = list(summary["fork"]["phases"])
    print("| phase (median s since asked) | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{summary[m]['phases'].get(name, float('nan')):.1f}" for m in modes) + " |")
    for key in ("up_s", "down_s"):
        print(f"| `pdserve {key[:-2]}` | " + " | ".join(f"{summary[m][key]:.1f}" for m in modes) + " |")
    print(f"engine load time, fork / spawn: {ratio:.2f}")


if __name__ == "__main__":
    main()
