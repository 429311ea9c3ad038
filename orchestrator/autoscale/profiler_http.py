"""How the profiler talks to a running cluster: where its engines and proxy are, and the HTTP it sends them.

``ClusterEndpoints`` reads the engines' and the proxy's URLs off ``pdserve status``; ``Http`` is the profiler's
one session (JSON posts, SSE streams of completions, ``/metrics`` scrapes, and the waits until an engine has
recorded a request, which vLLM does after answering it); ``RandomPrompts`` makes the fresh token-id prompts
it sends, so that the prefix cache never helps. What to measure and how is ``orchestrator.autoscale.profiler``'s.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from orchestrator.engine_metrics import sum_samples
from orchestrator.errors import ProfilingError

__all__ = ["ClusterEndpoints", "Http", "RandomPrompts", "samples_delta"]

METRICS_WAIT_S = 15.0
"""How long an engine's histograms may lag behind its HTTP answer (vLLM records them after it)."""
SAMPLE_TEXT = (
    "The river carried old leaves past the mill while children counted boats and the baker sang about rain "
    "over the hills, where a lighthouse keeper wrote letters to a friend across the sea. Seven quick zebras "
    "jumped; a violin, two maps, forty apples and one purple umbrella waited in the station at midnight. "
    "Engineers measured voltage, pressure, latency and throughput; poets preferred moonlight, velvet, "
    "thunder, copper bells, orchards, glaciers and the smell of bread."
)
"""Text whose tokens make the pool random prompts are drawn from: many distinct words, no markup."""
MIN_DISTINCT_IDS = 32


@dataclass(slots=True, frozen=True)
class ClusterEndpoints:
    """The engines and proxy of a running cluster, as ``pdserve status --json`` lists them."""

    name: str
    model: str
    connector: str
    proxy_url: str
    prefill_url: str
    decode_url: str
    startup_s: float
    startup_phases: tuple[tuple[str, float], ...] = ()
    """When each phase of the engines' starts ended, seconds since the engine was asked for (mean over them)."""
    engine_key: str = field(default="", repr=False)
    """The cluster's engine key: the profiler calls the engines' ``/v1`` routes itself (never printed)."""
    prefill_pool: tuple[str, ...] = ()
    """Every ready prefill engine (``prefill_url`` first): a request through the proxy may land on any."""
    decode_pool: tuple[str, ...] = ()
    """Every ready decode engine (``decode_url`` first)."""

    @classmethod
    def from_status(cls, status: dict[str, Any], engine_key: str = "", model: str | None = None) -> ClusterEndpoints:
        """``model``: of a cluster of several models, the one whose engines (only) are measured."""
        ready = [
            e
            for e in status["engines"]
            if e["state"] == "ready" and e.get("url") and model in (None, e.get("model", model))
        ]
        urls = {}
        for role in ("prefill", "decode"):
            engines = [e for e in ready if e["role"] == role]
            if not engines:
                states = ", ".join(f"{e['engine_id']} {e['state']}" for e in status["engines"])
                raise ProfilingError(f"cluster {status['name']!r} has no ready {role} engine ({states})")
            urls[role] = tuple(e["url"] for e in engines)
        loads = [e["load_s"] for e in ready if e.get("load_s")]
        phases: dict[str, list[float]] = {}
        for engine in ready:
            for phase in engine.get("phases") or []:
                phases.setdefault(phase["phase"], []).append(phase["s"])
        return cls(
            name=status["name"],
            model=model or status["model"],
            connector=status["connector"],
            proxy_url=status["proxy_url"],
            prefill_url=urls["prefill"][0],
            decode_url=urls["decode"][0],
            startup_s=round(statistics.mean(loads), 1) if loads else 0.0,
            startup_phases=tuple((name, round(statistics.mean(s), 1)) for name, s in phases.items()),
            engine_key=engine_key,
            prefill_pool=urls["prefill"],
            decode_pool=urls["decode"],
        )


class RandomPrompts:
    """Fresh token-id prompts, ids drawn at random from those the model's tokenizer gave for ``SAMPLE_TEXT``."""

    def __init__(self, token_ids: list[int], seed: int | None = None) -> None:
        self.token_ids = sorted(set(token_ids))
        self.rng = random.Random(seed)

    def __call__(self, length: int) -> list[int]:
        return self.rng.choices(self.token_ids, k=length)

    @classmethod
    async def from_engine(cls, http: Http, url: str, model: str, seed: int | None = None) -> RandomPrompts:
        answer = await http.post(url, "/tokenize", {"model": model, "prompt": SAMPLE_TEXT, "add_special_tokens": False})
        ids = answer.get("tokens")
        if not isinstance(ids, list) or len(set(ids)) < MIN_DISTINCT_IDS:
            raise ProfilingError(
                f"{url}/tokenize: expected at least {MIN_DISTINCT_IDS} distinct token ids, got {ids!r}"
            )
        return cls(ids, seed)


class Http:
    """The profiler's one HTTP session: JSON posts, SSE streams and ``/metrics`` scrapes."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self.session.post(url + path, json=body) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ProfilingError(f"{url}{path}: {type(e).__name__}: {e}") from e
        if response.status != 200:
            raise ProfilingError(f"{url}{path}: HTTP {response.status}: {text[:500]}")
        return json.loads(text)

    async def stream(self, url: str, body: dict[str, Any]) -> list[tuple[float, int]]:
        """POST a streaming completion of one prompt; its chunks as (arrival time, tokens so far)."""
        return (await self.streams(url, body))[0]

    async def streams(self, url: str, body: dict[str, Any]) -> list[list[tuple[float, int]]]:
        """POST a streaming completion; each choice's chunks (one choice per prompt) as (arrival time, tokens so
        far), in the choices' order."""
        body = body | {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        choices: dict[int, list[tuple[float, int]]] = {}
        try:
            async with self.session.post(url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    raise ProfilingError(
                        f"{url}/v1/completions: HTTP {response.status}: {(await response.text())[:500]}"
                    )
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if not event.get("choices"):
                        continue  # the closing usage-only chunk
                    chunks = choices.setdefault(event["choices"][0].get("index", 0), [])
                    usage = event.get("usage") or {}  # continuous usage: the choice's own tokens so far
                    count = usage.get("completion_tokens", (chunks[-1][1] if chunks else 0) + 1)
                    chunks.append((time.perf_counter(), count))
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ProfilingError(f"{url}/v1/completions: {type(e).__name__}: {e}") from e
        return [choices[i] for i in sorted(choices)] or [[]]

    async def metrics(self, url: str) -> str:
        try:
            async with self.session.get(url + "/metrics") as response:
                if response.status != 200:
                    raise ProfilingError(f"{url}/metrics: HTTP {response.status}")
                return await response.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ProfilingError(f"{url}/metrics: {type(e).__name__}: {e}") from e

    async def samples(self, url: str, names: tuple[str, ...]) -> dict[str, float]:
        return sum_samples(await self.metrics(url), names)

    async def wait_for(self, url: str, names: tuple[str, ...], count_name: str, at_least: float) -> dict[str, float]:
        """Scrape until ``count_name`` reaches ``at_least``: vLLM records a request after answering it."""
        _, samples = await self._first_to_reach({url: at_least}, names, count_name)
        return samples

    async def pool_samples(self, urls: tuple[str, ...], names: tuple[str, ...]) -> dict[str, dict[str, float]]:
        return {url: await self.samples(url, names) for url in urls}

    async def wait_for_one(
        self, before: dict[str, dict[str, float]], names: tuple[str, ...], count_name: str
    ) -> dict[str, float]:
        """The rise of ``names`` on whichever engine of a pool (``before``: its samples by URL) has recorded
        one more ``count_name`` since: the one the proxy sent a request to."""
        floors = {url: was[count_name] + 1 for url, was in before.items()}
        url, samples = await self._first_to_reach(floors, names, count_name)
        return samples_delta(samples, before[url])

    async def _first_to_reach(
        self, at_least: dict[str, float], names: tuple[str, ...], count_name: str
    ) -> tuple[str, dict[str, float]]:
        """Scrape the engines at ``at_least``'s URLs in turn until one's ``count_name`` reaches its value there."""
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            seen = {}
            for url, floor in at_least.items():
                seen[url] = samples = await self.samples(url, names)
                if samples[count_name] >= floor:
                    return url, samples
            if time.monotonic() > deadline:
                raise ProfilingError(
                    "; ".join(
                        f"{url}/metrics: {count_name} is {seen[url][count_name]:g}, expected {floor:g}"
                        for url, floor in at_least.items()
                    )
                    + f" {METRICS_WAIT_S:g}s after the requests were answered"
                )
            await asyncio.sleep(0.1)


def samples_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}
