"""Idle engines and the control plane, measured on a running cluster (``pdserve up --detach`` first).

1. Each engine's whole process tree (Ray actor, vLLM engine core, threads):
   CPU used over ``--idle-s`` seconds while no request runs, in % of a core
   (``/proc`` accounting through psutil); its busiest thread; and its threads'
   wake-ups (context switches) per second, which unlike CPU time do not depend
   on how fast the machine is that day.
2. ``pdserve status`` and ``pdserve status --json``: wall time of ``--runs``
   calls each, as a user runs them (a new process each), median and max.
3. With ``--down``: ``pdserve down`` once, timed (it stops the cluster).

With ``--plain``, a plain vLLM server (``vllm serve``: no Ray, no KV connector, no probes) of the same
model, settings and core as ``prefill-0`` runs beside the cluster and is measured in the same window:
the ratio of each engine's tree to it is what pdserve adds to an idle engine.

``--idle-only`` skips 2. To compare two commits' idle engines on one machine, run them in turn from a
``git worktree`` of each (``PYTHONPATH`` set to that tree for ``pdserve up`` and this script), as the
README's "Idle engines" section shows.

Run from the repository root: ``.venv/bin/python scripts/bench_control.py [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testlib.cpu_use import idle_use  # noqa: E402
from testlib.plain_vllm import plain_vllm  # noqa: E402

PDSERVE = [sys.executable, "-m", "orchestrator.cli"]


def timed(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    result = subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"pdserve {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return took, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--down", action="store_true", help="also time `pdserve down` (stops the cluster)")
    parser.add_argument("--idle-only", action="store_true", help="only the idle engines, not the status timings")
    parser.add_argument(
        "--plain", metavar="CONFIG", help="measure beside the engines a plain vLLM server as CONFIG's prefill-0"
    )
    parser.add_argument("--settle-s", type=float, default=20.0, help="--plain: idle this long before measuring")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    _, result = timed(["status", "--json"])
    status = json.loads(result.stdout)
    engines = {e["pid"]: e["engine_id"] for e in status["engines"] if e["pid"]}
    with contextlib.ExitStack() as stack:
        if args.plain:
            log = Path(status["log_dir"]) / "plain-vllm.log"
            engines[stack.enter_context(plain_vllm(args.plain, log, args.settle_s))[0]] = "plain-vllm"
        idle = idle_use(list(engines), args.idle_s)
    report: dict = {
        "connector": status["connector"],
        "idle_s": args.idle_s,
        "idle_cpu_pct": {engines[pid]: round(100 * use.cpu, 2) for pid, use in idle.items()},
        "idle_threads": {
            engines[pid]: {
                "busiest_thread": use.busiest_thread,
                "busiest_thread_pct": round(100 * use.busiest_thread_cpu, 2),
                "wakeups_per_s": round(use.wakeups_per_s),
            }
            for pid, use in idle.items()
        },
    }
    if args.plain:
        plain = report["idle_cpu_pct"]["plain-vllm"]
        report["idle_vs_plain"] = {
            engine: round(pct / plain, 2) for engine, pct in report["idle_cpu_pct"].items() if engine != "plain-vllm"
        }
    for name, cmd in () if args.idle_only else (("status", ["status"]), ("status_json", ["status", "--json"])):
        samples = [timed(cmd)[0] for _ in range(args.runs)]
        report[name + "_s"] = {"median": round(statistics.median(samples), 3), "max": round(max(samples), 3)}
    if args.down:
        report["down_s"] = round(timed(["down"])[0], 2)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"connector {report['connector']}: idle CPU over {args.idle_s:g} s, % of one core (engine's process tree)")
    for engine, entry in report["idle_threads"].items():
        print(
            f"  {engine:<12} {report['idle_cpu_pct'][engine]:6.2f} %   busiest thread "
            f"{entry['busiest_thread_pct']:.2f} % ({entry['busiest_thread']})   {entry['wakeups_per_s']} wake-ups/s"
        )
    for engine, ratio in report.get("idle_vs_plain", {}).items():
        print(f"  {engine:<12} {ratio:.2f}x the plain vLLM server's idle CPU")
    for name in ("status", "status_json"):
        if (r := report.get(name + "_s")) is not None:
            print(
                f"pdserve {name.replace('_json', ' --json'):<14} median {r['median']:.3f} s, "
                f"max {r['max']:.3f} s ({args.runs} runs)"
            )
    if "down_s" in report:
        print(f"pdserve down           {report['down_s']:.2f} s")


if __name__ == "__main__":
    main()
