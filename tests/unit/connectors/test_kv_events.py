"""``connectors.kv_events``: vLLM's own KV event publisher, relayed as the proxy reads it."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from connectors.kv_events import _Relay, batch_line, events_config, external_hash


def stored(*hashes: bytes, medium: str | None = "GPU", group: int | None = None):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[1] * 16 * len(hashes), block_size=16,
        lora_id=None, medium=medium, lora_name=None, group_idx=group,
    )  # fmt: skip


def removed(*hashes: bytes):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


def test_a_batch_names_its_blocks_by_their_low_64_bits_and_never_their_tokens():
    from vllm.distributed.kv_events import AllBlocksCleared

    line = json.loads(batch_line(4, [stored(H1, H2), removed(H3), stored(H3, medium="CPU"), stored(H3, group=1)]))
    assert line == {"seq": 4, "stored": [external_hash(H1), external_hash(H2)], "removed": [external_hash(H3)],
                    "cleared": False}  # fmt: skip
    assert external_hash(H1) == int.from_bytes(H1[-8:], "big") == external_hash(int.from_bytes(H1, "big"))
    cleared = json.loads(batch_line(5, [stored(H1), AllBlocksCleared(), stored(H2)]))
    assert cleared == {"seq": 5, "stored": [external_hash(H2)], "removed": [], "cleared": True}


@pytest.fixture
def publisher(tmp_path):
    from vllm.distributed.kv_events import ZmqEventPublisher

    config = events_config(tmp_path)
    options = {k: v for k, v in config.items() if k not in ("enable_kv_cache_events", "publisher")}
    publisher = ZmqEventPublisher(data_parallel_rank=0, **options)
    yield publisher, config
    publisher.shutdown()


def publish(publisher, *events) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))


async def lines(stream, count: int) -> list[dict]:
    """The next ``count`` lines of ``stream`` that are not heartbeats."""
    out = []
    async for line in stream:
        if line.strip() != b"{}":
            out.append(json.loads(line))
        if len(out) == count:
            return out
    return out


async def test_a_reader_gets_the_kept_batches_then_the_live_ones(publisher):
    publisher, config = publisher
    publish(publisher, stored(H1))
    publish(publisher, stored(H2))
    await asyncio.sleep(0.3)  # published before anyone reads
    relay = _Relay(config, -1)
    try:
        kept = await asyncio.wait_for(lines(relay.replay(), 3), 10)
        assert [line["seq"] for line in kept] == [0, 1]
        assert kept[1]["stored"] == [external_hash(H2)]
        publish(publisher, removed(H1))
        # the first live batch may come before the subscription reached the publisher: then the next one, which
        # does, sends the reader back to the replay for it
        live = relay.live()
        first = asyncio.ensure_future(lines(live, 1))
        done, _ = await asyncio.wait({first}, timeout=2)
        if not done:
            publish(publisher, stored(H3))
        got = await asyncio.wait_for(first, 10)
        assert got == [{"seq": 2, "stored": [], "removed": [external_hash(H1)], "cleared": False}]
    finally:
        relay.close()


async def test_a_reader_that_comes_back_gets_only_what_followed_its_last_batch(publisher):
    publisher, config = publisher
    for h in (H1, H2, H3):
        publish(publisher, stored(h))
    await asyncio.sleep(0.3)
    relay = _Relay(config, 1)
    try:
        assert [line["seq"] for line in await asyncio.wait_for(lines(relay.replay(), 5), 10)] == [2]
    finally:
        relay.close()


async def test_batches_the_publisher_no_longer_keeps_are_a_gap(tmp_path):
    from vllm.distributed.kv_events import ZmqEventPublisher

    config = events_config(tmp_path) | {"buffer_steps": 2}
    options = {k: v for k, v in config.items() if k not in ("enable_kv_cache_events", "publisher")}
    publisher = ZmqEventPublisher(data_parallel_rank=0, **options)
    try:
        for h in (H1, H2, H3):
            publish(publisher, stored(h))
        await asyncio.sleep(0.3)
        relay = _Relay(config, -1)
        try:
            kept = await asyncio.wait_for(lines(relay.replay(), 5), 10)
        finally:
            relay.close()
        assert kept[0] == {"seq": 1, "gap": True} and [line["seq"] for line in kept[1:]] == [1, 2]
    finally:
        publisher.shutdown()


async def test_a_live_batch_that_skips_numbers_sends_the_reader_back_to_the_replay(publisher):
    publisher, config = publisher
    publish(publisher, stored(H1))
    publish(publisher, stored(H2))
    await asyncio.sleep(0.3)
    relay = _Relay(config, -1)  # its subscription never saw 0 and 1, and it skips the replay
    try:
        await asyncio.sleep(0.5)  # the subscription reaches the publisher
        publish(publisher, stored(H3))
        got = await asyncio.wait_for(lines(relay.live(), 3), 10)
        assert [line["seq"] for line in got] == [0, 1, 2]  # 0 and 1 from the replay, then 2 as it came
        assert got[2]["stored"] == [external_hash(H3)]
    finally:
        relay.close()
