"""Does streaming through the proxy slow a prefill engine alone on its core? (host load: the proxy, the client and
the engines' API servers are not pinned).

Against the running cluster (``pdserve up -d CONFIG`` first): the median prefill time
(``vllm:request_prefill_time_seconds``) of ``--tokens``-token prompts sent straight to the first prefill
engine, idle, then while each of ``--streams`` counts of long answers streams through the proxy, then idle
again. The streams' own short prompts go through the same prefill engine, so a pass may carry a few of them.

With ``--other-core`` (the running cluster's first prefill and decode engines on cores of their own) it
measures what an engine computing on the other core costs: prefill-0's pass alone and while decode-0 steps
``--streams`` answers sent to it straight (no prefill engine involved), and decode-0's step (ITL p50) alone
and while prefill-0 computes prompts back to back. Its ``shared_core`` (``host_prefill``, ``host_decode``)
is what the simulator's ``SharedCore`` takes (``validate_simulator.py --shared-core``).

With ``--during-start CONFIG`` (a spec whose prefill pool may grow to 2, e.g. the autoscaled demo) it starts
that cluster itself, its autoscaler held still, and times prefill-0's passes idle, while ``pdserve scale
prefill=2`` starts prefill-1 (on the other core), and idle again with prefill-1 ready; then stops it. Does a
start-up slow the engine on the other core too?

    python lab/probe_host_load.py [--tokens 512] [--streams 8 32] [--repeats 6]
    python lab/probe_host_load.py --other-core [--streams 8] [--out lab/results/host-probe.json]
    python lab/probe_host_load.py --during-start configs/local-cpu-autoscale.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.auth import engine_key  # noqa: E402
from orchestrator import cluster, state  # noqa: E402
from orchestrator.autoscale.profiler_http import ClusterEndpoints, Http, RandomPrompts  # noqa: E402
from orchestrator.autoscale.profiler_readings import PREFILL_SAMPLES, PREFILL_TIME  # noqa: E402
from testlib.cluster_client import pdserve  # noqa: E402
from testlib.specs import spec_copy  # noqa: E402

WARM_S = 15.0  # streams run this long before the passes are timed
WINDOW_S = 15.0  # --other-core: decode-0's steps are timed this long, alone and beside a computing prefill-0


class Prefill:
    """Prefill times of fresh ``tokens``-token prompts sent straight to the cluster's first prefill engine."""

    def __init__(self, http: Http, ep: ClusterEndpoints, prompts: RandomPrompts) -> None:
        self.http, self.ep, self.prompts = http, ep, prompts

    async def one(self, tokens: int) -> float:
        count = PREFILL_TIME + "_count"
        before = await self.http.samples(self.ep.prefill_url, PREFILL_SAMPLES)
        body = {"model": self.ep.model, "prompt": self.prompts(tokens), "max_tokens": 1}
        await self.http.post(self.ep.prefill_url, "/v1/completions", body)
        after = await self.http.wait_for(self.ep.prefill_url, PREFILL_SAMPLES, count, before[count] + 1)
        return after[PREFILL_TIME + "_sum"] - before[PREFILL_TIME + "_sum"]

    async def median(self, tokens: int, repeats: int) -> float:
        return statistics.median([await self.one(tokens) for _ in range(repeats)])


async def connect(session_body) -> None:  # noqa: ANN001 - a coroutine taking (http, ep, Prefill)
    ep = ClusterEndpoints.from_status(cluster.status(), engine_key(state.load_cluster_secret()))
    headers = {"Authorization": f"Bearer {ep.engine_key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=900)) as session:
        http = Http(session)
        prompts = await RandomPrompts.from_engine(http, ep.prefill_url, ep.model)
        await session_body(http, ep, Prefill(http, ep, prompts))


async def beside_streams(http: Http, ep: ClusterEndpoints, prefill: Prefill, args) -> None:  # noqa: ANN001
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


async def beside_a_start(http: Http, ep: ClusterEndpoints, prefill: Prefill, args) -> None:  # noqa: ANN001
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


def gaps_ms(streams: list[list[tuple[float, int]]], start: float, end: float) -> float:
    """Median gap (ms) between consecutive tokens of the same stream, both within [start, end)."""
    gaps = [
        (b[0] - a[0]) * 1000
        for chunks in streams
        for a, b in zip(chunks, chunks[1:], strict=False)
        if start <= a[0] and b[0] < end
    ]
    return round(statistics.median(gaps), 1) if gaps else float("nan")


async def other_core(http: Http, ep: ClusterEndpoints, prefill: Prefill, args) -> None:  # noqa: ANN001
    alone = [await prefill.median(args.tokens, args.repeats)]
    stop, done = asyncio.Event(), []

    async def decoding() -> None:  # straight to decode-0: it prefills the short prompt itself
        body = {"model": ep.model, "max_tokens": 200, "ignore_eos": True}
        while not stop.is_set():
            done.append(await http.stream(ep.decode_url, body | {"prompt": prefill.prompts(64)}))

    streams = [asyncio.create_task(decoding()) for _ in range(args.streams[0])]
    await asyncio.sleep(WARM_S)
    decode_alone = (time.perf_counter(), time.perf_counter() + WINDOW_S)
    await asyncio.sleep(WINDOW_S)
    computing = asyncio.Event()

    async def prefilling() -> None:  # straight to prefill-0, back to back
        while not computing.is_set():
            body = {"model": ep.model, "prompt": prefill.prompts(args.tokens), "max_tokens": 1}
            await http.post(ep.prefill_url, "/v1/completions", body)

    loop = asyncio.create_task(prefilling())
    await asyncio.sleep(2)
    decode_beside = (time.perf_counter(), time.perf_counter() + WINDOW_S)
    await asyncio.sleep(WINDOW_S)
    computing.set()
    await loop
    beside = await prefill.median(args.tokens, args.repeats)
    stop.set()
    await asyncio.gather(*streams)
    alone.append(await prefill.median(args.tokens, args.repeats))
    itl = {"alone": gaps_ms(done, *decode_alone), "beside_prefill": gaps_ms(done, *decode_beside)}
    result = {
        "streams": args.streams[0],
        "tokens": args.tokens,
        "prefill_s": {"alone_before_after": alone, "beside_decode": beside},
        "decode_itl_ms": itl,
        "shared_core": {
            "host_prefill": max(round(beside / statistics.mean(alone), 3), 1.0),
            "host_decode": max(round(itl["beside_prefill"] / itl["alone"], 3), 1.0),
        },
    }
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--during-start", metavar="CONFIG", help="start CONFIG and time passes beside a start-up")
    parser.add_argument("--other-core", action="store_true", help="an engine computing on the other core")
    parser.add_argument("--out", help="with --other-core: also write the result here (JSON)")
    args = parser.parse_args()
    if args.other_core:
        status = cluster.status()
        cores = {e["engine_id"]: e.get("cpu_bind") for e in status["engines"]}
        if cores.get("prefill-0") is None or cores.get("prefill-0") == cores.get("decode-0"):
            sys.exit(f"--other-core needs prefill-0 and decode-0 on cores of their own (the cores: {cores})")
        asyncio.run(connect(lambda http, ep, prefill: other_core(http, ep, prefill, args)))
        return
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
