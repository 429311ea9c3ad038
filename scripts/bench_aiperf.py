"""pdserve against colocated serving, measured by a client nobody here wrote: NVIDIA's ``aiperf``.

Two set-ups on the same cores, the same synthetic load, one run:

1. ``pdserve``: CONFIG's cluster (``pdserve up --detach``): a prefill engine and a decode engine, each on
   its own core, KV between them over our connector, behind pdserve's proxy.
2. ``colocated``: two plain vLLM servers with the same model and settings on the same two cores, each
   computing its requests' prompts and tokens itself, behind ``vllm-router --policy round_robin``.

For each, ``aiperf profile`` sends ``--requests`` streamed chat requests at ``--rate`` per second (Poisson
arrivals), synthetic prompts of ``--input-tokens`` (mean) and ``--output-tokens`` each, and reports TTFT
and ITL (p50, p90), requests/s, and goodput: requests/s that met both ``--ttft-slo-ms`` and
``--itl-slo-ms``.

aiperf pins versions ours do not (orjson, psutil, pyzmq, prometheus-client), so it lives in a venv of its
own: ``--setup`` makes ``.venv-aiperf`` with ``aiperf==AIPERF_VERSION`` (it needs the package registry).

    python scripts/bench_aiperf.py --setup
    python scripts/bench_aiperf.py [--rate 0.3] [--requests 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.models import resolve_model  # noqa: E402
from orchestrator.spec import ClusterSpec  # noqa: E402
from testlib.plain_vllm import plain_vllm  # noqa: E402

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = ROOT / ".venv-aiperf"
PDSERVE = [sys.executable, "-m", "orchestrator.cli"]
METRICS = ("time_to_first_token", "inter_token_latency", "request_throughput", "goodput")


def setup() -> None:
    subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
    pip = [str(AIPERF_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"aiperf=={AIPERF_VERSION}"], check=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        time.sleep(1)
    raise SystemExit(f"{url} did not answer /health in {timeout_s:g} s")


@contextlib.contextmanager
def pdserve_cluster(config: str) -> Iterator[str]:
    subprocess.run([*PDSERVE, "up", config, "--detach"], check=True, stdout=subprocess.DEVNULL)
    try:
        status = json.loads(subprocess.run([*PDSERVE, "status", "--json"], check=True, capture_output=True).stdout)
        yield status["proxy_url"]
    finally:
        subprocess.run([*PDSERVE, "down"], stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def colocated(config: str, logs: Path) -> Iterator[str]:
    """Two plain vLLM servers where CONFIG puts its two engines, behind vllm-router's round robin."""
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(plain_vllm(config, logs / f"colocated-{engine}.log", 5.0, engine))[1]
            for engine in ("prefill-0", "decode-0")
        ]
        port = free_port()
        router_bin = str(Path(sys.executable).parent / "vllm-router")
        command = [router_bin, "--port", str(port), "--policy", "round_robin", "--worker-urls", *urls]
        with open(logs / "colocated-router.log", "w") as out:
            router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(router.wait, 30)
        stack.callback(router.terminate)
        wait_healthy(f"http://127.0.0.1:{port}", 60)
        yield f"http://127.0.0.1:{port}"


def run_aiperf(name: str, url: str, spec: ClusterSpec, args: argparse.Namespace, artifacts: Path) -> dict:
    out = artifacts / name
    command = [
        str(AIPERF_VENV / "bin" / "aiperf"), "profile",
        "--model", spec.model_name, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", resolve_model(spec.model),
        "--request-rate", str(args.rate), "--request-count", str(args.requests),
        "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_tokens), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", f"max_tokens:{args.output_tokens}", "--extra-inputs", "ignore_eos:true",
        "--goodput", f"time_to_first_token:{args.ttft_slo_ms} inter_token_latency:{args.itl_slo_ms}",
        "--random-seed", "7", "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    # Not HF_HUB_OFFLINE: aiperf 0.13's offline path takes a local tokenizer directory for a repo id and
    # fails; given a directory it asks the Hub nothing anyway.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    (artifacts / f"{name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"aiperf failed on {name} ({result.returncode}); its output: {artifacts / name}.log")
    return summary(next(out.rglob("profile_export_aiperf.json")))


def summary(export: Path) -> dict:
    """The figures this benchmark reports, from aiperf's JSON export."""
    data = json.loads(export.read_text())
    records = data.get("records", data)
    picked = {}
    for metric in METRICS:
        entry = records.get(metric) or {}
        picked[metric] = {k: entry.get(k) for k in ("p50", "p90", "avg", "unit") if entry.get(k) is not None}
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help=f"make .venv-aiperf with aiperf=={AIPERF_VERSION}")
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--rate", type=float, default=0.3, help="requests per second (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=30, help="(default: %(default)s)")
    parser.add_argument("--input-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--ttft-slo-ms", type=float, default=4000, help="(default: %(default)s)")
    parser.add_argument("--itl-slo-ms", type=float, default=250, help="(default: %(default)s)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.setup:
        setup()
        return
    spec = ClusterSpec.from_file(args.config)
    artifacts = Path(tempfile.mkdtemp(prefix="bench-aiperf-"))
    report: dict = {"load": {k: getattr(args, k) for k in ("rate", "requests", "input_tokens", "output_tokens")}}
    report["slo_ms"] = {"ttft": args.ttft_slo_ms, "itl": args.itl_slo_ms}
    with pdserve_cluster(args.config) as url:
        report["pdserve"] = run_aiperf("pdserve", url, spec, args, artifacts)
    with colocated(args.config, artifacts) as url:
        report["colocated"] = run_aiperf("colocated", url, spec, args, artifacts)
    report["artifacts"] = str(artifacts)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
