"""Proxy throughput and added latency: pdserve's proxy vs vllm-router, on stub engines that answer at once.

Starts, each as its own process on 127.0.0.1:

- a prefill and a decode stub engine (``tests/stub_engine.py``: vLLM's OpenAI
  routes with NixlConnector-style ``kv_transfer_params``, no model),
- our proxy, standalone: ``pdserve proxy --prefill URL --decode URL --workers N``,
- the same with authentication on (``ours+auth``): clients must present an API
  key (``--api-key-env``) and the proxy sends the engines the key derived from a
  cluster secret (``--cluster-secret-file``), as in a cluster,
- vllm-router in P/D mode (``vllm-router --vllm-pd-disaggregation --prefill URL
  --decode URL --policy round_robin``), when it is installed (``pip install
  -e '.[dev]'`` brings it),

checks that each proxy's answer went through both phases, then drives each with
the same load: ``--connections`` keep-alive connections sending non-streaming
chat completions for ``--duration`` seconds, ``--rounds`` times, alternating
ours and the router so both see the same machine. Then, at concurrency 1, the
p50 latency of ours, the router's, and of the decode stub called directly: our
p50 minus the direct one is the latency the proxy adds (two hops instead of one).

The load comes from ``wrk`` when it is on the PATH (``apt-get install wrk``;
C, so it takes little of the CPU the proxies need), else from an aiohttp loop
in this process. Also printed: the CPU time each proxy spent per request (all
its processes and threads), which depends less on how busy the machine is, and
Linux's CPU pressure before the benchmark starts (``/proc/pressure/cpu``: the
share of the last 10 s in which a task waited for a core; near 0, nothing else
was running).

    python scripts/bench_proxy.py [--duration 10] [--rounds 3] [--connections 32] [--workers 1] [--json]

``--baseline DIR`` adds the same proxy from another checkout (``git worktree add /tmp/base <commit>``),
measured in turn with ours (as ``ours@<DIR's name>``): what a change to the proxy costs, as a ratio from
one run. It may be given several times (variants of one change, each in its own checkout): all are
measured in the same rounds.

Every process runs on the same machine: compare ratios from one run, not
absolute numbers across runs or machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
EXPECTED = "hello from decode-0 with kv_transfer_params"
STREAMED = {"stream": True, "temperature": 0}
"""``--stream``: what each request adds; a greedy stream, which the proxy keeps the token ids of (so that another
engine can continue it, ``proxy.continuation``)."""


def answer_text(raw: bytes) -> str:
    """The text of a chat completion, whole or streamed."""
    if raw.startswith(b"{"):
        return json.loads(raw)["choices"][0]["message"]["content"]
    events = [json.loads(block[6:]) for block in raw.split(b"\n\n") if block.startswith(b"data: {")]
    return "".join(event["choices"][0]["delta"].get("content", "") for event in events if event["choices"])


@dataclass
class LoadResult:
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s * 1e6 / self.requests if self.requests else 0.0


# --- processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def started(name: str, command: list[str], log_dir: Path, repo: Path = REPO) -> Iterator[subprocess.Popen]:
    log = open(log_dir / f"{name}.log", "wb")
    env = os.environ | {"PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=repo, env=env)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_answering(url: str, process: subprocess.Popen, name: str, log_dir: Path, timeout_s: float = 60) -> None:
    """Wait until ``url`` answers a chat completion from both phases (or a stub's /health)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if url.endswith("/health"):
                urllib.request.urlopen(url, timeout=2).read()
                return
            request = urllib.request.Request(
                url,
                data=json.dumps(CHAT).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT_KEY}"},
            )
            text = answer_text(urllib.request.urlopen(request, timeout=5).read())
            if text != EXPECTED:
                raise RuntimeError(f"{name} answered {text!r}: not the decode engine's answer after a prefill")
            return
        except OSError as e:
            last = str(e)
            time.sleep(0.2)
    tail = (log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{name} did not answer at {url} ({last}); its log ends:\n{tail}")


def cpu_pressure() -> float | None:
    """Linux's share of the last 10 s in which some task waited for a CPU (%): how busy the machine was."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    match = re.search(r"avg10=([\d.]+)", line)
    return float(match[1]) if match else None


def cpu_seconds(process: subprocess.Popen) -> float:
    try:
        root = psutil.Process(process.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = proc.cpu_times()
                total += times.user + times.system
        return total
    except psutil.NoSuchProcess:
        return 0.0


# --- load -------------------------------------------------------------------------------


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
wrk.body = '{body}'
"""
CLIENT_KEY = "bench-client-key"
"""Every load generator sends it (``ours+auth`` checks it; the others ignore it)."""


def run_wrk(url: str, connections: int, duration_s: float, script: Path) -> LoadResult:
    threads = max(1, min(2, connections))
    seconds = max(1, round(duration_s))
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if not match:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    requests, seconds = int(match[1]), float(match[2]) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[match[3]]
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errors += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    return LoadResult(requests, errors, seconds, _wrk_ms(out, "50%"), _wrk_ms(out, "99%"))


def _wrk_ms(out: str, percentile: str) -> float:
    match = re.search(rf"^\s+{re.escape(percentile)}\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
    if not match:
        return float("nan")
    return float(match[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match[2]]


def run_aiohttp(url: str, connections: int, duration_s: float) -> LoadResult:
    import aiohttp

    async def main() -> LoadResult:
        latencies: list[float] = []
        errors = 0
        body = json.dumps(CHAT).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT_KEY}"}
        connector = aiohttp.TCPConnector(limit=connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            start = time.perf_counter()
            deadline = start + duration_s

            async def one_connection() -> None:
                nonlocal errors
                while time.perf_counter() < deadline:
                    sent = time.perf_counter()
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        if response.status != 200:
                            errors += 1
                    latencies.append(time.perf_counter() - sent)

            await asyncio.gather(*(one_connection() for _ in range(connections)))
            elapsed = time.perf_counter() - start
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1e3 if latencies else float("nan")
        p99 = latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else float("nan")
        return LoadResult(len(latencies), errors, elapsed, p50, p99)

    return asyncio.run(main())


class Load:
    def __init__(self, tool: str, script: Path) -> None:
        self.tool, self.script = tool, script

    def run(self, url: str, connections: int, duration_s: float, process: subprocess.Popen | None) -> LoadResult:
        before = cpu_seconds(process) if process else 0.0
        if self.tool == "wrk":
            result = run_wrk(url, connections, duration_s, self.script)
        else:
            result = run_aiohttp(url, connections, duration_s)
        result.cpu_s = (cpu_seconds(process) - before) if process else 0.0
        return result


# --- the benchmark ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement (default: 10)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per proxy at load (default: 3)")
    parser.add_argument("--connections", type=int, default=32, help="concurrent connections (default: 32)")
    parser.add_argument("--workers", type=int, default=1, help="our proxy's worker processes (default: 1)")
    parser.add_argument("--load", choices=["auto", "wrk", "aiohttp"], default="auto", help="load generator")
    parser.add_argument("--no-router", action="store_true", help="measure our proxy only")
    parser.add_argument("--no-auth", action="store_true", help="leave out our proxy with authentication on")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--stream", action="store_true", help="greedy streamed chat completions instead")
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="a checkout of another commit: its proxy is measured beside ours (ours@<its directory's name>); "
        "may be repeated",
    )
    args = parser.parse_args(argv)
    if args.stream:
        global CHAT
        CHAT = CHAT | STREAMED

    pressure_before = cpu_pressure()
    tool = args.load if args.load != "auto" else ("wrk" if shutil.which("wrk") else "aiohttp")
    router_bin = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if args.no_router:
        router_bin = None
    python = sys.executable
    baselines = {f"ours@{path.resolve().name}": path.resolve() for path in args.baseline}
    if len(baselines) < len(args.baseline):
        parser.error("each --baseline needs a directory of its own name")
    ports = {
        name: free_port() for name in ("prefill", "decode", "ours", *baselines, "ours+auth", "router", "router_metrics")
    }
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    chat = "/v1/chat/completions"

    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp, contextlib.ExitStack() as stack:
        log_dir = Path(tmp)
        script = log_dir / "post.lua"
        script.write_text(WRK_SCRIPT.format(body=json.dumps(CHAT), key=CLIENT_KEY))
        load = Load(tool, script)
        stub = [python, "-m", "tests.stub_engine", "--model-name", MODEL]
        processes = {}
        for role in ("prefill", "decode"):
            command = [*stub, "--name", f"{role}-0", "--port", str(ports[role])]
            processes[role] = stack.enter_context(started(role, command, log_dir))
            wait_answering(url[role] + "/health", processes[role], role, log_dir)
        ours = [python, "-m", "orchestrator.cli", "proxy", "--prefill", url["prefill"], "--decode", url["decode"]]
        ours += ["--port", str(ports["ours"]), "--model", MODEL, "--workers", str(args.workers)]
        processes["ours"] = stack.enter_context(started("ours", ours, log_dir))
        targets = ["ours"]
        for name, checkout in baselines.items():
            base = [*ours[:-6], "--port", str(ports[name]), "--model", MODEL, "--workers", str(args.workers)]
            processes[name] = stack.enter_context(started(name, base, log_dir, repo=checkout))
            targets.append(name)
        if not args.no_auth:
            from contract.auth import new_secret, write_secret

            write_secret(log_dir / "cluster-secret", new_secret())
            os.environ["PDSERVE_BENCH_CLIENT_KEY"] = CLIENT_KEY
            authed = [*ours[:-6], "--port", str(ports["ours+auth"]), "--model", MODEL, "--workers", str(args.workers)]
            authed += [
                "--api-key-env",
                "PDSERVE_BENCH_CLIENT_KEY",
                "--cluster-secret-file",
                str(log_dir / "cluster-secret"),
            ]
            processes["ours+auth"] = stack.enter_context(started("ours+auth", authed, log_dir))
            targets.append("ours+auth")
        if router_bin:
            router = [router_bin, "--vllm-pd-disaggregation", "--prefill", url["prefill"], "--decode", url["decode"]]
            router += ["--host", "127.0.0.1", "--port", str(ports["router"]), "--policy", "round_robin"]
            router += ["--log-level", "warning", "--prometheus-port", str(ports["router_metrics"])]
            processes["router"] = stack.enter_context(started("router", router, log_dir))
            targets.append("router")
        for name in targets:
            wait_answering(url[name] + chat, processes[name], name, log_dir)
            load.run(url[name] + chat, args.connections, 1.0, None)  # warm up: connections, caches

        at_load: dict[str, list[LoadResult]] = {name: [] for name in targets}
        for number in range(args.rounds):
            for name in targets if number % 2 == 0 else targets[::-1]:
                result = load.run(url[name] + chat, args.connections, args.duration, processes[name])
                at_load[name].append(result)
                if not args.json:
                    print(
                        f"round {number + 1} {name:<9} {result.rate:8.0f} req/s  p50 {result.p50_ms:6.2f} ms  "
                        f"{result.cpu_us_per_request:5.0f} µs CPU/req  errors {result.errors}",
                        flush=True,
                    )
        single: dict[str, LoadResult] = {}
        for name in ["decode", *targets]:
            single[name] = load.run(url[name] + chat, 1, max(args.duration / 2, 2.0), processes[name])

    report = _report(args, tool, at_load, single)
    report["cpu_pressure_before_pct"] = pressure_before
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    errors = sum(r.errors for results in at_load.values() for r in results) + sum(r.errors for r in single.values())
    return 1 if errors else 0


def _report(args: argparse.Namespace, tool: str, at_load: dict, single: dict) -> dict:
    def summary(results: list[LoadResult]) -> dict:
        return {
            "rate_rps": statistics.median(r.rate for r in results),
            "p50_ms": statistics.median(r.p50_ms for r in results),
            "cpu_us_per_request": statistics.median(r.cpu_us_per_request for r in results),
            "errors": sum(r.errors for r in results),
            "rounds": [asdict(r) | {"rate_rps": r.rate} for r in results],
        }

    report = {
        "load_generator": tool,
        "connections": args.connections,
        "duration_s": args.duration,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "at_load": {name: summary(results) for name, results in at_load.items()},
        "concurrency_1_p50_ms": {name: result.p50_ms for name, result in single.items()},
    }
    report["added_p50_ms"] = single["ours"].p50_ms - single["decode"].p50_ms
    if "router" in at_load:
        rates = {name: summary["rate_rps"] for name, summary in report["at_load"].items()}
        report["rate_ratio_ours_to_router"] = rates["ours"] / rates["router"]
        if "ours+auth" in rates:
            report["rate_ratio_ours_auth_to_router"] = rates["ours+auth"] / rates["router"]
    ours = report["at_load"]["ours"]
    report["ours_to_baselines"] = {
        name: {
            "rate_ratio": ours["rate_rps"] / summary["rate_rps"],
            "cpu_ratio": ours["cpu_us_per_request"] / summary["cpu_us_per_request"],
            # the ratio within each round (both measured in it), then their median: less of the machine's drift
            "rate_ratio_paired": statistics.median(
                mine.rate / theirs.rate for mine, theirs in zip(at_load["ours"], at_load[name], strict=True)
            ),
        }
        for name, summary in report["at_load"].items()
        if name.startswith("ours@")
    }
    if "ours+auth" in at_load:
        report["rate_ratio_auth_to_no_auth"] = (
            report["at_load"]["ours+auth"]["rate_rps"] / report["at_load"]["ours"]["rate_rps"]
        )
    return report


def _print_report(report: dict) -> None:
    load = f"{report['connections']} connections, {report['load_generator']}, ours with {report['workers']} worker(s)"
    print(f"\n{load}; CPU pressure before: {report['cpu_pressure_before_pct']}%")
    for name, summary in report["at_load"].items():
        print(
            f"  {name:<9} {summary['rate_rps']:8.0f} req/s (median)  p50 {summary['p50_ms']:6.2f} ms  "
            f"{summary['cpu_us_per_request']:5.0f} µs CPU/req"
        )
    if "rate_ratio_ours_to_router" in report:
        print(f"  ours / router: {report['rate_ratio_ours_to_router']:.2f}")
    if "rate_ratio_ours_auth_to_router" in report:
        print(f"  ours+auth / router: {report['rate_ratio_ours_auth_to_router']:.2f}")
    for name, ratios in report["ours_to_baselines"].items():
        print(
            f"  ours / {name}: {ratios['rate_ratio']:.3f} req/s (round by round {ratios['rate_ratio_paired']:.3f}), "
            f"{ratios['cpu_ratio']:.3f} CPU/req"
        )
    if "rate_ratio_auth_to_no_auth" in report:
        print(f"  ours+auth / ours: {report['rate_ratio_auth_to_no_auth']:.3f}")
    p50 = report["concurrency_1_p50_ms"]
    print("concurrency 1, p50: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in p50.items()))
    print(f"  added by our proxy (vs the decode stub directly): {report['added_p50_ms']:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
