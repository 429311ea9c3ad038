"""Does streaming through the proxy slow a prefill engine alone on its core? (host load: the proxy, the client and
the engines' API servers are not pinned).

Against the running cluster (``pdserve up -d CONFIG`` first): the median prefill time
(``vllm:request_prefill_time_seconds``) of ``--tokens``-token prompts sent straight to the first prefill
engine, idle, then while each of ``--streams`` counts of long answers streams through the proxy, then idle
again. The streams' own short prompts go through the same prefill engine, so a pass may carry a few of them.

With ``--during-start CONFIG`` (a spec whose prefill pool may grow to 2, e.g. the autoscaled demo) it starts
that cluster itself, its autoscaler held still, and times prefill-0's passes idle, while ``pdserve scale
prefill=2`` starts prefill-1 (on the other core), and idle again with prefill-1 ready; then stops it. Does a
start-up slow the engine on the other core too?

    python scripts/probe_host_load.py [--tokens 512] [--streams 8 32] [--repeats 6]
    python scripts/probe_host_load.py --during-start configs/local-cpu-autoscale.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_latency import pdserve  # noqa: E402
from validate_simulator import spec_copy  # noqa: E402

from connectors.auth import engine_key  # noqa: E402
from orchestrator import cluster  # noqa: E402
from orchestrator.autoscale import profiler  # noqa: E402

WARM_S = 15.0  # streams run this long before the passes are timed


class Prefill:
    """Prefill times of fresh ``tokens``-token prompts sent straight to the cluster's first prefill engine."""

    def __init__(self, http: profiler._Http, ep: profiler.ClusterEndpoints, prompts: profiler.RandomPrompts) -> None:
        self.http, self.ep, self.prompts = http, ep, prompts

    async def one(self, tokens: int) -> float:
        count = profiler.PREFILL_TIME + "_count"
        before = await self.http.samples(self.ep.prefill_url, profiler.PREFILL_SAMPLES)
        body = {"model": self.ep.model, "prompt": self.prompts(tokens), "max_tokens": 1}
        await self.http.post(self.ep.prefill_url, "/v1/completions", body)
        after = await self.http.wait_for(self.ep.prefill_url, profiler.PREFILL_SAMPLES, count, before[count] + 1)
        return after[profiler.PREFILL_TIME + "_sum"] - before[profiler.PREFILL_TIME + "_sum"]

    async def median(self, tokens: int, repeats: int) -> float:
        return statistics.median([await self.one(tokens) for _ in range(repeats)])


async def connect(session_body) -> None:  # noqa: ANN001 - a coroutine taking (http, ep, Prefill)
    ep = profiler.ClusterEndpoints.from_status(cluster.status(), engine_key(cluster.load_cluster_secret()))
    headers = {"Authorization": f"Bearer {ep.engine_key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=900)) as session:
        http = profiler._Http(session)
        prompts = await profiler.RandomPrompts.from_engine(http, ep.prefill_url, ep.model)
        await session_body(http, ep, Prefill(http, ep, prompts))


async def beside_streams(http: profiler._Http, ep: profiler.ClusterEndpoints, prefill: Prefill, args) -> None:  # noqa: ANN001
    print(f"idle: {await prefill.median(args.tokens, args.repeats):.3f} s", flush=True)
    for n in args.streams:
        stop = asyncio.Event()

        async def streamer(stop: asyncio.Event) -> None:
            body = {"model": ep.model, "max_tokens": 200, "ignore_eos": True}
            while not stop.is_set():
                await http.stream(ep.proxy_url, body | {"prompt": prefill.prompts(64)})

        streams = [asyncio.create_task(streamer(stop)) for _ in range(n)]
        await asyncio.sleep(WARM_S)
        print(f"{n} streams through the proxy: {await prefill.median(args.tokens, args.repeats):.3f} s", flush=True)
        stop.set()
        await asyncio.gather(*streams)
    print(f"idle again: {await prefill.median(args.tokens, args.repeats):.3f} s", flush=True)


async def beside_a_start(http: profiler._Http, ep: profiler.ClusterEndpoints, prefill: Prefill, args) -> None:  # noqa: ANN001
    print(f"idle: {await prefill.median(args.tokens, args.repeats):.3f} s", flush=True)
    began = time.monotonic()
    scaling = asyncio.create_task(asyncio.to_thread(pdserve, "scale", "prefill=2"))
    during = []
    while not scaling.done():
        seconds = await prefill.one(args.tokens)
        if not scaling.done():  # ended while prefill-1 was still starting
            during.append(seconds)
    done = scaling.result()
    if done.returncode != 0:
        sys.exit(f"pdserve scale prefill=2 failed:\n{done.stdout}\n{done.stderr}")
    print(
        f"while prefill-1 started ({time.monotonic() - began:.0f}s): median {statistics.median(during):.3f} s "
        f"of {len(during)} ({', '.join(f'{s:.2f}' for s in during)})",
        flush=True,
    )
    print(f"idle again, prefill-1 ready: {await prefill.median(args.tokens, args.repeats):.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--during-start", metavar="CONFIG", help="start CONFIG and time passes beside a start-up")
    args = parser.parse_args()
    if not args.during_start:
        asyncio.run(connect(lambda http, ep, prefill: beside_streams(http, ep, prefill, args)))
        return
    with open(args.during_start) as f:  # the copy lives elsewhere: its profile by a path that holds there
        profile = Path(args.during_start).resolve().parent / yaml.safe_load(f)["autoscaling"]["profile"]
    up = pdserve("up", spec_copy(args.during_start, interval_s=3600, profile=str(profile)), "--detach")
    if up.returncode != 0:
        sys.exit(f"pdserve up failed:\n{up.stdout}\n{up.stderr}")
    try:
        asyncio.run(connect(lambda http, ep, prefill: beside_a_start(http, ep, prefill, args)))
    finally:
        pdserve("down")


if __name__ == "__main__":
    main()
