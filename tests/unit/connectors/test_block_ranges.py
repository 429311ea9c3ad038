"""Runs, descriptors and read indices of direct reads, against a torch reference.

The end-to-end test stores one sequence's whole KV the way every prefill TP
rank would (its heads, its block size and layout, scattered block ids, one
cache tensor per layer), builds every decode rank's descriptor lists exactly
as the transport does (``plan_peer_ranges``, ``remote_descriptors``,
``local_descriptors``, ``read_indices``), and performs the READ by copying
the bytes each descriptor pair names between the real tensors' memory (what
NIXL does). Each decode cache must then equal a reference built by
``tests.kv_reference``: the rank's heads of the sequence in its blocks, and
every other byte untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from connectors.block_ranges import (
    KVRegions,
    PlaneRanges,
    local_descriptors,
    plan_peer_ranges,
    plan_plane_ranges,
    read_indices,
    remote_descriptors,
    whole_plane_ranges,
)
from connectors.errors import BlockMappingError, TopologyMismatch
from connectors.topology import HeadSlice, KVTopology, plan_reads, source_ranks
from tests.kv_reference import cache_shape, noise_cache, padded, rank_heads, read_tokens, write_tokens
from tests.unit.kv_factories import topology_factory

HEAD_DIM = 4
DTYPE = torch.float16
NUM_LAYERS = 2
NUM_TOKENS = 2 * 16 + 5  # a partly filled last block for every block size below
SPARE_BLOCKS = 3

TopologyFactory = Callable[..., KVTopology]


@pytest.fixture
def make_topology() -> TopologyFactory:
    return topology_factory(head_dim=HEAD_DIM, dtype="float16", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------- an emulated NIXL READ


def regions_of(caches: list[torch.Tensor], topology: KVTopology) -> KVRegions:
    """What ``NixlKVTransport.register_kv_caches`` reports for these layer caches: one region per layer."""
    assert topology.planes_per_layer == 1
    return KVRegions(
        layer_names=tuple(f"layer.{i}" for i in range(len(caches))),
        region_addrs=tuple(cache.data_ptr() for cache in caches),
        num_blocks=caches[0].shape[0],
        block_len_bytes=topology.block_plane_bytes,
        mem_type="DRAM",
        device_id=0,
    )


class Memory:
    """The bytes of some tensors, addressed as NIXL addresses them (by data pointer)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._spans = sorted(
            (t.data_ptr(), t.numel() * t.element_size(), t.view(-1).view(torch.uint8).numpy()) for t in tensors
        )
        self._starts = np.array([start for start, _, _ in self._spans], dtype=np.uint64)

    def locate(self, address: int, length: int) -> tuple[np.ndarray, int]:
        index = int(np.searchsorted(self._starts, np.uint64(address), side="right")) - 1
        start, size, data = self._spans[index]
        offset = address - start
        assert 0 <= offset and offset + length <= size, "descriptor outside every registered tensor"
        return data, offset


def nixl_read(
    local_rows: np.ndarray, local_idx: np.ndarray, remote_rows: np.ndarray, remote_idx: np.ndarray, memory: Memory
) -> int:
    """Copy what each (local, remote) descriptor pair names, as one NIXL READ would; returns the bytes moved."""
    moved = 0
    for (dst_addr, dst_len, _), (src_addr, src_len, _) in zip(
        local_rows[local_idx].tolist(), remote_rows[remote_idx].tolist(), strict=True
    ):
        assert dst_len == src_len, "paired descriptors must have one length"
        dst, dst_offset = memory.locate(dst_addr, dst_len)
        src, src_offset = memory.locate(src_addr, src_len)
        dst[dst_offset : dst_offset + dst_len] = src[src_offset : src_offset + src_len]
        moved += dst_len
    return moved


# ---------------------------------------------------------------- end to end

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
# vLLM 0.32's: the CPU cache, and on GPU head-major (LBHNC) and token-major (LBNHC)
LAYOUTS = ["H2ND", "HN2D", "NH2D"]
BLOCK_SIZES = [(16, 16), (8, 16), (4, 16)]  # (prefill, decode): equal, 2 and 4 prefill blocks per decode block
RATIOS = [(16, 16), (8, 16)]


def prefill_engine(
    topology: KVTopology, whole: list[torch.Tensor], block_ids: list[int], generator: torch.Generator
) -> list[list[torch.Tensor]]:
    """Every prefill rank's layer caches: noise, and its heads of each layer's ``whole`` in ``block_ids``."""
    num_blocks = len(block_ids) + SPARE_BLOCKS
    engine = []
    for rank in range(topology.tp_size):
        heads = rank_heads(topology.tp_size, rank, topology.total_num_kv_heads)
        shape = cache_shape(topology.layout, num_blocks, topology.block_size, len(heads), HEAD_DIM)
        caches = []
        for layer in range(NUM_LAYERS):
            cache = noise_cache(shape, DTYPE, generator)
            write_tokens(
                cache,
                topology.layout,
                block_ids,
                padded(whole[layer][:, :, heads], len(block_ids) * topology.block_size),
            )
            caches.append(cache)
        engine.append(caches)
    return engine


def assert_direct_reads_move_the_reference(prefill: KVTopology, decode: KVTopology, generator: torch.Generator) -> None:
    """Every decode rank READs a sequence from the prefill ranks its plan names and then holds, by the torch
    reference, its heads of the sequence in its blocks and nothing else new, having moved each byte once."""
    num_heads, kv = prefill.total_num_kv_heads, prefill.kv_components
    whole = [torch.randn(kv, NUM_TOKENS, num_heads, HEAD_DIM, generator=generator).to(DTYPE) for _ in range(NUM_LAYERS)]
    num_prefill_blocks = -(-NUM_TOKENS // prefill.block_size)
    prefill_ids = torch.randperm(num_prefill_blocks + SPARE_BLOCKS, generator=generator)[:num_prefill_blocks].tolist()
    prefill_caches = prefill_engine(prefill, whole, prefill_ids, generator)
    num_decode_blocks = -(-NUM_TOKENS // decode.block_size)

    for rank in range(decode.tp_size):
        local = decode.with_rank(rank)
        heads = rank_heads(decode.tp_size, rank, num_heads)
        decode_ids = torch.randperm(num_decode_blocks + SPARE_BLOCKS, generator=generator)[:num_decode_blocks].tolist()
        shape = cache_shape(decode.layout, num_decode_blocks + SPARE_BLOCKS, decode.block_size, len(heads), HEAD_DIM)
        caches = [noise_cache(shape, DTYPE, generator) for _ in range(NUM_LAYERS)]
        expected = [cache.clone() for cache in caches]
        for layer in range(NUM_LAYERS):
            # Remote blocks move whole: the zero padding of the last prefill block comes along.
            tokens = padded(whole[layer][:, :, heads], num_prefill_blocks * prefill.block_size)
            write_tokens(expected[layer], decode.layout, decode_ids, tokens)

        local_regions = regions_of(caches, local)
        moved = 0
        sources = source_ranks(local, prefill.tp_size)
        assert sources == plan_reads(local, prefill).remote_ranks
        for remote_rank in sources:
            remote = prefill.with_rank(remote_rank)
            ranges = plan_peer_ranges(local, remote)
            remote_regions = regions_of(prefill_caches[remote_rank], remote)
            local_idx, remote_idx = read_indices(
                ranges,
                decode_ids,
                prefill_ids,
                num_layers=NUM_LAYERS,
                local_num_blocks=local_regions.num_blocks,
                remote_num_blocks=remote_regions.num_blocks,
            )
            memory = Memory(caches + prefill_caches[remote_rank])
            moved += nixl_read(
                local_descriptors(ranges, local_regions),
                local_idx,
                remote_descriptors(ranges, remote_regions),
                remote_idx,
                memory,
            )

        for layer in range(NUM_LAYERS):
            assert torch.equal(caches[layer], expected[layer]), f"decode rank {rank}, layer {layer}"
            seen = read_tokens(caches[layer], decode.layout, decode_ids, HEAD_DIM)[:, :NUM_TOKENS]
            assert torch.equal(seen, whole[layer][:, :, heads])
        # Replicas are read once: exactly this rank's heads of every remote block, every layer.
        assert moved == NUM_LAYERS * num_prefill_blocks * kv * prefill.block_size * len(heads) * HEAD_DIM * 2


@pytest.mark.parametrize("decode_layout", LAYOUTS)
@pytest.mark.parametrize("prefill_layout", LAYOUTS)
@pytest.mark.parametrize(("prefill_block", "decode_block"), BLOCK_SIZES, ids=lambda b: str(b))
@pytest.mark.parametrize("num_heads", [2, 4])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
def test_direct_reads_put_each_decode_ranks_heads_in_its_blocks_and_nothing_else(
    make_topology: TopologyFactory,
    generator: torch.Generator,
    prefill_tp: int,
    decode_tp: int,
    num_heads: int,
    prefill_block: int,
    decode_block: int,
    prefill_layout: str,
    decode_layout: str,
) -> None:
    check_direct_reads(make_topology, generator, (prefill_tp, decode_tp), num_heads, (prefill_block, decode_block),
                       (prefill_layout, decode_layout))  # fmt: skip


def check_direct_reads(
    make_topology: TopologyFactory,
    generator: torch.Generator,
    tp: tuple[int, int],
    num_heads: int,
    blocks: tuple[int, int],
    layouts: tuple[str, str],
) -> None:
    """Prefill and decode topologies of (prefill, decode) ``tp``, ``blocks`` and ``layouts``: reads move the
    reference's KV."""
    prefill, decode = (
        make_topology(tp_size=t, total_num_kv_heads=num_heads, block_size=b, layout=layout)
        for t, b, layout in zip(tp, blocks, layouts, strict=True)
    )
    assert_direct_reads_move_the_reference(prefill, decode, generator)


MLA_TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 1)]


@pytest.mark.parametrize(("prefill_block", "decode_block"), RATIOS, ids=lambda b: str(b))
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), MLA_TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in MLA_TP_PAIRS])
def test_mla_reads_take_one_replica_of_the_latents(
    make_topology: TopologyFactory,
    generator: torch.Generator,
    prefill_tp: int,
    decode_tp: int,
    prefill_block: int,
    decode_block: int,
) -> None:
    # Every rank holds the whole latent cache: each decode rank reads it from one prefill rank.
    mla = {"layout": "MLA", "total_num_kv_heads": 1}
    prefill = make_topology(tp_size=prefill_tp, block_size=prefill_block, **mla)
    decode = make_topology(tp_size=decode_tp, block_size=decode_block, **mla)
    assert all(len(source_ranks(decode.with_rank(rank), prefill_tp)) == 1 for rank in range(decode_tp))
    assert_direct_reads_move_the_reference(prefill, decode, generator)


# ---------------------------------------------------------------- runs per layout


@pytest.mark.parametrize(
    ("local", "remote", "num_runs"),
    [
        # vLLM's CPU cache: a head slice of a block is one run, K and V together
        ({"layout": "H2ND", "tp_size": 2}, {"layout": "H2ND"}, 1),
        ({"layout": "H2ND"}, {"layout": "H2ND", "tp_size": 2, "tp_rank": 1}, 1),
        # ... and per head and K/V when a local block takes several remote blocks
        ({"layout": "H2ND", "tp_size": 2, "block_size": 32}, {"layout": "H2ND"}, 2 * 2),
        # vLLM 0.32 on GPU, LBHNC: a head slice is one run, K and V with it; per head across sub-blocks
        ({"layout": "HN2D"}, {"layout": "HN2D"}, 1),  # whole blocks
        ({"layout": "HN2D", "tp_size": 2}, {"layout": "HN2D"}, 1),
        ({"layout": "HN2D", "block_size": 32}, {"layout": "HN2D"}, 4),
        # ... LBNHC: whole blocks with all the heads at any ratio, per token with a partial head slice
        ({"layout": "NH2D"}, {"layout": "NH2D"}, 1),
        ({"layout": "NH2D", "block_size": 32}, {"layout": "NH2D"}, 1),
        ({"layout": "NH2D", "tp_size": 2}, {"layout": "NH2D"}, 16),
        # head-major from token-major and back: per token and head, K and V of a head together
        ({"layout": "HN2D", "tp_size": 2}, {"layout": "NH2D"}, 16 * 2),
        ({"layout": "NH2D"}, {"layout": "HN2D"}, 16 * 4),
        ({"layout": "H2ND", "tp_size": 2}, {"layout": "NH2D"}, 16 * 2 * 2),  # ... and K/V apart in H2ND
        # K and V alternate row by row in HN2D and lie apart in H2ND: one run per row, but where a head's last
        # row meets the next head's first on both sides (3 times for 4 heads)
        ({"layout": "H2ND"}, {"layout": "HN2D"}, 2 * 4 * 16 - 3),
        # MLA: the latents of a block are one run, whatever the TP or the block size ratio
        ({"layout": "MLA", "total_num_kv_heads": 1, "tp_size": 2}, {"layout": "MLA", "total_num_kv_heads": 1}, 1),
        ({"layout": "MLA", "total_num_kv_heads": 1}, {"layout": "MLA", "total_num_kv_heads": 1, "tp_size": 4}, 1),
        ({"layout": "MLA", "total_num_kv_heads": 1, "block_size": 32}, {"layout": "MLA", "total_num_kv_heads": 1}, 1),
    ],
)
def test_runs_merge_whatever_is_contiguous_on_both_sides(
    make_topology: TopologyFactory, local: dict, remote: dict, num_runs: int
) -> None:
    local_topology, remote_topology = make_topology(**local), make_topology(**remote)
    ranges = plan_peer_ranges(local_topology, remote_topology)
    assert ranges.num_runs == num_runs
    [head_slice] = [
        s for s in plan_reads(local_topology, remote_topology).slices if s.remote_rank == remote_topology.tp_rank
    ]
    rows = head_slice.num_heads * remote_topology.kv_components * remote_topology.block_size
    assert ranges.bytes_per_block == rows * HEAD_DIM * 2


def test_h2nd_runs_of_a_sub_block_sit_in_each_heads_k_and_v_rows(make_topology: TopologyFactory) -> None:
    # Remote blocks of 16 into local blocks of 32; decode rank 1 of 2 reads heads 2 and 3 of 4.
    local = make_topology(layout="H2ND", tp_size=2, tp_rank=1, block_size=32)
    ranges = plan_plane_ranges(local, make_topology(layout="H2ND"), HeadSlice(0, 2, 0, 2))
    row = HEAD_DIM * 2  # bytes of one token of one head, K or V
    assert ranges.ratio == 2
    assert ranges.lengths == (16 * row,) * 4
    # remote block [head, K/V, 16 tokens]: heads 2 and 3
    assert ranges.remote_offsets == tuple((h * 2 + kv) * 16 * row for h in (2, 3) for kv in (0, 1))
    # local block [head, K/V, 32 tokens]: sub-block j starts 16 tokens in
    assert ranges.local_offsets == tuple(
        tuple((h * 2 + kv) * 32 * row + j * 16 * row for h in (0, 1) for kv in (0, 1)) for j in (0, 1)
    )


def test_a_local_rank_that_does_not_read_a_remote_rank_has_no_runs_from_it(make_topology: TopologyFactory) -> None:
    # Prefill TP 4 with 2 heads: ranks 1 and 3 are replicas that decode TP 1 skips.
    with pytest.raises(TopologyMismatch, match="local rank 0 reads nothing from remote rank 1"):
        plan_peer_ranges(make_topology(total_num_kv_heads=2), make_topology(total_num_kv_heads=2, tp_size=4, tp_rank=1))


# ---------------------------------------------------------------- descriptors and indices


def test_descriptor_rows_and_indices_line_up() -> None:
    ranges = PlaneRanges(
        ratio=2,
        remote_planes=(0, 1),
        remote_offsets=(8, 8),
        local_planes=(0, 1),
        local_offsets=((0, 0), (16, 16)),
        lengths=(4, 4),
    )
    regions = KVRegions(("a", "b"), (1000, 2000, 3000, 4000), 3, 32, "DRAM", 0)
    remote = remote_descriptors(ranges, regions)
    local = local_descriptors(ranges, regions)
    assert remote.shape == (2 * 3 * 2, 3) and local.shape == (2 * 3 * 2 * 2, 3)
    local_idx, remote_idx = read_indices(
        ranges, [2, 0], [1, 2, 0], num_layers=2, local_num_blocks=3, remote_num_blocks=3
    )
    pairs = list(zip(local[local_idx, 0].tolist(), remote[remote_idx, 0].tolist(), strict=True))
    # layer a: remote block 1 -> local block 2 sub 0, block 2 -> block 2 sub 1, block 0 -> block 0 sub 0
    assert pairs[:6] == [
        (1000 + 2 * 32, 1000 + 32 + 8),
        (2000 + 2 * 32, 2000 + 32 + 8),
        (1000 + 2 * 32 + 16, 1000 + 64 + 8),
        (2000 + 2 * 32 + 16, 2000 + 64 + 8),
        (1000, 1000 + 8),
        (2000, 2000 + 8),
    ]
    assert pairs[6] == (3000 + 2 * 32, 3000 + 32 + 8)  # layer b
    assert set(local[:, 1].tolist()) == {4} and local_idx.dtype == np.int32


def test_whole_plane_ranges_copy_blocks_one_to_one() -> None:
    ranges = whole_plane_ranges(2, 64)
    assert (ranges.ratio, ranges.lengths, ranges.local_offsets) == (1, (64, 64), ((0, 0),))


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "message"),
    [
        ([0], [1, 2, 0], "1 local block ids for 3 remote block ids (at block size ratio 2 they fill 2)"),
        ([0, 1, 2], [1, 2, 0], "3 local block ids for 3 remote block ids (at block size ratio 2 they fill 2)"),
        ([0, 3], [1, 2, 0], r"local block ids must lie in [0, 3), got 0..3"),
        ([0, 1], [1, -1, 0], r"remote block ids must lie in [0, 3), got -1..1"),
    ],
)
def test_read_indices_refuse_ids_that_do_not_pair(local_ids: list[int], remote_ids: list[int], message: str) -> None:
    ranges = whole_plane_ranges(2, 64)
    ranges = PlaneRanges(
        2, ranges.remote_planes, ranges.remote_offsets, ranges.local_planes, ((0, 0), (0, 0)), ranges.lengths
    )
    with pytest.raises(BlockMappingError) as info:
        read_indices(ranges, local_ids, remote_ids, num_layers=1, local_num_blocks=3, remote_num_blocks=3)
    assert str(info.value) == message


def test_source_ranks_need_no_remote_topology(make_topology: TopologyFactory) -> None:
    assert source_ranks(make_topology(tp_size=2, tp_rank=1), 1) == (0,)
    assert source_ranks(make_topology(), 2) == (0, 1)
    assert source_ranks(make_topology(total_num_kv_heads=2), 4) == (0, 2)
    with pytest.raises(TopologyMismatch, match="tp sizes do not divide one another: local 2, remote 3"):
        source_ranks(make_topology(tp_size=2, total_num_kv_heads=6), 3)
