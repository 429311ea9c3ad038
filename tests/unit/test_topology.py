"""KV topology arithmetic against a torch reference.

The end-to-end tests build one sequence's whole KV (all heads, all tokens),
store it the way every prefill TP rank would (its heads, in blocks of the
prefill block size and layout, at scattered block ids), move it with our plan
(``block_read_ranges`` over the raw bytes stands in for the NIXL read), run
``assemble_local_blocks`` and check that every decode rank's cache holds
exactly its heads of the sequence. Head placement and blocking in the
reference are written out here, independently of the code under test.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from connectors.errors import BlockMappingError, InvalidTopology, TopologyError, TopologyMismatch
from connectors.layout import assemble_local_blocks, store_blocks
from connectors.topology import (
    HeadSlice,
    KVTopology,
    LocalBlockFill,
    block_read_ranges,
    block_size_ratio,
    check_compatible,
    compatibility_hash,
    expand_to_remote_granularity,
    incompatibilities,
    map_local_to_remote,
    plan_local_fills,
    plan_reads,
    reader_ranks,
    received_block_shape,
)
from tests.unit.kv_factories import topology_factory

HEAD_DIM = 4
DTYPE = torch.bfloat16
NUM_TOKENS = 64 + 37  # a partly filled last block for every block size below
SPARE_BLOCKS = 3  # cache blocks no request uses, so wrong block ids show

TopologyFactory = Callable[..., KVTopology]


@pytest.fixture
def make_topology() -> TopologyFactory:
    """A valid topology; keyword arguments override single fields."""
    return topology_factory(head_dim=HEAD_DIM)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """These tensors are tiny: extra intra-op threads only spin against a busy machine's other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------- torch reference


def reference_heads(tp_size: int, rank: int, total_heads: int) -> list[int]:
    """Global KV heads of ``rank``: a contiguous share, or one head copied on tp/heads ranks."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (tp_size // total_heads)]


def reference_blocks(tokens: torch.Tensor, block_size: int, layout: str) -> torch.Tensor:
    """[2, T, H, D] -> [2, nblocks, N, H, D] (NHD) or [2, nblocks, H, N, D] (HND), tail zeros."""
    kv, num_tokens, heads, dim = tokens.shape
    num_blocks = (num_tokens + block_size - 1) // block_size
    padded = torch.zeros(kv, num_blocks * block_size, heads, dim, dtype=tokens.dtype)
    padded[:, :num_tokens] = tokens
    blocks = padded.reshape(kv, num_blocks, block_size, heads, dim)
    return blocks if layout == "NHD" else blocks.permute(0, 1, 3, 2, 4)


def reference_tokens(blocks: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of ``reference_blocks``, keeping the padded tail."""
    nhd = blocks if layout == "NHD" else blocks.permute(0, 1, 3, 2, 4)
    kv, num_blocks, block_size, heads, dim = nhd.shape
    return nhd.reshape(kv, num_blocks * block_size, heads, dim)


def block_shape(block_size: int, num_heads: int, layout: str) -> tuple[int, int, int]:
    return (block_size, num_heads, HEAD_DIM) if layout == "NHD" else (num_heads, block_size, HEAD_DIM)


def noise_cache(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A per-layer cache full of stale noise, so unwritten or misplaced blocks show."""
    return torch.randn(shape, generator=generator).to(DTYPE)


def block_ids_in(num_used: int, generator: torch.Generator) -> list[int]:
    """``num_used`` shuffled ids out of ``num_used + SPARE_BLOCKS`` cache blocks."""
    return torch.randperm(num_used + SPARE_BLOCKS, generator=generator)[:num_used].tolist()


def nixl_read(cache: torch.Tensor, remote: KVTopology, block_ids: list[int], head_slice: HeadSlice) -> torch.Tensor:
    """Stand-in for the transport: copy our byte ranges of each K/V block plane into a staging buffer."""
    raw = cache.contiguous().view(-1).view(torch.uint8)
    ranges = block_read_ranges(remote, head_slice.remote_head_start, head_slice.num_heads)
    (length,) = {length for _, length in ranges}
    planes = torch.arange(2)[:, None] * cache.shape[1] + torch.tensor(block_ids)[None, :]  # [kv, block]
    starts = planes[:, :, None] * remote.block_plane_bytes + torch.tensor([offset for offset, _ in ranges])
    staged = raw[(starts[..., None] + torch.arange(length)).flatten()].view(cache.dtype)
    return staged.view(2, len(block_ids), *received_block_shape(remote, head_slice.num_heads))


# ---------------------------------------------------------------- end to end

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
BLOCK_SIZES = [(16, 16), (16, 64), (32, 64)]
LAYOUTS = ["NHD", "HND"]


@pytest.mark.parametrize("prefill_layout", LAYOUTS)
@pytest.mark.parametrize("decode_layout", LAYOUTS)
@pytest.mark.parametrize(("prefill_block", "decode_block"), BLOCK_SIZES, ids=lambda b: str(b))
@pytest.mark.parametrize("num_heads", [2, 4, 8])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
def test_decode_ranks_receive_their_heads(
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
    prefill = make_topology(
        tp_size=prefill_tp, total_num_kv_heads=num_heads, block_size=prefill_block, layout=prefill_layout
    )
    decode = make_topology(
        tp_size=decode_tp, total_num_kv_heads=num_heads, block_size=decode_block, layout=decode_layout
    )
    whole = torch.randn(2, NUM_TOKENS, num_heads, HEAD_DIM, generator=generator).to(DTYPE)

    # Prefill: every rank stores its heads; vLLM's scheduler gives all ranks the same block ids.
    num_prefill_blocks = -(-NUM_TOKENS // prefill_block)
    prefill_ids = block_ids_in(num_prefill_blocks, generator)
    prefill_caches = []
    for rank in range(prefill_tp):
        heads = reference_heads(prefill_tp, rank, num_heads)
        cache = noise_cache(
            (2, num_prefill_blocks + SPARE_BLOCKS, *block_shape(prefill_block, len(heads), prefill_layout)), generator
        )
        cache[:, prefill_ids] = reference_blocks(whole[:, :, heads], prefill_block, prefill_layout)
        prefill_caches.append(cache)

    fills = plan_local_fills(prefill_ids, NUM_TOKENS, decode_block, prefill_block)
    assert sum(fill.num_tokens for fill in fills) == NUM_TOKENS
    for rank in range(decode_tp):
        local = decode.with_rank(rank)
        plan = plan_reads(local, prefill)
        heads = reference_heads(decode_tp, rank, num_heads)
        decode_ids = block_ids_in(len(fills), generator)
        decode_cache = noise_cache(
            (2, len(fills) + SPARE_BLOCKS, *block_shape(decode_block, len(heads), decode_layout)), generator
        )
        pairs = map_local_to_remote(decode_ids, prefill_ids, plan.block_size_ratio)
        read_order = [remote_id for _, remote_ids in pairs for remote_id in remote_ids]
        received = [
            nixl_read(prefill_caches[head_slice.remote_rank], prefill, read_order, head_slice)
            for head_slice in plan.slices
        ]
        store_blocks(decode_cache, decode_ids, assemble_local_blocks(received, plan))

        seen = reference_tokens(decode_cache[:, decode_ids], decode_layout)
        assert torch.equal(seen[:, :NUM_TOKENS], whole[:, :, heads])
        assert not seen[:, NUM_TOKENS:].any(), "tail of the last local block must be zeroed"
        # Replicas are read once: one slice per distinct source of this rank's heads.
        assert sum(s.num_heads for s in plan.slices) == len(heads)


# ---------------------------------------------------------------- TP mapping


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "num_heads", "decode_rank", "expected"),
    [
        (1, 2, 4, 1, [HeadSlice(0, 2, 0, 2)]),  # two decode ranks split one prefill rank
        (2, 1, 4, 0, [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]),  # one decode rank joins two
        (4, 1, 2, 0, [HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)]),  # replicas 1 and 3 skipped
        (4, 2, 2, 1, [HeadSlice(2, 0, 0, 1)]),
        (2, 4, 2, 3, [HeadSlice(1, 0, 0, 1)]),  # decode replicates, reads the one prefill copy
        (4, 4, 2, 1, [HeadSlice(1, 0, 0, 1)]),  # both replicate: each reads its own peer's copy
        (4, 8, 2, 2, [HeadSlice(1, 0, 0, 1)]),  # readers spread over the prefill replicas
        (1, 4, 8, 3, [HeadSlice(0, 6, 0, 2)]),
    ],
)
def test_plan_reads_names_sources_and_head_slices(
    make_topology: TopologyFactory,
    prefill_tp: int,
    decode_tp: int,
    num_heads: int,
    decode_rank: int,
    expected: list[HeadSlice],
) -> None:
    prefill = make_topology(tp_size=prefill_tp, total_num_kv_heads=num_heads)
    decode = make_topology(tp_size=decode_tp, tp_rank=decode_rank, total_num_kv_heads=num_heads)
    assert list(plan_reads(decode, prefill).slices) == expected


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "num_heads", "readers"),
    [
        (1, 4, 8, {0: (0, 1, 2, 3)}),
        (4, 1, 2, {0: (0,), 1: (), 2: (0,), 3: ()}),
        (4, 8, 2, {0: (0, 1), 1: (2, 3), 2: (4, 5), 3: (6, 7)}),
        (2, 2, 4, {0: (0,), 1: (1,)}),
    ],
)
def test_reader_ranks_counts_who_reads_each_source(
    make_topology: TopologyFactory, prefill_tp: int, decode_tp: int, num_heads: int, readers: dict[int, tuple]
) -> None:
    prefill = make_topology(tp_size=prefill_tp, total_num_kv_heads=num_heads)
    decode = make_topology(tp_size=decode_tp, total_num_kv_heads=num_heads)
    assert {rank: reader_ranks(rank, decode, prefill) for rank in range(prefill_tp)} == readers


def test_topology_derived_sizes(make_topology: TopologyFactory) -> None:
    topology = make_topology(tp_size=8, tp_rank=5, total_num_kv_heads=2, dtype="torch.float32", layout="HND")
    assert (topology.num_heads, topology.head_start(), topology.is_replicated) == (1, 1, True)
    assert (topology.dtype, topology.element_size, topology.layout) == ("float32", 4, "HND")
    assert topology.block_plane_bytes == 16 * 1 * HEAD_DIM * 4


# ---------------------------------------------------------------- byte ranges and shapes


@pytest.mark.parametrize(
    ("layout", "head_start", "num_heads", "expected"),
    [
        ("HND", 1, 2, [(1 * 16 * 4 * 2, 2 * 16 * 4 * 2)]),  # a head slice is one run
        ("NHD", 0, 4, [(0, 16 * 4 * 4 * 2)]),  # the whole block is one run
        ("NHD", 2, 1, [(t * 4 * 4 * 2 + 2 * 4 * 2, 4 * 2) for t in range(16)]),  # one run per token
    ],
)
def test_block_read_ranges(
    make_topology: TopologyFactory, layout: str, head_start: int, num_heads: int, expected: list[tuple[int, int]]
) -> None:
    remote = make_topology(layout=layout)
    assert block_read_ranges(remote, head_start, num_heads) == expected
    assert sum(length for _, length in expected) == num_heads * 16 * HEAD_DIM * 2


def test_block_read_ranges_rejects_heads_the_rank_lacks(make_topology: TopologyFactory) -> None:
    with pytest.raises(InvalidTopology, match=r"heads \[3, 5\) are not within the remote rank's 4 heads"):
        block_read_ranges(make_topology(), 3, 2)


@pytest.mark.parametrize(("layout", "shape"), [("NHD", (16, 3, HEAD_DIM)), ("HND", (3, 16, HEAD_DIM))])
def test_received_block_shape(make_topology: TopologyFactory, layout: str, shape: tuple[int, ...]) -> None:
    assert received_block_shape(make_topology(layout=layout), 3) == shape


# ---------------------------------------------------------------- block mapping


def test_plan_local_fills_groups_remote_blocks_in_token_order() -> None:
    fills = plan_local_fills([7, 3, 9, 1, 5], 70, local_block_size=64, remote_block_size=16)
    assert fills == [LocalBlockFill((7, 3, 9, 1), 64), LocalBlockFill((5,), 6)]


def test_map_local_to_remote_pairs_each_local_block_with_its_sources() -> None:
    assert map_local_to_remote([10, 4], [7, 3, 9, 1, 5], 4) == [(10, (7, 3, 9, 1)), (4, (5,))]
    assert map_local_to_remote([2, 8], [6, 0], 1) == [(2, (6,)), (8, (0,))]


def test_expand_to_remote_granularity_clips_the_unfilled_tail() -> None:
    assert expand_to_remote_granularity([0, 2], 2, 3) == [0, 1, 4]
    assert expand_to_remote_granularity([5], 4, 4) == [20, 21, 22, 23]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: plan_local_fills([1, 2], 70, 64, 16),
            "70 tokens take 5 remote blocks of 16, got 2",
        ),
        (
            lambda: map_local_to_remote([1], [7, 3, 9, 1, 5], 4),
            "5 remote blocks at ratio 4 fill 2 local blocks, got 1 local block ids",
        ),
        (lambda: map_local_to_remote([1], [2], 0), "block size ratio must be >= 1, got 0"),
        (
            lambda: expand_to_remote_granularity([0, 1], 4, 3),
            "2 local blocks at ratio 4 cannot hold exactly 3 remote blocks",
        ),
        (
            lambda: expand_to_remote_granularity([0], 2, 3),
            "1 local blocks at ratio 2 cannot hold exactly 3 remote blocks",
        ),
    ],
)
def test_block_mapping_errors(call: Callable[[], object], message: str) -> None:
    with pytest.raises(BlockMappingError) as info:
        call()
    assert str(info.value) == message


# ---------------------------------------------------------------- invalid and mismatched topologies


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank 2 is outside [0, tp_size 2)"),
        ({"tp_rank": -1}, "tp_rank -1 is outside [0, tp_size 1)"),
        ({"tp_size": 4, "total_num_kv_heads": 6}, "total_num_kv_heads 6 is not divisible by tp_size 4"),
        (
            {"tp_size": 6, "total_num_kv_heads": 4},
            "tp_size 6 is not a multiple of total_num_kv_heads 4, so heads cannot be replicated evenly",
        ),
        ({"block_size": 0, "head_dim": -1}, "block_size must be >= 1, got 0; head_dim must be >= 1, got -1"),
        ({"layout": "HDN"}, "unknown layout 'HDN'; expected one of NHD, HND, H2ND"),
    ],
)
def test_invalid_topology(make_topology: TopologyFactory, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidTopology) as info:
        make_topology(**overrides)
    assert str(info.value) == message


def test_unknown_dtype_is_invalid(make_topology: TopologyFactory) -> None:
    with pytest.raises(InvalidTopology, match=r"^unknown KV cache dtype 'torch\.complex64'; known: float64, "):
        make_topology(dtype="torch.complex64")


@pytest.mark.parametrize(
    ("local", "remote", "reason"),
    [
        ({"dtype": "float16"}, {}, "dtype differs: local float16, remote bfloat16"),
        ({"head_dim": 8}, {}, "head_dim differs: local 8, remote 4"),
        ({"num_layers": 3}, {}, "num_layers differs: local 3, remote 2"),
        ({"total_num_kv_heads": 8}, {}, "total_num_kv_heads differs: local 8, remote 4"),
        (
            {"tp_size": 3, "total_num_kv_heads": 6},
            {"tp_size": 2, "total_num_kv_heads": 6},
            "tp sizes do not divide one another: local 3, remote 2",
        ),
        (
            {"block_size": 16},
            {"block_size": 64},
            "remote block size 64 is larger than local block size 16 "
            "(only a remote block size that divides the local one is supported)",
        ),
        ({"block_size": 48}, {"block_size": 32}, "local block size 48 is not a multiple of remote block size 32"),
    ],
)
def test_mismatched_topologies(
    make_topology: TopologyFactory, local: dict[str, Any], remote: dict[str, Any], reason: str
) -> None:
    local_topology, remote_topology = make_topology(**local), make_topology(**remote)
    assert incompatibilities(local_topology, remote_topology) == [reason]
    for refuse in (check_compatible, plan_reads):
        with pytest.raises(TopologyMismatch) as info:
            refuse(local_topology, remote_topology)
        assert info.value.reasons == (reason,)
        assert str(info.value) == f"cannot exchange KV between these topologies: {reason}"


def test_mismatch_lists_every_reason_and_survives_pickling(make_topology: TopologyFactory) -> None:
    local, remote = make_topology(dtype="float16", block_size=16), make_topology(num_layers=3, block_size=32)
    with pytest.raises(TopologyMismatch) as info:
        check_compatible(local, remote)
    assert info.value.reasons == (
        "dtype differs: local float16, remote bfloat16",
        "num_layers differs: local 2, remote 3",
        "remote block size 32 is larger than local block size 16 "
        "(only a remote block size that divides the local one is supported)",
    )
    restored = pickle.loads(pickle.dumps(info.value))
    assert (restored.reasons, str(restored)) == (info.value.reasons, str(info.value))
    assert isinstance(restored, TopologyError) and isinstance(restored, ValueError)


def test_block_size_ratio() -> None:
    assert block_size_ratio(64, 16) == 4
    with pytest.raises(TopologyMismatch, match="local block size 24 is not a multiple of remote block size 16"):
        block_size_ratio(24, 16)


def test_layouts_and_sizes_that_differ_are_compatible(make_topology: TopologyFactory) -> None:
    local = make_topology(tp_size=4, tp_rank=3, block_size=64, layout="HND")
    assert incompatibilities(local, make_topology(tp_size=2, block_size=16)) == []


# ---------------------------------------------------------------- compatibility hash


def test_another_model_of_the_same_shape_is_incompatible(make_topology: TopologyFactory) -> None:
    base, tuned = make_topology(model_identity="a" * 64), make_topology(model_identity="b" * 64)
    assert compatibility_hash(base) != compatibility_hash(tuned)
    (reason,) = incompatibilities(base, tuned)
    assert reason.startswith("model identity differs (another checkpoint, or another configuration)")


def test_compatibility_hash_ignores_what_may_differ(make_topology: TopologyFactory) -> None:
    base = compatibility_hash(make_topology())
    # Stable across processes and Python versions: a digest of canonical JSON, not hash().
    encoded = (
        b'{"dtype":"bfloat16","head_dim":4,"layouts":["H2ND","HND","NHD"],"model_identity":"","num_layers":2,'
        b'"schema":3,"total_num_kv_heads":4}'
    )
    assert base == hashlib.sha256(encoded).hexdigest()
    same = [
        make_topology(tp_size=4, tp_rank=2, block_size=64, layout="HND"),
        make_topology(dtype="torch.bfloat16"),
    ]
    assert {compatibility_hash(topology) for topology in same} == {base}


@pytest.mark.parametrize(
    "overrides", [{"dtype": "float16"}, {"head_dim": 8}, {"num_layers": 3}, {"total_num_kv_heads": 8}]
)
def test_compatibility_hash_covers_what_must_match(make_topology: TopologyFactory, overrides: dict[str, Any]) -> None:
    assert compatibility_hash(make_topology(**overrides)) != compatibility_hash(make_topology())
