"""P/D across hosts vs on one host: TTFT, KV transfer time, and time to ready, in one run.

Runs configs/multi-host-cpu.yaml three ways, one after the other, with the same
engines, cores and prompts:

- ``one-host``: both engines on one Ray node (a local head), UCX free to pick
  shared memory (what a single machine gets);
- ``one-host-tcp``: the same with ``UCX_TLS=tcp`` (the transport the bed uses,
  without the hosts);
- ``three-hosts``: the test bed (``testlib/testbed``: head, prefill, decode as
  network namespaces on a bridge), KV crossing the bridge over TCP.

For each, ``--rounds`` streamed completions per prompt size (``--tokens``),
each with a fresh prefix (no prefix-cache hits), report the median TTFT seen by
the client and the median ``transfer_ms`` / bytes of ``X-PDServe-KV``, and the
ratios to ``one-host``. Needs root (network namespaces).

    python scripts/bench_multihost.py [--rounds 5] [--tokens 256,1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from contract.headers import KV as KV_HEADER  # noqa: E402
from testlib import testbed as hosts  # noqa: E402
from testlib.cluster_client import make_prompt  # noqa: E402

PDSERVE = [sys.executable, "-m", "orchestrator.cli"]
SPEC = ROOT / "configs" / "multi-host-cpu.yaml"


def one_host_spec(ucx_tls: str | None) -> dict:
    """The multi-host spec on one local Ray head: no placement, loopback, the same cores."""
    spec = copy.deepcopy(yaml.safe_load(SPEC.read_text()))
    spec.pop("ray", None)
    spec["proxy"]["host"] = "127.0.0.1"
    for role in ("prefill", "decode"):
        spec[role].pop("placement", None)
    env = spec["engine"].setdefault("env", {})
    env.pop("UCX_TLS", None)
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    return spec


def stream(url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(request, timeout=600) as response:
        header = response.headers.get(KV_HEADER, "")
        for raw in response:
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {") and '"text"' in line:
                ttft = time.perf_counter() - started
    report = dict(item.split("=", 1) for item in header.split("; ") if "=" in item)
    return {
        "ttft_s": ttft,
        "transfer_ms": float(report.get("transfer_ms", "nan")),
        "bytes": int(report.get("bytes", 0)),
        "source": report.get("source"),
    }


def measure(proxy_url: str, model: str, sizes: list[int], rounds: int, tag0: int) -> dict:
    results: dict[str, dict] = {}
    stream(proxy_url, model, make_prompt(tag0, 64))  # warm-up: handshakes, first allocation
    for size in sizes:
        runs = [stream(proxy_url, model, make_prompt(tag0 + size * 100 + i, size)) for i in range(rounds)]
        sources = {r["source"] for r in runs}
        if sources != {"transfer"}:
            raise SystemExit(f"{size} tokens: KV sources {sources}, expected only 'transfer'")
        results[str(size)] = {
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "transfer_ms": statistics.median(r["transfer_ms"] for r in runs),
            "bytes": statistics.median(r["bytes"] for r in runs),
        }
    return results


def run(argv: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@contextlib.contextmanager
def cluster(spec: dict, workdir: Path, wrap=lambda argv: argv) -> Iterator[tuple[dict, float]]:
    env = dict(os.environ, PDSERVE_STATE_DIR=str(workdir / "state"))
    env.pop("RAY_ADDRESS", None)
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec))
    started = time.monotonic()
    try:
        run(wrap([*PDSERVE, "up", str(path), "--detach"]), env)
        ready_s = time.monotonic() - started
        status = json.loads(run([*PDSERVE, "status", "--json"], env).stdout)
        yield status, ready_s
    finally:
        subprocess.run(wrap([*PDSERVE, "down"]), env=env, capture_output=True, timeout=300, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="256,1024")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    results: dict[str, dict] = {}
    tag = int(time.time()) % 100000 * 1000
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        for name, ucx in (("one-host", None), ("one-host-tcp", "tcp")):
            workdir = Path(tmp) / name
            workdir.mkdir()
            with cluster(one_host_spec(ucx), workdir) as (status, ready_s):
                results[name] = {
                    "ready_s": ready_s,
                    **measure(status["proxy_url"], status["model"], sizes, args.rounds, tag),
                }
            tag += 1
        workdir = Path(tmp) / "three-hosts"
        workdir.mkdir()
        bed_started = time.monotonic()
        hosts.up(("head", "prefill", "decode"))
        bed_s = time.monotonic() - bed_started
        try:
            spec = yaml.safe_load(SPEC.read_text())
            with cluster(spec, workdir, wrap=lambda argv: hosts.exec_argv("head", argv)) as (status, ready_s):
                timings = measure(status["proxy_url"], status["model"], sizes, args.rounds, tag)
                results["three-hosts"] = {"bed_up_s": bed_s, "ready_s": ready_s, **timings}
        finally:
            hosts.down()
    print(
        f"{'setup':<14}{'ready s':>9}" + "".join(f"{f'TTFT {s} s':>14}{f'KV {s} ms':>12}{f'MiB {s}':>9}" for s in sizes)
    )
    for name, r in results.items():
        line = f"{name:<14}{r['ready_s']:>9.1f}"
        for s in sizes:
            m = r[str(s)]
            line += f"{m['ttft_s']:>14.3f}{m['transfer_ms']:>12.1f}{m['bytes'] / 2**20:>9.1f}"
        print(line)
    base = results["one-host"]
    for name in ("one-host-tcp", "three-hosts"):
        ratios = ", ".join(
            f"{s} tokens: TTFT x{results[name][str(s)]['ttft_s'] / base[str(s)]['ttft_s']:.2f}, "
            f"KV x{results[name][str(s)]['transfer_ms'] / base[str(s)]['transfer_ms']:.2f}"
            for s in sizes
        )
        print(f"{name} / one-host: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
