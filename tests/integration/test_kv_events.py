"""The proxy's index of what each engine holds (``proxy.residency``), from the engines' own KV events
(``connectors.kv_events``), against what a real vLLM CPU engine's prefix cache holds.

The index under test is the proxy's own classes (``EventFeeds`` into a ``Residency``), following the shared
cluster's engines over HTTP with the cluster's engine key, as the proxy does. What an engine holds is read from the
engine itself: the prompt tokens its prefix cache served when the same prompt is sent again
(``vllm:prefix_cache_hits_total``, one request at a time). The index must say exactly that:

- for prompts the engine computed;
- after the engine evicted blocks (its cache filled with other prompts);
- after the engine restarted (a new start: empty, and what it computes then).

The index test runs on a cluster of its own whose engines keep 48 blocks of 128 tokens (a few prompts fill
them); the checks of the route's key and the sockets' directory on the shared ``pdserve`` cluster. The events
are the engines' own: the KV connector does not matter.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from contract import wire
from proxy.engine_client import EngineClient
from proxy.pool import Endpoint, EnginePool
from proxy.residency import EventFeeds, Residency
from tests.integration.conftest import Cluster, engine_headers, http_json, own_cluster
from tests.integration.test_kv_ownership_cluster import spec

SMALL_CACHE_SPEC = spec("pdserve-kv-events", 24000, connector="pdserve")
SMALL_CACHE_SPEC["engine"] |= {"extra_args": {"num_gpu_blocks_override": 48}}  # 6,144 tokens: 1.5 prompts of 4,096

MODEL = "smollm2-135m-instruct"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def prompt(n: int, words: int) -> str:
    """A prompt no other prompt of the test shares a block with (it starts with its number)."""
    return f"Document {n}: " + " ".join(WORDS[(n * 7 + i * 3) % len(WORDS)] + str(i % 97) for i in range(words))


def metric(url: str, name: str, label: str = "") -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = [
        line for line in text.splitlines() if line.startswith(name) and not line.startswith("#") and label in line
    ]
    return sum(float(line.rsplit(" ", 1)[1]) for line in values)


def cache_info(url: str) -> tuple[int, int]:
    """(blocks in the engine's KV cache, tokens a block holds), from ``vllm:cache_config_info``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        line = next(row for row in response.read().decode().splitlines() if row.startswith("vllm:cache_config_info"))
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
    return int(labels["num_gpu_blocks"].strip('"')), int(labels["block_size"].strip('"'))


class Engine:
    """One engine of a cluster, called as the proxy calls it (the engine key)."""

    def __init__(self, status: dict, role: str) -> None:
        self.headers = engine_headers(status["state_dir"])
        entry = next(e for e in status["engines"] if e["role"] == role)
        self.engine_id, self.url, self.pid, self.restarts = entry["engine_id"], entry["url"], entry["pid"], 0

    def compute(self, text: str) -> float:
        """Send ``text`` for one token; the prompt tokens the prefix cache served it."""
        before = metric(self.url, "vllm:prefix_cache_hits_total")
        body = {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}
        status, _, answer = http_json(self.url + wire.COMPLETIONS_PATH, body, headers=self.headers)
        assert status == 200, answer
        return metric(self.url, "vllm:prefix_cache_hits_total") - before

    def blocks(self, text: str) -> tuple[int, tuple[int, ...]]:
        """(the prompt's tokens, its blocks), as the engine answers the proxy's lookup."""
        status, _, answer = http_json(
            self.url + wire.TIER_HELD_PATH, {"model": MODEL, "prompt": text}, headers=self.headers
        )
        assert status == 200, answer
        return answer[wire.PROMPT_TOKENS], tuple(answer[wire.BLOCKS])


async def settled(index: Residency, engine_id: str, quiet_s: float = 1.0, timeout_s: float = 60) -> None:
    """Until the engine's stream is up and its blocks stay the same for ``quiet_s`` (its last batch came)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = index.blocks(engine_id) if index.live(engine_id) else None
        if now != last:
            last, since = now, time.monotonic()
        elif now is not None and time.monotonic() - since >= quiet_s:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the index of {engine_id} did not settle in {timeout_s:g} s")


async def check(engine: Engine, index: Residency, texts: list[str], block_size: int) -> list[int]:
    """For each text: what the index says the engine holds of it equals what its prefix cache serves. Each send
    stores the prompt again, so the index is read afresh (settled) before each."""
    held = []
    for text in texts:
        tokens, blocks = await asyncio.to_thread(engine.blocks, text)
        await settled(index, engine.engine_id)
        depth = index.held(blocks).get(engine.engine_id, 0)
        served = await asyncio.to_thread(engine.compute, text)
        # vLLM computes a prompt's last token itself: a prompt held whole is served all but its last block
        assert served == min(depth * block_size, (tokens - 1) // block_size * block_size), (depth, tokens, served)
        held.append(depth)
    return held


@pytest.mark.after_cluster
async def test_the_index_says_what_an_engine_holds_after_evictions_and_a_restart(tmp_path: Path) -> None:
    with own_cluster(tmp_path, SMALL_CACHE_SPEC) as status:
        await follow_and_check(Engine(status, "prefill"))


async def follow_and_check(engine: Engine) -> None:
    num_blocks, block_size = cache_info(engine.url)
    pool, index, client = EnginePool(), Residency(), EngineClient()
    pool.add("prefill", Endpoint(engine.engine_id, engine.url))
    feeds = EventFeeds(pool, index, client, lambda: engine.headers)
    following = asyncio.create_task(feeds.run())
    try:
        await settled(index, engine.engine_id)
        first = [prompt(n, 200) for n in range(3)]
        for text in first:
            await asyncio.to_thread(engine.compute, text)
        assert all(depth > 0 for depth in await check(engine, index, first, block_size))  # held, and said so

        # evictions: other prompts fill the cache one and a half times; the first ones go, and the index says so
        tokens, _ = await asyncio.to_thread(engine.blocks, first[0])
        filler_words = 3500 * 200 // tokens  # ~3,500 tokens each
        fillers = [prompt(100 + n, filler_words) for n in range(3 * num_blocks * block_size // 7000 + 1)]
        for text in fillers:
            await asyncio.to_thread(engine.compute, text)
        assert await check(engine, index, first, block_size) == [0, 0, 0]  # evicted, and said so
        assert (await check(engine, index, fillers[-1:], block_size))[0] > 0  # the latest still held

        # a restart: the engine comes back empty, and the index holds nothing of its last start
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.sleep(5)
        deadline = time.monotonic() + 600
        while not await asyncio.to_thread(healthy, engine.url):
            assert time.monotonic() < deadline, "the engine did not come back"
            await asyncio.sleep(2)
        await settled(index, engine.engine_id)
        _, blocks = await asyncio.to_thread(engine.blocks, fillers[-1])
        assert index.held(blocks) == {}
        assert await check(engine, index, [fillers[-1], fillers[-1]], block_size) == [0, len(blocks)]
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await client.close()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
def test_an_engines_events_need_the_engine_key(cluster: Cluster) -> None:
    url = cluster.engine("decode")["url"] + wire.KV_EVENTS_PATH
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code == 401
    request = urllib.request.Request(url + "?after=-1", headers=cluster.engine_headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.readline().startswith(b'{"epoch"')  # the engine key opens it


@pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)
def test_an_engines_event_sockets_are_its_own(cluster: Cluster) -> None:
    """The publisher's ipc sockets live in the engine's private directory: no other user reaches them."""
    from orchestrator.paths import engine_temp_dir

    for entry in cluster.status["engines"]:
        directory = engine_temp_dir(Path(entry["log_path"]))
        assert (directory / "kv-events.sock").exists(), sorted(p.name for p in directory.iterdir())
        assert directory.stat().st_mode & 0o077 == 0
