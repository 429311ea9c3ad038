"""KV topology arithmetic: read plans, reader ranks, derived sizes, compatibility and its reasons.

(Moving a sequence's KV between TP ranks, checked against a torch reference, is in
``test_block_ranges.py`` and ``test_transport.py``.)
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from connectors.errors import InvalidTopology, TopologyError, TopologyMismatch
from connectors.topology import (
    HeadSlice,
    KVLayout,
    KVTopology,
    block_size_ratio,
    check_compatible,
    compatibility_hash,
    incompatibilities,
    plan_reads,
    reader_ranks,
)
from tests.kv_reference import cache_shape
from tests.unit.kv_factories import topology_factory

HEAD_DIM = 4

TopologyFactory = Callable[..., KVTopology]


@pytest.fixture
def make_topology() -> TopologyFactory:
    """A valid topology; keyword arguments override single fields."""
    return topology_factory(head_dim=HEAD_DIM)


# ---------------------------------------------------------------- read plans


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
    topology = make_topology(tp_size=8, tp_rank=5, total_num_kv_heads=2, dtype="torch.float32", layout="NH2D")
    assert (topology.num_heads, topology.head_start()) == (1, 1)  # ranks 4-7 each hold a copy of head 1
    assert (topology.dtype, topology.element_size, topology.layout) == ("float32", 4, "NH2D")
    assert topology.block_plane_bytes == 2 * 16 * 1 * HEAD_DIM * 4  # K and V of 16 tokens of one head


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("tp_size", "num_heads"), [(1, 4), (2, 4), (4, 2), (2, 1)])
def test_block_planes_cut_the_reference_cache_into_blocks(
    make_topology: TopologyFactory, layout: KVLayout, tp_size: int, num_heads: int
) -> None:
    if layout is KVLayout.MLA:
        num_heads = 1  # one latent per token, on every rank
    topology = make_topology(layout=layout, tp_size=tp_size, total_num_kv_heads=num_heads, dtype="float16")
    shape = cache_shape(layout, 10, topology.block_size, topology.num_heads, HEAD_DIM)
    assert topology.planes_per_layer == 1
    assert 10 * topology.block_plane_bytes == math.prod(shape) * 2
    assert topology.kv_components == (1 if layout is KVLayout.MLA else 2)


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
        ({"layout": "HDN"}, "unknown layout 'HDN'; expected one of H2ND, HN2D, NH2D, MLA"),
        (
            {"layout": "MLA", "total_num_kv_heads": 128},
            "an MLA cache holds one latent per token: total_num_kv_heads must be 1, got 128",
        ),
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
    local = make_topology(tp_size=4, tp_rank=3, block_size=64, layout="NH2D")
    assert incompatibilities(local, make_topology(tp_size=2, block_size=16)) == []
    for layout in ("HN2D", "NH2D", "H2ND"):
        assert incompatibilities(local, make_topology(tp_size=2, block_size=16, layout=layout)) == []


def test_mla_pairs_only_with_mla(make_topology: TopologyFactory) -> None:
    mla = make_topology(layout="MLA", total_num_kv_heads=1, tp_size=4, tp_rank=3)
    one_head = make_topology(layout="HN2D", total_num_kv_heads=1)
    reason = "MLA KV (one latent per token) pairs only with MLA KV: local layout MLA, remote layout HN2D"
    assert incompatibilities(mla, one_head) == [reason]
    assert compatibility_hash(mla) != compatibility_hash(one_head)
    # vLLM replicates the latents on every rank: one source per reader, whatever the TP sizes.
    prefill = make_topology(layout="MLA", total_num_kv_heads=1, tp_size=2, block_size=8)
    assert compatibility_hash(mla) == compatibility_hash(prefill)
    assert plan_reads(mla, prefill).slices == (HeadSlice(1, 0, 0, 1),)
    assert mla.block_plane_bytes == 16 * HEAD_DIM * 2


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
        b'{"dtype":"bfloat16","head_dim":4,"kv_components":2,'
        b'"layouts":["H2ND","HN2D","MLA","NH2D"],"model_identity":"","num_layers":2,'
        b'"schema":5,"total_num_kv_heads":4}'
    )
    assert base == hashlib.sha256(encoded).hexdigest()
    same = [
        make_topology(tp_size=4, tp_rank=2, block_size=64, layout="H2ND"),
        make_topology(layout="NH2D"),
        make_topology(dtype="torch.bfloat16"),
    ]
    assert {compatibility_hash(topology) for topology in same} == {base}


@pytest.mark.parametrize(
    "overrides", [{"dtype": "float16"}, {"head_dim": 8}, {"num_layers": 3}, {"total_num_kv_heads": 8}]
)
def test_compatibility_hash_covers_what_must_match(make_topology: TopologyFactory, overrides: dict[str, Any]) -> None:
    assert compatibility_hash(make_topology(**overrides)) != compatibility_hash(make_topology())
