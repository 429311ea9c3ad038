"""What routing's KV tier lookup costs: an engine's ``tier_held`` answer against vLLM's own ``/tokenize``.

The proxy asks a tier engine what the shared tier holds of a prompt before it routes it
(``decode_only_if_cached``, ``prefix_aware``; README "KV tier"). The engine renders and
tokenizes the prompt as vLLM does, then hashes its blocks and looks the tier's entries
up. The reference is the first half alone: vLLM's ``POST /tokenize`` of the same chat,
on the same engine, in the same run, the two interleaved. For scale, the TTFT of the
conversation's next turn through the proxy (its history loaded from the tier).

    python scripts/bench_tier_lookup.py [--config configs/local-cpu-kv-tier.yaml] [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract import wire  # noqa: E402
from contract.auth import engine_key  # noqa: E402
from orchestrator.state import load_cluster_secret  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.multiturn import MODEL, conversations, down, stream_chat, up  # noqa: E402


def post(url: str, body: dict, headers: dict[str, str]) -> tuple[float, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - start, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu-kv-tier.yaml")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--first-sentences", type=int, default=160, help="the history's first message (~13 tokens each)"
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="pdserve-tier-lookup-"))
    os.environ.setdefault("PDSERVE_STATE_DIR", str(workdir / "state"))
    raw = yaml.safe_load(Path(args.config).read_text())
    raw["name"] = "tier-lookup"
    raw["kv_tier"] = {**raw["kv_tier"], "shared_path": str(workdir / "tier")}
    spec = workdir / "cluster.yaml"
    spec.write_text(yaml.safe_dump(raw))
    proxy = up(str(spec))
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        engine = next(e["url"] for e in status["engines"] if e["role"] == "decode")
        headers = {"Authorization": f"Bearer {engine_key(load_cluster_secret())}"}
        talk = conversations(1, 5, 8, args.first_sentences)[0]
        history = [{"role": "user", "content": talk[0]}]
        _, answer, prompt_tokens, _, _ = stream_chat(proxy, history, 32)  # computed and stored
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": talk[1]}]
        body = {"model": MODEL, "messages": history}
        tokenize, lookup = [], []
        held = {}
        for run in range(args.runs):
            pair = [(tokenize, engine + "/tokenize"), (lookup, engine + wire.TIER_HELD_PATH)]
            for times, url in pair if run % 2 == 0 else pair[::-1]:
                seconds, answer_body = post(url, body, headers)
                times.append(seconds)
                if times is lookup:
                    held = answer_body
        ttft, _, next_tokens, path, _ = stream_chat(proxy, history, 8)
    finally:
        down()
    result = {
        "config": args.config,
        "runs": args.runs,
        "first_turn_prompt_tokens": prompt_tokens,
        "lookup_answer": held,
        "tokenize_p50_ms": 1000 * statistics.median(tokenize),
        "tier_held_p50_ms": 1000 * statistics.median(lookup),
        "tier_held_p90_ms": 1000 * sorted(lookup)[int(0.9 * (len(lookup) - 1))],
        "tier_held_over_tokenize": statistics.median(lookup) / statistics.median(tokenize),
        "next_turn_ttft_s": ttft,
        "next_turn_prompt_tokens": next_tokens,
        "next_turn_path": path,
        "tier_held_over_next_turn_ttft": statistics.median(lookup) / ttft,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
