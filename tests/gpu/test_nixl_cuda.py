"""NixlKVTransport over CUDA KV caches: VRAM to VRAM between two processes on one GPU (UCX CUDA IPC).

The same source process and checks as ``tests/integration/test_nixl_transport.py``
(which runs them on CPU caches), with both caches on ``cuda:0``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from connectors.errors import TransportError  # noqa: E402
from connectors.nixl_transport import NixlKVTransport, TransferState  # noqa: E402
from tests.integration.test_nixl_transport import (  # noqa: E402
    BLOCK_LEN_BYTES,
    NUM_LAYERS,
    READ_TIMEOUT_S,
    SOURCE_SEED,
    Source,
    make_caches,
    start_source,
    stop,
)

pytestmark = pytest.mark.timeout(180)

DEVICE = "cuda"


@pytest.fixture
def reader() -> Iterator[tuple[NixlKVTransport, dict[str, torch.Tensor]]]:
    caches = make_caches(None, DEVICE)
    transport = NixlKVTransport("decode-0", transfer_timeout_s=READ_TIMEOUT_S)
    transport.register_kv_caches(caches, BLOCK_LEN_BYTES)
    yield transport, caches
    transport.close()


@pytest.fixture
def source() -> Iterator[Source]:
    started = start_source(DEVICE)
    try:
        yield started
    finally:
        stop(started)


def test_cuda_caches_are_registered_as_vram(reader, source):
    transport, _ = reader
    assert transport.kv_regions().mem_type == "VRAM"
    assert source.regions.mem_type == "VRAM"
    assert source.regions.device_id == 0


def test_read_blocks_copies_gpu_blocks_between_processes_and_notifies_source(reader, source):
    transport, caches = reader
    transport.add_peer("prefill-0", source.metadata, source.regions)
    generator = torch.Generator().manual_seed(11)
    remote_ids = torch.randperm(64, generator=generator)[:17].tolist()
    local_ids = torch.randperm(64, generator=generator)[:17].tolist()

    read = transport.read_blocks("prefill-0", local_ids, remote_ids, notify=b"req-gpu")

    assert read.wait() is TransferState.DONE, read.failure_reason
    assert read.num_bytes == len(remote_ids) * NUM_LAYERS * 2 * BLOCK_LEN_BYTES
    torch.cuda.synchronize()
    expected = make_caches(SOURCE_SEED, DEVICE)
    untouched = sorted(set(range(64)) - set(local_ids))
    for name, cache in caches.items():
        assert torch.equal(cache[:, local_ids], expected[name][:, remote_ids]), name
        assert not cache[:, untouched].any(), f"{name}: blocks outside the read were written"
    assert source.next_message() == [(transport.agent_name, b"req-gpu")]


def test_read_from_a_gpu_source_that_went_away_fails_within_the_deadline(reader, source):
    transport, _ = reader
    transport.add_peer("prefill-0", source.metadata, source.regions)
    warmup = transport.read_blocks("prefill-0", [0], [0], notify=b"warmup")
    assert warmup.wait() is TransferState.DONE, warmup.failure_reason
    source.process.kill()
    source.process.join(5)

    started = time.monotonic()
    read = transport.read_blocks("prefill-0", list(range(32)), list(range(32, 64)), notify=b"req-lost")
    state = read.wait()

    assert state is TransferState.FAILED
    assert time.monotonic() - started < READ_TIMEOUT_S + 2
    assert isinstance(read.failure_exception(), TransportError)
