"""NixlKVTransport against real NIXL (UCX) between two processes on this host, over CPU KV caches.

A *source* child process (spawned, as a prefill worker would be) registers
caches filled from a seed and answers on a Pipe: first with its NIXL metadata
and regions, later with the notifications it received. The test process is
the reader (decode side).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from connectors.block_ranges import PlaneRanges
from connectors.errors import BlockMappingError, TransportError
from connectors.transport.nixl import KVRegions, NixlKVTransport, TransferState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]  # a safety net: ~4 s per test on an idle host

NUM_LAYERS = 4
KV_SHAPE = (2, 64, 16, 2, 64)  # [K/V, num_blocks, block_size, heads, head_dim]
BLOCK_LEN_BYTES = 16 * 2 * 64 * 4  # one float32 K or V plane of one block
SOURCE_SEED = 1234
WAIT_S = 20.0
READ_TIMEOUT_S = 3.0


def make_caches(seed: int | None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Layer caches filled from ``seed`` (zeros when None): the source's content is reproducible here."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return {
        f"model.layers.{i}.self_attn": (
            torch.randn(KV_SHAPE, generator=generator) if generator else torch.zeros(KV_SHAPE)
        ).to(device)
        for i in range(NUM_LAYERS)
    }


def run_source(conn, device: str = "cpu") -> None:
    """Child process: serve its caches until told to stop, forwarding notifications to the test."""
    with NixlKVTransport("prefill-0") as transport:
        caches = make_caches(SOURCE_SEED, device)
        regions = transport.register_kv_caches(caches, BLOCK_LEN_BYTES)
        conn.send((transport.handshake_payload(), regions))
        while True:
            notifications = transport.poll_notifications()
            if notifications:
                conn.send(notifications)
            if conn.poll(0.005) and conn.recv() == "stop":
                return


@dataclass
class Source:
    process: mp.Process
    conn: object
    metadata: bytes
    regions: KVRegions

    def next_message(self, timeout: float = WAIT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"source sent nothing within {timeout} s")
        return self.conn.recv()


def start_source(device: str = "cpu") -> Source:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=run_source, args=(child, device), daemon=True)
    process.start()
    if not parent.poll(WAIT_S + 20):  # spawning imports torch and starts UCX
        process.kill()
        raise TimeoutError("source process did not send its metadata")
    metadata, regions = parent.recv()
    return Source(process, parent, metadata, regions)


def stop(child: Source, grace_s: float = 5) -> None:
    """Ask a child process (anything with ``process`` and ``conn``) to stop; kill it if it does not."""
    if child.process.is_alive():
        try:
            child.conn.send("stop")
        except OSError:
            pass
        child.process.join(grace_s)
    if child.process.is_alive():
        child.process.kill()
        child.process.join(5)


@pytest.fixture
def device() -> str:
    """Where both sides' caches live; tests/gpu runs these tests again with "cuda"."""
    return "cpu"


@pytest.fixture
def reader(device: str) -> Iterator[tuple[NixlKVTransport, dict[str, torch.Tensor]]]:
    caches = make_caches(None, device)
    transport = NixlKVTransport("decode-0", transfer_timeout_s=READ_TIMEOUT_S)
    transport.register_kv_caches(caches, BLOCK_LEN_BYTES)
    yield transport, caches
    transport.close()


@pytest.fixture
def source(device: str) -> Iterator[Source]:
    started = start_source(device)
    try:
        yield started
    finally:
        stop(started)


def test_read_blocks_copies_every_layer_into_other_block_ids_and_notifies_source(reader, source, device):
    transport, caches = reader
    transport.add_peer("prefill-0", source.metadata, source.regions)
    generator = torch.Generator().manual_seed(7)
    remote_ids = torch.randperm(64, generator=generator)[:11].tolist()
    local_ids = torch.randperm(64, generator=generator)[:11].tolist()

    read = transport.read_blocks("prefill-0", local_ids, remote_ids, notify=b"req-42")

    assert read.wait() is TransferState.DONE, read.failure_reason
    assert transport.poll(read) is TransferState.DONE
    assert read.failure_exception() is None
    assert read.num_bytes == len(remote_ids) * NUM_LAYERS * 2 * BLOCK_LEN_BYTES
    expected = make_caches(SOURCE_SEED, device)
    untouched = sorted(set(range(64)) - set(local_ids))
    for name, cache in caches.items():
        assert torch.equal(cache[:, local_ids], expected[name][:, remote_ids]), name
        assert not cache[:, untouched].any(), f"{name}: blocks outside the read were written"
    assert source.next_message() == [(transport.agent_name, b"req-42")]


def test_read_from_a_source_that_went_away_fails_within_the_deadline(reader, source):
    transport, _ = reader
    transport.add_peer("prefill-0", source.metadata, source.regions)
    warmup = transport.read_blocks("prefill-0", [0], [0], notify=b"warmup")
    assert warmup.wait() is TransferState.DONE, warmup.failure_reason
    source.process.terminate()
    source.process.join(5)
    assert not source.process.is_alive()

    started = time.monotonic()
    read = transport.read_blocks("prefill-0", list(range(32)), list(range(32, 64)), notify=b"req-lost")
    state = read.wait()

    assert state is TransferState.FAILED
    assert time.monotonic() - started < READ_TIMEOUT_S + 2
    error = read.failure_exception()
    assert isinstance(error, TransportError) and "prefill-0" in str(error)


def test_read_blocks_rejects_unknown_peers_and_out_of_range_block_ids(reader, source):
    transport, _ = reader
    with pytest.raises(TransportError, match="unknown peer"):
        transport.read_blocks("prefill-0", [0], [0])
    transport.add_peer("prefill-0", source.metadata, source.regions)
    with pytest.raises(BlockMappingError, match=r"\[0, 64\)"):
        transport.read_blocks("prefill-0", [0], [64])
    with pytest.raises(BlockMappingError, match="2 local block ids for 1 remote"):
        transport.read_blocks("prefill-0", [0, 1], [5])
    with pytest.raises(TransportError, match="block_len_bytes differs"):
        transport.add_peer("prefill-1", source.metadata, KVRegions(**{**_fields(source.regions), "block_len_bytes": 8}))


def test_add_peer_refuses_runs_outside_the_blocks_and_descriptor_lists_over_the_limit(reader, source):
    transport, _ = reader
    past_the_end = PlaneRanges(1, (0,), (BLOCK_LEN_BYTES - 4,), (0,), ((0,),), (8,))
    with pytest.raises(TransportError, match="runs leave the remote block plane of 8192 bytes"):
        transport.add_peer("prefill-0", source.metadata, source.regions, past_the_end)
    transport.max_descriptors = 4 * 64 * 2 - 1  # one short of every layer's K and V planes of 64 blocks
    with pytest.raises(TransportError, match="512 remote descriptors exceed the limit of 511"):
        transport.add_peer("prefill-0", source.metadata, source.regions)
    transport.max_descriptors = 512
    transport.add_peer("prefill-0", source.metadata, source.regions)
    assert transport.read_blocks("prefill-0", [3], [5]).wait() is TransferState.DONE


def _fields(regions: KVRegions) -> dict:
    return {name: getattr(regions, name) for name in KVRegions.__slots__}


IDLE_CPU_BOUND = 0.02  # of one core: what an idle engine's connector may use (issue: idle engines idle)


def run_quiet_source(conn, progress: str) -> None:
    """Child process: registers its caches, then never calls into NIXL again (a prefill engine busy in a
    long forward pass); reports its CPU use while idle, then waits to be stopped."""
    import os

    with NixlKVTransport("prefill-quiet", progress=progress) as transport:
        caches = make_caches(SOURCE_SEED)  # kept alive: NIXL reads this memory
        regions = transport.register_kv_caches(caches, BLOCK_LEN_BYTES)
        conn.send((transport.handshake_payload(), regions, transport.progress))
        before, started = os.times(), time.monotonic()
        time.sleep(3)
        after = os.times()
        conn.send((after.user + after.system - before.user - before.system) / (time.monotonic() - started))
        conn.recv()  # "stop": no NIXL call until then


@dataclass
class QuietSource:
    process: mp.Process
    conn: object
    metadata: bytes
    regions: KVRegions
    progress: str


@pytest.fixture
def quiet_source(request: pytest.FixtureRequest) -> Iterator[QuietSource]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=run_quiet_source, args=(child, request.param), daemon=True)
    process.start()
    try:
        if not parent.poll(WAIT_S + 20):
            raise TimeoutError("source process did not send its metadata")
        yield QuietSource(process, parent, *parent.recv())
    finally:
        stop(QuietSource(process, parent, b"", None, ""))  # type: ignore[arg-type]


@pytest.mark.parametrize("quiet_source", ["thread"], indirect=True)
def test_an_idle_agent_sleeps_and_a_source_that_never_polls_is_still_read(reader, quiet_source):
    # NIXL's progress thread spins a core with the Python API's pthrDelay=0; ours wakes on UCX events.
    assert quiet_source.progress == "thread"
    idle = quiet_source.conn.recv()
    assert idle < IDLE_CPU_BOUND, f"an idle NIXL agent used {idle:.1%} of a core"
    transport, caches = reader
    transport.add_peer("prefill-quiet", quiet_source.metadata, quiet_source.regions)
    read = transport.read_blocks("prefill-quiet", [1, 2], [3, 4], notify=b"req-1")
    assert read.wait() is TransferState.DONE, read.failure_reason
    expected = make_caches(SOURCE_SEED)
    for name, cache in caches.items():
        assert torch.equal(cache[:, [1, 2]], expected[name][:, [3, 4]]), name


def test_caller_progress_needs_no_thread_and_reads_from_a_polling_source(reader, source):
    # The fallback mode: no NIXL thread at all; the source progresses in its own polls (an engine's steps).
    transport = NixlKVTransport("decode-caller", transfer_timeout_s=READ_TIMEOUT_S, progress="caller")
    try:
        assert transport.progress == "caller"
        caches = make_caches(None)
        transport.register_kv_caches(caches, BLOCK_LEN_BYTES)
        transport.add_peer("prefill-0", source.metadata, source.regions)
        read = transport.read_blocks("prefill-0", [0, 5], [9, 10], notify=b"req-caller")
        assert read.wait() is TransferState.DONE, read.failure_reason
        expected = make_caches(SOURCE_SEED)
        assert all(torch.equal(caches[n][:, [0, 5]], expected[n][:, [9, 10]]) for n in caches)
        assert source.next_message() == [(transport.agent_name, b"req-caller")]
    finally:
        transport.close()
    with pytest.raises(TransportError, match="progress must be one of"):
        NixlKVTransport("decode-x", progress="spin")
