"""CudaIpcTransport between two processes on one GPU: every byte of scattered blocks lands where it should.

The source process of ``testlib/cuda_ipc_blocks.py`` (caches in vLLM 0.32's
GPU layout HN2D, filled from a seed) serves; this process maps its caches and
reads 64 and 256 MiB of scattered blocks with each gather, then a head slice
into caches of another layout (an NH2D decode rank of TP 2 reading a prefill of
TP 1), and compares with the source's content regenerated from the seed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from connectors.block_ranges import plan_peer_ranges  # noqa: E402
from connectors.errors import TransportError  # noqa: E402
from connectors.topology import KVTopology  # noqa: E402
from connectors.transport import CUDA_IPC  # noqa: E402
from connectors.transport.base import TransferState  # noqa: E402
from connectors.transport.cuda_ipc import CudaIpcTransport  # noqa: E402
from testlib import cuda_ipc_blocks as bench  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GEOMETRY = bench.Geometry(layers=8, blocks=2048)


@pytest.fixture(scope="module")
def source() -> Iterator[bench.Source]:
    started = bench.start_source(GEOMETRY, (CUDA_IPC,))
    try:
        yield started
    finally:
        started.stop()


def reader(
    source: bench.Source, copy: str, caches: dict[str, torch.Tensor], ranges=None, driver: str = "auto"
) -> CudaIpcTransport:
    transport = CudaIpcTransport("decode-0", copy=copy, driver=driver)
    transport.register_kv_caches(caches, next(iter(caches.values()))[0].nbytes, planes_per_layer=1)
    payload, regions = source.offers[CUDA_IPC]
    assert transport.cannot_read(payload) is None
    transport.add_peer("prefill/rank0", payload, regions, ranges)
    return transport


@pytest.mark.parametrize(("copy", "driver"), [("triton", "auto"), ("triton", "torch"), ("torch", "auto")])
@pytest.mark.parametrize("size_mib", [64, 256])
def test_scattered_blocks_arrive_byte_for_byte(source: bench.Source, copy: str, driver: str, size_mib: int):
    """The first read (Triton's JIT compiles the gather) and the ones after it (the compiled kernel launched
    directly, offsets through the ring), several in flight at once; the host's calls made straight to the driver
    and through PyTorch."""
    local = bench.caches(GEOMETRY, None)
    transport = reader(source, copy, local, driver=driver)
    if copy == "triton" and driver == "auto":
        assert transport._driver is not None  # the driver's calls bind on a GPU host
    local_ids, remote_ids = bench.pick_blocks(GEOMETRY, size_mib, seed=size_mib)
    read = transport.read_blocks("prefill/rank0", local_ids, remote_ids)
    assert read.wait() is TransferState.DONE
    assert read.num_bytes == len(local_ids) * GEOMETRY.block_bytes == size_mib << 20
    assert bench.check_blocks(GEOMETRY, local, local_ids, remote_ids) == []
    untouched = sorted(set(range(GEOMETRY.blocks)) - set(local_ids))[:64]
    assert all(cache[untouched].count_nonzero() == 0 for cache in local.values())
    for cache in local.values():
        cache.zero_()
    picks = [bench.pick_blocks(GEOMETRY, size_mib // 4, seed=size_mib + i) for i in range(1, 4)]
    reads = [transport.read_blocks("prefill/rank0", l_ids, r_ids) for l_ids, r_ids in picks]  # posted together
    assert [r.wait() for r in reads] == [TransferState.DONE] * 3
    assert all(r.gpu_s is not None and r.gpu_s > 0 for r in reads)
    l_ids, r_ids = picks[-1]  # the last one wins where the picks share local blocks
    assert bench.check_blocks(GEOMETRY, local, l_ids, r_ids) == []
    if copy == "triton" and driver == "auto":
        assert transport._driver is not None  # every read went straight to the driver: none fell back
    transport.close()


def test_a_source_that_restarts_while_mapped_is_read_anew_and_its_old_mapping_let_go():
    """The KV ownership case of a prefill engine restarted while a reader maps it: the reader's mappings are keyed
    by the engine's start (``mapping_name``); the new start's blocks are read through a new mapping, the old one
    is unmapped when dropped, and nothing reads through it again."""
    from connectors.identity import mapping_name

    geometry = bench.Geometry(layers=4, blocks=256)
    local = bench.caches(geometry, None)
    transport = CudaIpcTransport("decode-0")
    transport.register_kv_caches(local, geometry.plane_bytes, planes_per_layer=1)
    old_name, new_name = mapping_name("prefill-0", 0, "start-1"), mapping_name("prefill-0", 0, "start-2")
    first = bench.start_source(geometry, (CUDA_IPC,), seed=1)
    second = None
    try:
        payload, regions = first.offers[CUDA_IPC]
        transport.add_peer(old_name, payload, regions)
        local_ids, remote_ids = bench.pick_blocks(geometry, 8, seed=5)
        assert transport.read_blocks(old_name, local_ids, remote_ids).wait() is TransferState.DONE
        assert bench.check_blocks(geometry, local, local_ids, remote_ids, seed=1) == []
        old_keys = set(transport._opened)

        first.process.kill()  # kill -9 of the prefill engine while the reader maps its caches
        first.process.join(10)
        second = bench.start_source(geometry, (CUDA_IPC,), seed=2)  # its restart: new caches, new content
        payload2, regions2 = second.offers[CUDA_IPC]
        assert payload2 != payload
        transport.add_peer(new_name, payload2, regions2)
        transport.remove_peer(old_name)  # the reader drops the old start (a handshake of another start did)
        assert not old_keys & set(transport._opened) and len(transport._opened) == geometry.layers

        for cache in local.values():
            cache.zero_()
        assert transport.read_blocks(new_name, local_ids, remote_ids).wait() is TransferState.DONE
        assert bench.check_blocks(geometry, local, local_ids, remote_ids, seed=2) == []
        assert bench.check_blocks(geometry, local, local_ids, remote_ids, seed=1) != []
        with pytest.raises(TransportError, match="unknown peer"):
            transport.read_blocks(old_name, local_ids, remote_ids)
    finally:
        transport.close()
        for source in (first, second):
            if source is not None:
                source.stop()


@pytest.mark.parametrize("copy", ["triton", "torch"])
def test_a_head_slice_lands_in_another_layout(source: bench.Source, copy: str):
    """Decode rank 1 of TP 2, NH2D (token-major), reads heads 4-7 of the TP 1 HN2D (head-major) source: one run
    per token and head, K and V of the head together."""
    g = GEOMETRY
    topology = dict(total_num_kv_heads=g.heads, block_size=g.block_size, head_dim=g.head_dim, dtype="bfloat16")
    remote = KVTopology(tp_size=1, tp_rank=0, layout="HN2D", num_layers=g.layers, **topology)
    local = KVTopology(tp_size=2, tp_rank=1, layout="NH2D", num_layers=g.layers, **topology)
    ranges = plan_peer_ranges(local, remote)
    assert ranges.num_runs == g.block_size * g.heads // 2
    nh2d = {  # memory [blocks, block_size, heads, 2 * head_dim], handed as vLLM does: [blocks, heads, block_size, 2D]
        f"layer.{i}": torch.zeros(
            g.blocks, g.block_size, g.heads // 2, 2 * g.head_dim, dtype=torch.bfloat16, device="cuda"
        ).transpose(1, 2)
        for i in range(g.layers)
    }
    transport = reader(source, copy, nh2d, ranges)
    local_ids, remote_ids = bench.pick_blocks(g, 16, seed=3)
    assert transport.read_blocks("prefill/rank0", local_ids, remote_ids).wait() is TransferState.DONE
    for layer, cache in enumerate(nh2d.values()):
        expected = bench.layer_cache(g, layer, bench.SOURCE_SEED)[remote_ids][:, g.heads // 2 :]
        got = cache[local_ids]  # [blocks, heads, block_size, 2D] on both sides
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), layer
    transport.close()


def test_a_region_outside_the_export_is_refused(source: bench.Source):
    local = bench.caches(bench.Geometry(layers=GEOMETRY.layers, blocks=4), None)
    transport = CudaIpcTransport("decode-0")
    transport.register_kv_caches(local, GEOMETRY.plane_bytes, planes_per_layer=1)
    payload, regions = source.offers[CUDA_IPC]
    shifted = type(regions)(
        regions.layer_names,
        tuple(address + GEOMETRY.plane_bytes for address in regions.region_addrs),
        regions.num_blocks,
        regions.block_len_bytes,
        regions.mem_type,
        regions.device_id,
    )
    with pytest.raises(TransportError, match="outside every storage"):
        transport.add_peer("prefill/rank0", payload, shifted, plan_peer_ranges_whole(regions))
    assert transport._opened == {}  # nothing of a refused peer stays mapped
    transport.close()


def test_a_removed_peer_is_unmapped(source: bench.Source):
    transport = reader(source, "triton", bench.caches(bench.Geometry(layers=GEOMETRY.layers, blocks=4), None))
    assert len(transport._opened) == GEOMETRY.layers
    transport.remove_peer("prefill/rank0")
    assert transport._opened == {}
    transport.close()


def plan_peer_ranges_whole(regions):
    from connectors.block_ranges import whole_plane_ranges

    return whole_plane_ranges(1, regions.block_len_bytes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one node")
def test_engines_on_two_gpus_of_a_node_read_each_other_over_cuda_ipc():
    """A source on GPU 1 and a reader on GPU 0 of one process's view (as vLLM's Ray workers see their node): the
    reader picks CUDA IPC by the source's GPU UUID, enables peer access, and the blocks arrive byte for byte."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer access")
    geometry = bench.Geometry(layers=8, blocks=512)
    source = bench.start_source(geometry, (CUDA_IPC,), device=1)
    try:
        local = bench.caches(geometry, None)  # on GPU 0
        transport = reader(source, "triton", local)
        assert transport.cannot_read(source.offers[CUDA_IPC][0]) is None
        local_ids, remote_ids = bench.pick_blocks(geometry, 64, seed=11)
        read = transport.read_blocks("prefill/rank0", local_ids, remote_ids)
        assert read.wait() is TransferState.DONE
        assert bench.check_blocks(geometry, local, local_ids, remote_ids) == []
        transport.close()
    finally:
        source.stop()
