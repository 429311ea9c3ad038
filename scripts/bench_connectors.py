"""Our connector against vLLM's NixlConnector on the same engines: KV transfer time and TTFT by prompt length.

For each connector (``--connectors``, default ``pdserve`` then ``vllm-nixl``) the
cluster of ``--config`` is started with ``pdserve up --detach`` with only
``connector`` changed (and ``engine.max_model_len`` raised to fit the longest
prompt); then, for each prompt length in ``--prompt-tokens``, ``--runs`` fresh
prompts (a new number in front of each, so no prefix cache helps) are streamed
through the proxy one at a time. With ``--rounds N`` the connectors take turns
N times (A B, B A, A B ...), so that a change in the machine's load falls on both.
Measured per connector and length, over all rounds:

* TTFT p50 / p90 as the client sees it (first streamed token);
* the prefill engine's own TTFT (its compute of the prompt, the same work for
  both connectors: its ratio shows how much the machine's noise alone moves
  the TTFT ratio), and per request, the client's TTFT beyond it (the prefill's answer,
  the proxy, the decode engine's handshake, transfer and first step: the part
  a connector has a hand in; its median, and every request in ``--json``);
* KV transfer time per request, from the decode engine's own histogram
  (``pdserve:kv_transfer_seconds`` for ours, ``vllm:nixl_xfer_time_seconds``
  for vLLM's): mean over the requests of that length;
* the bytes moved per request, where the connector counts them.

The two transfer times are not measured alike: vLLM's is NIXL's own telemetry
(the READ inside NIXL), ours runs from posting the READ to the engine step that
sees it done, so it also holds the wait for that step. TTFT is the figure both
share.

Both clusters run on the same machine one after the other with the same
engines, cores and prompts: compare the ratios, not the absolute times.

    python scripts/bench_connectors.py --config configs/local-cpu.yaml [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.engine_metrics import TRANSFER_METRICS, scrape  # noqa: E402
from testlib.cluster_client import make_prompt, pdserve, stream_completion  # noqa: E402

OUTPUT_TOKENS = 8
PHASE_METRIC = "vllm:time_to_first_token_seconds"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_connector(base_spec: dict, connector: str, args: argparse.Namespace, workdir: Path, tag: int) -> dict:
    """One round of one connector: ``{length: {"ttfts_ms": [...], "seconds": s, "transfers": n, "bytes": b}}``."""
    spec = dict(base_spec, connector=connector)
    spec["engine"] = dict(spec.get("engine") or {}, max_model_len=max(args.prompt_tokens) + 256)
    spec_path = workdir / f"bench-{connector}.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    up = pdserve("up", str(spec_path), "--detach")
    if up.returncode != 0:
        sys.exit(f"pdserve up ({connector}) failed:\n{up.stdout}\n{up.stderr}")
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        proxy, model = status["proxy_url"], status["model"]
        prefill_url = next(e["url"] for e in status["engines"] if e["role"] == "prefill")
        decode_url = next(e["url"] for e in status["engines"] if e["role"] == "decode")
        seconds, nbytes = TRANSFER_METRICS[connector]
        names = (seconds + "_sum", seconds + "_count", nbytes, PHASE_METRIC + "_sum", PHASE_METRIC + "_count")
        stream_completion(proxy, model, make_prompt(-1, 64), 2)  # first-request set-up (handshake)
        by_length = {}
        for length in args.prompt_tokens:
            rows = []
            for run in range(args.runs):
                time.sleep(1.0)  # let the last step's connector stats reach /metrics
                before, before_prefill = scrape(decode_url, names), scrape(prefill_url, names)
                prompt = f"[{connector} {tag} {length}] " + make_prompt(run, length)
                result = stream_completion(proxy, model, prompt, OUTPUT_TOKENS)
                time.sleep(1.0)
                after, after_prefill = scrape(decode_url, names), scrape(prefill_url, names)
                rows.append(
                    {
                        "prompt_tokens": result["prompt_tokens"],
                        "ttft_ms": 1000 * result["ttft_s"],
                        "seconds": after[seconds + "_sum"] - before[seconds + "_sum"],
                        "transfers": after[seconds + "_count"] - before[seconds + "_count"],
                        "bytes": after[nbytes] - before[nbytes],
                        # each engine's own TTFT (arrival to first token): the prefill leg, and the
                        # decode leg's wait for the KV plus its first step
                        "prefill_engine_ms": 1000
                        * (after_prefill[PHASE_METRIC + "_sum"] - before_prefill[PHASE_METRIC + "_sum"]),
                        "decode_engine_ms": 1000 * (after[PHASE_METRIC + "_sum"] - before[PHASE_METRIC + "_sum"]),
                    }
                )
            by_length[length] = rows
        return by_length
    finally:
        pdserve("down")


def summarize(rounds: list[dict]) -> dict:
    """Requests of every round of one connector -> percentiles and means per prompt length."""
    summary = {}
    for length in rounds[0]:
        rows = [row for r in rounds for row in r[length]]
        ttfts = [row["ttft_ms"] for row in rows]
        # what the connector has a hand in, per request: the client's TTFT less the prefill engine's
        beyond = [row["ttft_ms"] - row["prefill_engine_ms"] for row in rows]
        transfers = sum(row["transfers"] for row in rows)
        summary[str(length)] = {
            "prompt_tokens": rows[0]["prompt_tokens"],
            "requests": len(rows),
            "ttft_p50_ms": round(statistics.median(ttfts), 1),
            "ttft_p90_ms": round(percentile(ttfts, 0.9), 1),
            "transfers": int(transfers),
            "transfer_mean_ms": round(1000 * sum(row["seconds"] for row in rows) / transfers, 2) if transfers else None,
            "bytes_per_request": int(sum(row["bytes"] for row in rows) / len(rows)),
            "prefill_engine_mean_ms": round(statistics.mean(row["prefill_engine_ms"] for row in rows), 1),
            "decode_engine_mean_ms": round(statistics.mean(row["decode_engine_ms"] for row in rows), 1),
            "beyond_prefill_p50_ms": round(statistics.median(beyond), 1),
            "beyond_prefill_max_ms": round(max(beyond), 1),
            "beyond_prefill_mean_ms": round(statistics.mean(beyond), 1),
            "requests_ms": [
                {k: round(row[k], 1) for k in ("ttft_ms", "prefill_engine_ms", "decode_engine_ms")} for row in rows
            ],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--connectors", nargs="+", default=["pdserve", "vllm-nixl"], choices=list(TRANSFER_METRICS))
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--runs", type=int, default=5, help="prompts per length per round")
    parser.add_argument("--rounds", type=int, default=1, help="times the connectors take turns")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    base_spec = yaml.safe_load(Path(args.config).read_text())
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as workdir:
        rounds: dict[str, list[dict]] = {c: [] for c in args.connectors}
        for tag in range(args.rounds):
            # A B, then B A: a machine that grows quieter (or busier) over the run favours neither.
            order = args.connectors if tag % 2 == 0 else args.connectors[::-1]
            for connector in order:
                rounds[connector].append(bench_connector(base_spec, connector, args, Path(workdir), tag))
    results = {connector: summarize(samples) for connector, samples in rounds.items()}
    report = {"config": args.config, "cpu_count": os.cpu_count(), "runs": args.runs, "rounds": args.rounds}
    report["results"] = results
    if len(args.connectors) == 2:
        ours, theirs = args.connectors
        report["ratios"] = {
            length: {
                "ttft_p50": round(results[ours][length]["ttft_p50_ms"] / results[theirs][length]["ttft_p50_ms"], 2),
                "ttft_p90": round(results[ours][length]["ttft_p90_ms"] / results[theirs][length]["ttft_p90_ms"], 2),
                # the same prefill work on both: how far its noise alone moves the TTFT ratios
                "prefill_engine": round(
                    results[ours][length]["prefill_engine_mean_ms"] / results[theirs][length]["prefill_engine_mean_ms"],
                    2,
                ),
                "beyond_prefill": round(
                    results[ours][length]["beyond_prefill_p50_ms"] / results[theirs][length]["beyond_prefill_p50_ms"],
                    2,
                ),
                "transfer_mean": (
                    round(results[ours][length]["transfer_mean_ms"] / results[theirs][length]["transfer_mean_ms"], 2)
                    if results[ours][length]["transfer_mean_ms"] and results[theirs][length]["transfer_mean_ms"]
                    else None
                ),
            }
            for length in results[ours]
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{args.runs} fresh prompts per length x {args.rounds} round(s), {OUTPUT_TOKENS} output tokens, "
        "streamed through the proxy"
    )
    print(
        f"{'connector':<10} {'tokens':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'prefill':>8} {'beyond':>7} "
        f"{'xfer ms':>8} {'MiB/req':>8}"
    )
    for connector, by_length in results.items():
        for r in by_length.values():
            xfer = "-" if r["transfer_mean_ms"] is None else f"{r['transfer_mean_ms']:.1f}"
            print(
                f"{connector:<10} {r['prompt_tokens']:>6} {r['ttft_p50_ms']:>9.0f} {r['ttft_p90_ms']:>9.0f} "
                f"{r['prefill_engine_mean_ms']:>8.0f} {r['beyond_prefill_p50_ms']:>7.0f} "
                f"{xfer:>8} {r['bytes_per_request'] / 2**20:>8.1f}"
            )
    for length, ratio in report.get("ratios", {}).items():
        print(f"{args.connectors[0]} / {args.connectors[1]} at {length} tokens: {ratio}")


if __name__ == "__main__":
    main()
