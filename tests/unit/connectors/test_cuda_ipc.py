"""CUDA IPC transport without a GPU: its payload's checks, its moves, its stock gather, and when it is chosen.

The moves of a read (``plan_moves``) and the stock gather (``copy_moves_torch``)
run here on CPU tensors: for every layout pair and TP split they must land
exactly the bytes the in-memory transport lands (the NIXL descriptors, which
``test_block_ranges`` checks against the torch reference), and for vLLM
0.32's head-major GPU layout (HN2D) exactly the reference's tokens. The mapping itself and
the Triton gather need a GPU: ``tests/gpu/test_cuda_ipc.py``.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from connectors.block_ranges import plan_peer_ranges
from connectors.errors import BlockMappingError, TransportError
from connectors.topology import plan_reads
from connectors.transport import CUDA_IPC, IN_MEMORY, NIXL, Where, common_transports
from connectors.transport.base import cache_regions
from connectors.transport.cuda_ipc import CudaIpcTransport, IpcExport, IpcStorage, decode_export, region_views
from connectors.transport.fake import InMemoryTransport
from connectors.transport.gather import copy_moves_torch, plan_moves, run_table
from connectors.transport.group import WorkerTransports
from tests.kv_reference import cache_shape, rank_heads, read_tokens, write_tokens
from tests.unit.kv_factories import topology_factory

NUM_BLOCKS, NUM_LAYERS, HEAD_DIM = 12, 2, 8
make_topology = topology_factory(head_dim=HEAD_DIM, num_layers=NUM_LAYERS, dtype="float32")


def storage_entry(**overrides: object) -> dict[str, object]:
    entry = {
        "device": 0,
        "handle": base64.b64encode(b"h" * 64).decode(),
        "size": 1 << 20,
        "offset": 0,
        "ref_counter_handle": base64.b64encode(b"/torch_1_2").decode(),
        "ref_counter_offset": 0,
        "event_handle": base64.b64encode(b"e" * 64).decode(),
        "event_sync_required": True,
        "data_ptr": 1 << 32,
    }
    return entry | overrides


def payload(**overrides: object) -> bytes:
    data = {"version": 1, "gpu_uuid": "GPU-1", "gpu_name": "NVIDIA H100", "storages": [storage_entry()]}
    return json.dumps(data | overrides).encode()


# ---------------------------------------------------------------- the payload


def test_an_export_round_trips_through_its_payload():
    export = decode_export(payload())
    assert decode_export(export.encode()) == export
    assert export.storages[0].handle == b"h" * 64 and export.storages[0].data_ptr == 1 << 32


@pytest.mark.parametrize(
    "data, field",
    [
        (b"\xff not json", "JSON"),
        (b"[1, 2]", "version"),
        (payload(version=2), "version"),
        (payload(storages=[]), "storages"),
        (payload(storages=[storage_entry()] * 5000), "storages"),
        (payload(gpu_uuid=""), "gpu_uuid"),
        (payload(storages=[7]), "not a map"),
        (payload(storages=[storage_entry(size=0)]), "size"),
        (payload(storages=[storage_entry(size=True)]), "size"),
        (payload(storages=[storage_entry(offset=-1)]), "offset"),
        (payload(storages=[storage_entry(data_ptr=2**64)]), "data_ptr"),
        (payload(storages=[storage_entry(handle="not base64!")]), "handle"),
        (payload(storages=[storage_entry(handle="")]), "handle"),
        (payload(storages=[storage_entry(handle=base64.b64encode(b"x" * 2000).decode())]), "handle"),
        (payload(storages=[storage_entry(event_sync_required="yes")]), "event_sync_required"),
    ],
)
def test_a_bad_payload_is_refused_naming_the_field(data: bytes, field: str):
    with pytest.raises(TransportError, match=field):
        decode_export(data)


def test_a_region_outside_every_exported_storage_is_refused():
    export = decode_export(payload())
    start = 1 << 32
    assert export.storage_of(start + 100, 1000) == 0
    for address, length in ((start - 1, 10), (start + (1 << 20) - 10, 11), (0, 1)):
        with pytest.raises(TransportError, match="outside every storage"):
            export.storage_of(address, length)


def test_without_a_gpu_cuda_ipc_cannot_read_and_stands_aside():
    transport = CudaIpcTransport("decode-0")
    assert "not visible" in transport.cannot_read(payload())
    assert "JSON" in transport.cannot_read(b"junk")
    with pytest.raises(TransportError, match="CUDA caches only"):
        transport.register_kv_caches({"layer.0": torch.zeros(4, 16)}, 64, planes_per_layer=1)
    with pytest.raises(TransportError, match="copy must be"):
        CudaIpcTransport("decode-0", copy="memcpy")


def test_a_source_on_another_gpu_of_the_node_is_read_by_its_uuid_where_peer_access_allows(monkeypatch):
    """The reader's choice by GPU UUID: a source on a GPU this process sees is readable from its own GPU where CUDA
    peer access allows (NVLink or PCIe), and refused, naming why, where it does not or the GPU is hidden."""
    from types import SimpleNamespace

    import connectors.transport.cuda_ipc as cuda_ipc

    source_gpu = json.loads(payload())["gpu_uuid"]
    transport = CudaIpcTransport("decode-0")
    transport._regions = object()  # registered on GPU 0 (what cannot_read looks at)
    transport._stream = SimpleNamespace(device=SimpleNamespace(index=0))
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: {"GPU-own": 0, source_gpu: 1})
    pairs = {(0, 1)}
    monkeypatch.setattr(cuda_ipc, "peer_access", lambda reader, source: reader == source or (reader, source) in pairs)
    assert transport.cannot_read(payload()) is None
    pairs.clear()
    assert "no peer access" in transport.cannot_read(payload())
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: {"GPU-own": 0})
    assert "not visible" in transport.cannot_read(payload())


# ---------------------------------------------------------------- the choice


def test_cuda_ipc_is_preferred_on_one_node_and_nixl_between_nodes():
    both = (CUDA_IPC, NIXL)
    assert common_transports(both, both, Where.SAME_NODE) == (CUDA_IPC, NIXL)
    assert common_transports(both, both, Where.OTHER_NODE) == (NIXL,)
    assert common_transports((NIXL,), both, Where.SAME_NODE) == (NIXL,)
    assert common_transports(both, (NIXL,), Where.SAME_NODE) == (NIXL,)


def test_a_worker_on_cpu_caches_serves_what_can_serve_them():
    transports = WorkerTransports("prefill-0", (CUDA_IPC, IN_MEMORY))
    caches = {f"layer.{i}": torch.zeros(4, 16) for i in range(2)}  # 4 blocks of 64 bytes
    transports.register_kv_caches(caches, 64, planes_per_layer=1)
    assert transports.names == (IN_MEMORY,)
    assert set(transports.payloads()) == {IN_MEMORY}
    with pytest.raises(TransportError, match="not serving"):
        transports.get(CUDA_IPC)
    transports.close()
    alone = WorkerTransports("prefill-1", (CUDA_IPC,))
    with pytest.raises(
        TransportError, match="no KV transport can serve its caches: cuda-ipc: CUDA IPC moves CUDA caches only"
    ):
        alone.register_kv_caches(caches, 64, planes_per_layer=1)


# ---------------------------------------------------------------- the moves


def cpu_views(caches: dict[str, torch.Tensor], planes: int, block_len: int):
    """Regions of CPU ``caches`` and their flat views, as the transport cuts them from exported storages."""
    regions = cache_regions(caches, block_len, planes, "test")
    storages = [cache.untyped_storage() for cache in caches.values()]
    export = IpcExport(
        "GPU-0",
        "cpu",
        tuple(IpcStorage(0, b"h", s.nbytes(), 0, b"r", 0, b"", False, s.data_ptr()) for s in storages),
    )
    flat = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages]
    return regions, region_views(regions, export, flat)


def layer_caches(layout: str, heads: int, block_size: int, seed: int | None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed or 0)
    shape = cache_shape(layout, NUM_BLOCKS, block_size, heads, HEAD_DIM)
    return {
        f"layer.{i}": torch.randn(shape, generator=generator) if seed is not None else torch.zeros(shape)
        for i in range(NUM_LAYERS)
    }


CASES = [
    # (local layout, remote layout, local TP, remote TP, heads, local block size, remote block size)
    ("NH2D", "NH2D", 1, 1, 4, 16, 16),
    ("NH2D", "HN2D", 2, 1, 4, 16, 16),
    ("HN2D", "NH2D", 1, 2, 4, 16, 8),
    ("HN2D", "HN2D", 2, 1, 4, 16, 8),
    ("H2ND", "NH2D", 2, 4, 4, 16, 16),
    ("NH2D", "H2ND", 4, 2, 2, 16, 8),
]


@pytest.mark.parametrize("local_layout, remote_layout, local_tp, remote_tp, heads, local_bs, remote_bs", CASES)
def test_the_stock_gather_lands_the_bytes_the_descriptor_transport_lands(
    local_layout, remote_layout, local_tp, remote_tp, heads, local_bs, remote_bs
):
    local = make_topology(
        tp_size=local_tp, tp_rank=local_tp - 1, total_num_kv_heads=heads, layout=local_layout, block_size=local_bs
    )
    remote_tp_rank = plan_reads(local, make_topology(tp_size=remote_tp, total_num_kv_heads=heads)).slices[0]
    remote = make_topology(
        tp_size=remote_tp,
        tp_rank=remote_tp_rank.remote_rank,
        total_num_kv_heads=heads,
        layout=remote_layout,
        block_size=remote_bs,
    )
    ranges = plan_peer_ranges(local, remote)
    source_caches = layer_caches(remote_layout, remote.num_heads, remote_bs, seed=7)
    by_gather = layer_caches(local_layout, local.num_heads, local_bs, seed=None)
    by_memmove = layer_caches(local_layout, local.num_heads, local_bs, seed=None)
    remote_ids = [9, 2, 5, 0, 11, 3][: 2 * ranges.ratio]
    local_ids = [4, 1][: -(-len(remote_ids) // ranges.ratio)]

    remote_regions, src = cpu_views(source_caches, remote.planes_per_layer, remote.block_plane_bytes)
    local_regions, dst = cpu_views(by_gather, local.planes_per_layer, local.block_plane_bytes)
    moves = plan_moves(ranges, local_regions, remote_regions, local_ids, remote_ids)
    copy_moves_torch(moves, src, dst)

    source, reader = InMemoryTransport("prefill"), InMemoryTransport("decode")
    source.register_kv_caches(source_caches, remote.block_plane_bytes, planes_per_layer=remote.planes_per_layer)
    reader.register_kv_caches(by_memmove, local.block_plane_bytes, planes_per_layer=local.planes_per_layer)
    reader.add_peer("p", source.handshake_payload(), source.kv_regions(), ranges)
    read = reader.read_blocks("p", local_ids, remote_ids)

    assert moves.num_bytes == read.num_bytes > 0
    for name in by_gather:
        assert torch.equal(by_gather[name], by_memmove[name]), name
        assert by_gather[name].abs().sum() > 0


def test_a_head_major_read_lands_the_reference_tokens():
    """Two prefill ranks of 2 heads each into one decode rank of 4, HN2D (vLLM 0.32 on GPU, LBHNC) on both sides:
    the reference says where every token goes."""
    heads, block_size = 4, 16
    local = make_topology(tp_size=1, total_num_kv_heads=heads, block_size=block_size, layout="HN2D")
    decode = layer_caches("HN2D", heads, block_size, seed=None)
    local_regions, dst = cpu_views(decode, 1, local.block_plane_bytes)
    tokens = torch.randn(NUM_LAYERS, 2, 2 * block_size, heads, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    for rank in range(2):
        remote = make_topology(tp_size=2, tp_rank=rank, total_num_kv_heads=heads, block_size=block_size, layout="HN2D")
        prefill = layer_caches("HN2D", 2, block_size, seed=None)
        for layer, cache in enumerate(prefill.values()):
            write_tokens(cache, "HN2D", [6, 8], tokens[layer][:, :, rank_heads(2, rank, heads)])
        remote_regions, src = cpu_views(prefill, 1, remote.block_plane_bytes)
        moves = plan_moves(plan_peer_ranges(local, remote), local_regions, remote_regions, [3, 10], [6, 8])
        copy_moves_torch(moves, src, dst)
    for layer, cache in enumerate(decode.values()):
        assert torch.equal(read_tokens(cache, "HN2D", [3, 10], HEAD_DIM), tokens[layer])


def test_moves_refuse_block_ids_outside_either_cache():
    topology = make_topology(layout="HN2D")
    caches = layer_caches("HN2D", 4, 16, seed=None)
    regions, _ = cpu_views(caches, 1, topology.block_plane_bytes)
    ranges = plan_peer_ranges(topology, topology)
    with pytest.raises(BlockMappingError, match="remote block ids"):
        plan_moves(ranges, regions, regions, [0], [NUM_BLOCKS])
    with pytest.raises(BlockMappingError, match="local block ids"):
        plan_moves(ranges, regions, regions, [-1], [0])


def test_moves_of_whole_planes_are_one_run_per_layer_plane_and_block():
    topology = make_topology(layout="NH2D")
    caches = layer_caches("NH2D", 4, 16, seed=None)
    regions, _ = cpu_views(caches, 1, topology.block_plane_bytes)
    moves = plan_moves(plan_peer_ranges(topology, topology), regions, regions, [1, 2, 3], [4, 5, 6])
    assert len(moves.lengths) == NUM_LAYERS * 3
    assert set(moves.lengths.tolist()) == {topology.block_plane_bytes}
    assert moves.row_bytes == topology.block_plane_bytes  # whole planes: one row each
    np.testing.assert_array_equal(np.unique(moves.src_regions), np.arange(NUM_LAYERS))


@pytest.mark.parametrize("local_layout, remote_layout, local_tp, remote_tp, heads, local_bs, remote_bs", CASES)
def test_the_run_table_gives_every_move_its_addresses(
    local_layout, remote_layout, local_tp, remote_tp, heads, local_bs, remote_bs
):
    """What the Triton gather computes from a peer's run table and a read's block ids (the kernel's arithmetic,
    in numpy) is where the moves say each run goes."""
    local = make_topology(tp_size=local_tp, total_num_kv_heads=heads, layout=local_layout, block_size=local_bs)
    rank = plan_reads(local, make_topology(tp_size=remote_tp, total_num_kv_heads=heads)).slices[0].remote_rank
    remote = make_topology(
        tp_size=remote_tp, tp_rank=rank, total_num_kv_heads=heads, layout=remote_layout, block_size=remote_bs
    )
    ranges = plan_peer_ranges(local, remote)
    remote_regions, src = cpu_views(layer_caches(remote_layout, remote.num_heads, remote_bs, None),
                                    remote.planes_per_layer, remote.block_plane_bytes)  # fmt: skip
    local_regions, dst = cpu_views(layer_caches(local_layout, local.num_heads, local_bs, None),
                                   local.planes_per_layer, local.block_plane_bytes)  # fmt: skip
    src_bases = np.asarray([view.data_ptr() for view in src], dtype=np.int64)
    dst_bases = np.asarray([view.data_ptr() for view in dst], dtype=np.int64)
    table = run_table(ranges, local_regions, remote_regions, dst_bases, src_bases)
    remote_ids = np.asarray([9, 2, 5, 0][: 2 * ranges.ratio])
    local_ids = np.asarray([4, 1][: -(-len(remote_ids) // ranges.ratio)])
    moves = plan_moves(ranges, local_regions, remote_regions, local_ids, remote_ids)

    position = np.arange(len(remote_ids))
    src = table.src[:, None, :] + (remote_ids * table.remote_block_bytes)[None, :, None]
    dst = (
        table.dst[:, position % ranges.ratio, :]
        + (local_ids[position // ranges.ratio] * table.local_block_bytes)[None, :, None]
    )
    np.testing.assert_array_equal(src.ravel(), src_bases[moves.src_regions] + moves.src_offsets)
    np.testing.assert_array_equal(dst.ravel(), dst_bases[moves.dst_regions] + moves.dst_offsets)
    np.testing.assert_array_equal(np.broadcast_to(table.words * 8, src.shape).ravel(), moves.lengths)
