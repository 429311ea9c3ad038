"""What sharing a CPU core costs beyond ``probe_shared_start.py``: a prefill pass beside an engine that
starts, and a decode step beside another engine that decodes.

Starts the CPU demo with autoscaling (``--config``, its autoscaler held still), where decode-1 runs on
prefill-0's core (``resources.share_cores``). Requests go to the engines themselves (the engine key), not
through the proxy:

1. prefill-0 computing 1024-token prompts back to back, alone on its core;
2. ``pdserve scale decode=2``: the same while decode-1 starts beside it;
3. for each count S in ``--streams``: decode-1 streaming S answers beside an idle prefill-0; then both
   streaming S answers each (a prefill engine decodes a request sent to it whole, as the proxy's
   ``degrade`` path does, so the two are two decode engines on one core); then decode-1 streaming 2S
   alone (one engine with both batches).

``shared_core`` holds what the simulator's ``SharedCore`` takes (``validate_simulator.py --shared-core``):
``prefill_beside_start`` (2 over 1) and ``decode_beside_decode`` (each engine's ITL p50 in the pair over
decode-1's alone at S, with the first S).

    python lab/probe_decode_pair.py [--config F] [--streams 16[,48]] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.auth import engine_key  # noqa: E402
from lab.probe_shared_start import PHASE_S, Load, completion, stream_counts, up_held_still  # noqa: E402
from orchestrator.state import load_cluster_secret  # noqa: E402
from testlib.cluster_client import make_prompt, pdserve  # noqa: E402

WARM_S = 5.0  # each phase's first seconds are not read: its streams start together


def phase(*loads: tuple[int, object]) -> list[float | None]:
    """Run ``Load(count, send)`` for each of ``loads`` at once for ``WARM_S + PHASE_S``; each one's ITL p50 (ms)
    over the last ``PHASE_S``."""
    running = [Load(count, send) for count, send in loads]
    for load in running:
        load.__enter__()
    try:
        time.sleep(WARM_S)
        window = (time.monotonic(), time.monotonic() + PHASE_S)
        time.sleep(PHASE_S)
    finally:
        for load in running:
            load.__exit__()
    return [load.median_ms(*window) for load in running]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu-autoscale.yaml")
    parser.add_argument(
        "--streams", type=stream_counts, default=(16,), help="answers each engine streams at once (default: 16)"
    )
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per streamed answer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", metavar="FILE", help="also write the result here (JSON)")
    args = parser.parse_args()

    config = up_held_still(args.config)
    try:
        status = json.loads(pdserve("status", "--json").stdout)
        model = status["model"]
        headers = {"Authorization": f"Bearer {engine_key(load_cluster_secret())}"}
        url = {e["engine_id"]: e["url"] for e in status["engines"]}

        def prompts_to(engine_url: str):  # noqa: ANN202
            return lambda tag: completion(engine_url, model, make_prompt(tag, 1024), 1, headers)

        def streams_to(engine_url: str):  # noqa: ANN202
            return lambda tag: completion(engine_url, model, make_prompt(tag, 64), args.max_tokens, headers)

        with Load(1, prompts_to(url["prefill-0"])) as passes:
            time.sleep(WARM_S + PHASE_S)
            began = time.monotonic()
            scaled = pdserve("scale", "decode=2")
            ended = time.monotonic()
        if scaled.returncode != 0:
            sys.exit(f"pdserve scale decode=2 failed:\n{scaled.stdout}\n{scaled.stderr}")
        prefill_ms = {
            "alone": passes.median_ms(began - PHASE_S, began, of="ttfts"),
            "neighbour_starting": passes.median_ms(began + 2, ended - 2, of="ttfts"),
        }
        url = {e["engine_id"]: e["url"] for e in json.loads(pdserve("status", "--json").stdout)["engines"]}
        pairs = []
        for count in args.streams:
            (alone,) = phase((count, streams_to(url["decode-1"])))
            decode_1, prefill_0 = phase((count, streams_to(url["decode-1"])), (count, streams_to(url["prefill-0"])))
            (double,) = phase((2 * count, streams_to(url["decode-1"])))
            pairs.append(
                {
                    "streams": count,
                    "itl_p50_ms": {"alone": alone, "pair": [decode_1, prefill_0], "one_engine_both_batches": double},
                    "slowdown": [ratio(decode_1, alone), ratio(prefill_0, alone)],
                    "pair_over_one_engine": ratio(statistics.mean([decode_1 or 0, prefill_0 or 0]), double),
                }
            )
    finally:
        pdserve("down")
        os.unlink(config)
    first = pairs[0]["slowdown"]
    result = {
        "config": args.config,
        "prefill_1024_ms": prefill_ms,
        "pairs": pairs,
        "shared_core": {
            "prefill_beside_start": max(ratio(prefill_ms["neighbour_starting"], prefill_ms["alone"]) or 1.0, 1.0),
            "decode_beside_decode": max(round(statistics.mean(s for s in first if s), 2), 1.0),
        },
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.config}: decode-1 on prefill-0's core")
    print(
        f"  prefill-0's 1024-token prompt alone {prefill_ms['alone']} ms, beside decode-1 starting "
        f"{prefill_ms['neighbour_starting']} ms ({result['shared_core']['prefill_beside_start']}x)"
    )
    for pair in pairs:
        itl = pair["itl_p50_ms"]
        print(
            f"  {pair['streams']} streams: decode-1 alone {itl['alone']} ms; beside prefill-0 decoding as many "
            f"{itl['pair'][0]} / {itl['pair'][1]} ms ({pair['slowdown'][0]}x / {pair['slowdown'][1]}x); one engine "
            f"with both batches {itl['one_engine_both_batches']} ms"
        )


if __name__ == "__main__":
    main()
