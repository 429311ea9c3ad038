"""``proxy.residency``: the index of what each engine holds, from its KV events, and the feeds that follow them."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web

from contract import wire
from proxy.engine_client import EngineClient
from proxy.pool import Endpoint, EnginePool
from proxy.residency import EventFeeds, Residency
from tests.unit.proxy_requests import wait_until


def batch(seq: int, stored=(), removed=(), cleared=False) -> dict:
    return {"seq": seq, "stored": list(stored), "removed": list(removed), "cleared": cleared}


def test_held_counts_each_engines_leading_blocks():
    index = Residency()
    for engine in ("a", "b", "c"):
        assert index.begin(engine, "e1")
    index.apply("a", batch(0, [1, 2, 3]))
    index.apply("b", batch(0, [1, 2]))
    index.apply("c", batch(0, [2, 3]))  # not the prompt's first block: holds no prefix of it

    assert index.held([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.held([9]) == {} and index.held([]) == {}


def test_removed_and_cleared_blocks_are_held_no_more():
    index = Residency()
    index.begin("a", "e1")
    index.apply("a", batch(0, [1, 2, 3]))
    index.apply("a", batch(1, removed=[2, 7]))  # 7: a block the index never saw
    assert index.held([1, 2, 3]) == {"a": 1} and index.blocks("a") == {1, 3}
    index.apply("a", batch(2, stored=[5], cleared=True))  # cleared first, then the batch's own
    assert index.blocks("a") == {5} and index.held([1]) == {}


def test_a_gap_drops_what_the_engine_held_and_the_index_follows_on():
    index = Residency()
    index.begin("a", "e1")
    index.apply("a", batch(0, [1, 2]))
    index.apply("a", {"seq": 5, "gap": True})
    assert index.blocks("a") == frozenset() and index.live("a")
    index.apply("a", batch(5, [1]))
    assert index.held([1, 2]) == {"a": 1}


def test_another_start_of_the_engine_drops_what_the_index_knew():
    index = Residency()
    index.begin("a", "e1")
    index.apply("a", batch(0, [1, 2]))
    assert not index.begin("a", "e2")  # restarted: its numbering begins again
    assert index.blocks("a") == frozenset() and not index.live("a")
    assert index.begin("a", "e2") and index.held([1]) == {}


@pytest.mark.parametrize(
    "line",
    [{"seq": 1}, {"seq": 1, "stored": "x", "removed": [], "cleared": False}, batch(1, ["1"]), batch(1, [1.5])],
    ids=["no-fields", "not-lists", "string-block", "float-block"],
)
def test_a_malformed_batch_is_refused(line):
    index = Residency()
    index.begin("a", "e1")
    with pytest.raises(ValueError):
        index.apply("a", line)


def test_an_engine_that_claims_more_than_the_bound_is_refused():
    index = Residency(max_blocks=3)
    index.begin("a", "e1")
    with pytest.raises(ValueError, match="more than 3 blocks"):
        index.apply("a", batch(0, [1, 2, 3, 4]))


def test_a_forgotten_engine_holds_nothing_and_leaves_no_entries():
    index = Residency()
    index.begin("a", "e1")
    index.begin("b", "e1")
    index.apply("a", batch(0, [1]))
    index.apply("b", batch(0, [1]))
    index.forget("a")
    assert index.held([1]) == {"b": 1}
    index.leave("b")
    assert index._holders == {}  # nothing left of either


# --- EventFeeds against an engine that streams its events -----------------------------------------------


class EventsEngine:
    """An engine's ``wire.KV_EVENTS_PATH``: the lines it is given, then silence (or a break)."""

    def __init__(self) -> None:
        self.streams: list[asyncio.Queue[bytes | None]] = []
        self.asked: list[str] = []
        self.epoch = "e1"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.headers.get("authorization") == "Bearer engine-key"
        self.asked.append(request.query["after"])
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(orjson.dumps({"epoch": self.epoch, "block_size": 16}) + b"\n")
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.streams.append(queue)
        while (line := await queue.get()) is not None:
            await response.write(line)
        return response

    def send(self, line: dict | bytes) -> None:
        self.streams[-1].put_nowait(line if isinstance(line, bytes) else orjson.dumps(line) + b"\n")

    def cut(self) -> None:
        self.streams[-1].put_nowait(None)


@pytest.fixture
async def events_engine():
    engine = EventsEngine()
    app = web.Application()
    app.router.add_get(wire.KV_EVENTS_PATH, engine.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    yield engine
    for queue in engine.streams:
        queue.put_nowait(None)
    await runner.cleanup()


async def test_feeds_follow_an_engine_and_begin_again_after_a_break(events_engine):
    pool, index, client = EnginePool(), Residency(), EngineClient()
    pool.add("decode", Endpoint("decode-0", events_engine.url))
    feeds = EventFeeds(pool, index, client, lambda: {"Authorization": "Bearer engine-key"}, retry_s=0.05)
    task = asyncio.create_task(feeds.run())
    try:
        await wait_until(lambda: events_engine.streams, 5)
        events_engine.send(batch(0, [1, 2]))
        events_engine.send(b'{"seq": 1, "stored": [3], "removed": [1], ' + b'"cleared": false}\n')  # whole lines only
        await wait_until(lambda: index.blocks("decode-0") == {2, 3}, 5)
        assert index.live("decode-0") and events_engine.asked == ["-1"]

        events_engine.send(b"not json\n")  # a malformed line: the stream is dropped, then followed from the start
        await wait_until(lambda: len(events_engine.streams) == 2, 5)
        assert events_engine.asked == ["-1", "-1"] and index.blocks("decode-0") == frozenset()
        events_engine.send(batch(2, [7]))
        await wait_until(lambda: index.held([7]) == {"decode-0": 1}, 5)

        events_engine.epoch = "e2"  # restarted: the next stream is of another start
        events_engine.cut()
        await wait_until(lambda: len(events_engine.streams) >= 3, 5)
        assert index.held([7]) == {}

        pool.remove("decode-0")  # left the pool: its stream ends, nothing of it is kept
        await wait_until(lambda: not feeds._feeds, 5)
        assert index._holders == {}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_a_silent_stream_is_dropped(events_engine):
    pool, index, client = EnginePool(), Residency(), EngineClient()
    pool.add("prefill", Endpoint("prefill-0", events_engine.url))
    feeds = EventFeeds(pool, index, client, lambda: {"Authorization": "Bearer engine-key"}, silent_s=0.3, retry_s=0.05)
    task = asyncio.create_task(feeds.run())
    try:
        await wait_until(lambda: events_engine.streams, 5)
        events_engine.send(batch(0, [1]))
        await wait_until(lambda: index.live("prefill-0") and index.blocks("prefill-0") == {1}, 5)
        await wait_until(lambda: len(events_engine.streams) >= 2, 5)  # nothing for 0.3 s: followed again
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
