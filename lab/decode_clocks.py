"""The decode step on the engine's clock and on the client's, side by side (``pdserve profile``'s two readings).

Runs ``profiler.decode_run`` against the decode engine of the running cluster (``pdserve up -d CONFIG``
first) for each ``--points`` entry ``BATCHxCONTEXTxTOKENS``, ``--runs`` times, and prints per run the
engine's steps and both readings in ms per token. The engine's clock is what the profile keeps when
the batch's prompts shared one pass; a batch whose prompts took several passes (more tokens than
one pass) shows why it falls back to the client's.

    python lab/decode_clocks.py [--points 1x128x8 2x128x8 4x512x24 8x128x24 8x512x24] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.auth import engine_key  # noqa: E402
from orchestrator import cluster, state  # noqa: E402
from orchestrator.autoscale import profiler  # noqa: E402
from orchestrator.autoscale.profiler_http import ClusterEndpoints, Http, RandomPrompts  # noqa: E402


def per_token_ms(reading: tuple[float, float] | None) -> str:
    return f"{1000 * reading[0] / reading[1]:7.1f}" if reading and reading[1] > 0 else "      -"


async def measure(points: list[tuple[int, int, int]], runs: int) -> None:
    endpoints = ClusterEndpoints.from_status(cluster.status(), engine_key(state.load_cluster_secret()))
    headers = {"Authorization": f"Bearer {endpoints.engine_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        http = Http(session)
        url, model = endpoints.decode_url, endpoints.model
        prompts = await RandomPrompts.from_engine(http, url, model)
        await http.stream(url, {"model": model, "prompt": prompts(16), "max_tokens": 4, "ignore_eos": True})
        print("batch  context  tokens  steps  engine ms  client ms")
        for batch, context, tokens in points:
            for _ in range(runs):
                run = await profiler.decode_run(http, url, model, prompts, batch, context, tokens)
                engine, client = per_token_ms(run.engine), per_token_ms(run.client)
                print(f"{batch:>5}  {context:>7}  {tokens:>6}  {run.steps:>5g}    {engine}    {client}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", nargs="+", default=["1x128x8", "2x128x8", "4x512x24", "8x128x24", "8x512x24"])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    points = [tuple(int(n) for n in point.split("x")) for point in args.points]
    asyncio.run(measure(points, args.runs))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
