"""Does streaming through the proxy slow a prefill engine alone on its core? (host load: the proxy, the client and
the engines' API servers are not pinned).

Against the running cluster (``pdserve up -d CONFIG`` first): the median prefill time
(``vllm:request_prefill_time_seconds``) of ``--tokens``-token prompts sent straight to the first prefill
engine, idle, then while each of ``--streams`` counts of long answers streams through the proxy, then idle
again. The streams' own short prompts go through the same prefill engine, so a pass may carry a few of them.

    python scripts/probe_host_load.py [--tokens 512] [--streams 8 32] [--repeats 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.auth import engine_key  # noqa: E402
from orchestrator import cluster  # noqa: E402
from orchestrator.autoscale import profiler  # noqa: E402

WARM_S = 15.0  # streams run this long before the passes are timed


async def measure(tokens: int, stream_counts: list[int], repeats: int) -> None:
    ep = profiler.ClusterEndpoints.from_status(cluster.status(), engine_key(cluster.load_cluster_secret()))
    headers = {"Authorization": f"Bearer {ep.engine_key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=900)) as session:
        http = profiler._Http(session)
        prompts = await profiler.RandomPrompts.from_engine(http, ep.prefill_url, ep.model)
        count = profiler.PREFILL_TIME + "_count"

        async def median_prefill() -> float:
            seconds = []
            for _ in range(repeats):
                before = await http.samples(ep.prefill_url, profiler.PREFILL_SAMPLES)
                body = {"model": ep.model, "prompt": prompts(tokens), "max_tokens": 1}
                await http.post(ep.prefill_url, "/v1/completions", body)
                after = await http.wait_for(ep.prefill_url, profiler.PREFILL_SAMPLES, count, before[count] + 1)
                seconds.append(after[profiler.PREFILL_TIME + "_sum"] - before[profiler.PREFILL_TIME + "_sum"])
            return statistics.median(seconds)

        print(f"idle: {await median_prefill():.3f} s", flush=True)
        for n in stream_counts:
            stop = asyncio.Event()

            async def streamer(stop: asyncio.Event) -> None:
                body = {"model": ep.model, "max_tokens": 200, "ignore_eos": True}
                while not stop.is_set():
                    await http.stream(ep.proxy_url, body | {"prompt": prompts(64)})

            streams = [asyncio.create_task(streamer(stop)) for _ in range(n)]
            await asyncio.sleep(WARM_S)
            print(f"{n} streams through the proxy: {await median_prefill():.3f} s", flush=True)
            stop.set()
            await asyncio.gather(*streams)
        print(f"idle again: {await median_prefill():.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(measure(args.tokens, args.streams, args.repeats))


if __name__ == "__main__":
    main()
