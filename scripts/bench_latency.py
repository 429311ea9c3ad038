"""Start-up time, and TTFT / inter-token latency of prefill->decode vs one engine alone.

Starts the cluster of ``--config`` with ``pdserve up --detach`` (timing it), then,
for ``--runs`` rounds, streams the same ~``--prompt-tokens`` prompt

- through the proxy (prefill engine -> KV over the connector -> decode engine),
- straight to the decode engine, which then computes the prompt alone, and
- with ``--no-connector``, to a plain vLLM server started by this script with
  the decode engine's arguments and core but no KV connector (what vLLM
  costs a step without one),

in a different order each round, and reports medians and ratios. Each round starts its prompt with a
fresh number so no engine can answer it from its prefix cache. Both paths run on
the same machine in the same minute: compare the ratio, not the absolute times.

    python scripts/bench_latency.py --config configs/local-cpu.yaml [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.auth import engine_key  # noqa: E402
from orchestrator.state import load_cluster_secret  # noqa: E402
from testlib.cluster_client import ENGINE_HEADERS, make_prompt, pdserve, stream_completion  # noqa: E402


@contextlib.contextmanager
def plain_engine(config: str, port: int) -> Iterator[str]:
    """vLLM's own OpenAI server with the decode engine's arguments, core and environment, but no KV
    connector; yields its URL once it answers /health."""
    from orchestrator.launch import plan_engines
    from orchestrator.spec import ClusterSpec

    launch = next(e for e in plan_engines(ClusterSpec.from_file(config)) if e.role == "decode")
    args = list(launch.vllm_args)
    del args[args.index("--kv-transfer-config") : args.index("--kv-transfer-config") + 2]
    args[args.index("--port") + 1] = str(port)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    if launch.cpu_bind:
        command = ["taskset", "-c", launch.cpu_bind.replace("|", ","), *command]
    log = open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    server = subprocess.Popen(command, env=dict(os.environ, **launch.env), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                sys.exit(f"the plain vLLM server exited ({server.returncode}): {' '.join(command)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            if time.monotonic() > deadline:
                sys.exit("the plain vLLM server did not answer /health within 600 s")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--no-connector",
        action="store_true",
        help="also a plain vLLM server without a KV connector (decode engine's core and arguments)",
    )
    parser.add_argument("--plain-port", type=int, default=8299, help="its port (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    started = time.perf_counter()
    up = pdserve("up", args.config, "--detach")
    up_s = time.perf_counter() - started
    if up.returncode != 0:
        sys.exit(f"pdserve up failed:\n{up.stdout}\n{up.stderr}")
    try:
        with contextlib.ExitStack() as stack:
            status = json.loads(pdserve("status", "--json").stdout)
            decode_url = next(e["url"] for e in status["engines"] if e["role"] == "decode")
            model = status["model"]
            paths = [("disaggregated", status["proxy_url"]), ("one engine", decode_url)]
            ENGINE_HEADERS[decode_url] = {"Authorization": f"Bearer {engine_key(load_cluster_secret())}"}
            if args.no_connector:
                paths.append(("no connector", stack.enter_context(plain_engine(args.config, args.plain_port))))
            results: dict[str, list[dict]] = {name: [] for name, _ in paths}
            for _, url in paths:  # first-request set-up (handshake, warm-up)
                stream_completion(url, model, make_prompt(-1, 32), 4)
            for run in range(args.runs):
                prompt = make_prompt(run, args.prompt_tokens)
                order = paths[run % len(paths) :] + paths[: run % len(paths)]
                for name, url in order if run % 2 == 0 else order[::-1]:
                    results[name].append(stream_completion(url, model, f"[{name}] {prompt}", args.max_tokens))
    finally:
        pdserve("down")

    summary = {
        "config": args.config,
        "cpu_count": os.cpu_count(),
        "up_to_ready_s": round(up_s, 1),
        "cluster_ready_s": round(status["ready_s"], 1),
        "engine_load_s": {e["engine_id"]: round(e["load_s"], 1) for e in status["engines"]},
        "prompt_tokens": results["disaggregated"][0]["prompt_tokens"],
        "max_tokens": args.max_tokens,
        "runs": args.runs,
    }
    for name, runs in results.items():
        summary[name] = {
            "ttft_p50_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 1),
            "itl_mean_ms": round(1000 * statistics.median(r["itl_s"] for r in runs), 1),
        }
    summary["ttft_ratio_disaggregated_over_one_engine"] = round(
        summary["disaggregated"]["ttft_p50_ms"] / summary["one engine"]["ttft_p50_ms"], 2
    )
    summary["itl_ratio_disaggregated_over_one_engine"] = round(
        summary["disaggregated"]["itl_mean_ms"] / summary["one engine"]["itl_mean_ms"], 2
    )
    if "no connector" in summary:
        summary["itl_ratio_one_engine_over_no_connector"] = round(
            summary["one engine"]["itl_mean_ms"] / summary["no connector"]["itl_mean_ms"], 2
        )
        summary["ttft_ratio_disaggregated_over_no_connector"] = round(
            summary["disaggregated"]["ttft_p50_ms"] / summary["no connector"]["ttft_p50_ms"], 2
        )
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"pdserve up -> ready: {summary['up_to_ready_s']}s (cluster ready {summary['cluster_ready_s']}s)")
    print("engine load times: " + ", ".join(f"{k} {v}s" for k, v in summary["engine_load_s"].items()))
    print(f"prompt {summary['prompt_tokens']} tokens, {args.max_tokens} output tokens, {args.runs} runs (medians)")
    print(f"{'path':<15} {'TTFT p50 ms':>12} {'ITL mean ms':>12}")
    for name in results:
        print(f"{name:<15} {summary[name]['ttft_p50_ms']:>12} {summary[name]['itl_mean_ms']:>12}")
    print(
        f"ratio disaggregated / one engine: TTFT {summary['ttft_ratio_disaggregated_over_one_engine']}, "
        f"ITL {summary['itl_ratio_disaggregated_over_one_engine']}"
    )
    if "no connector" in summary:
        print(
            f"ITL one engine (connector loaded) / no connector: {summary['itl_ratio_one_engine_over_no_connector']}; "
            f"TTFT disaggregated / no connector: {summary['ttft_ratio_disaggregated_over_no_connector']}"
        )


if __name__ == "__main__":
    main()
