"""Layout transforms and the receive post-process on small hand-checkable tensors.

The full prefill -> decode round trip over TP, block sizes and layouts lives in
``test_topology.py``; this file pins the single steps and their error messages.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from connectors.errors import BlockMappingError, TransferShapeError
from connectors.layout import (
    assemble_local_blocks,
    blocks_to_tokens,
    convert_layout,
    gather_blocks,
    join_kv_planes,
    kv_planes,
    store_blocks,
    tokens_to_blocks,
)
from connectors.topology import KVLayout, KVTopology, plan_reads
from tests.unit.kv_factories import topology_factory


@pytest.fixture
def make_topology() -> Callable[..., KVTopology]:
    return topology_factory(total_num_kv_heads=2, block_size=2, head_dim=1, dtype="float32", num_layers=1)


@pytest.fixture
def tokens() -> torch.Tensor:
    """[2, 3 tokens, 2 heads, 1]: value = 100*kv + 10*token + head."""
    kv, token, head = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(2), indexing="ij")
    return (100 * kv + 10 * token + head).float().unsqueeze(-1)


def test_convert_layout_swaps_tokens_and_heads_and_round_trips() -> None:
    nhd = torch.arange(2 * 3 * 4 * 5 * 6).reshape(2, 3, 4, 5, 6)
    hnd = convert_layout(nhd, "NHD", KVLayout.HND)
    assert hnd.shape == (2, 3, 5, 4, 6) and hnd.is_contiguous()
    assert torch.equal(hnd[1, 2, 3, 1], nhd[1, 2, 1, 3])
    assert torch.equal(convert_layout(hnd, "HND", "NHD"), nhd)
    assert torch.equal(convert_layout(nhd, "NHD", "NHD"), nhd)


def test_tokens_to_blocks_zero_fills_the_last_block(tokens: torch.Tensor) -> None:
    blocks = tokens_to_blocks(tokens, 2, "HND")
    assert blocks.shape == (2, 2, 2, 2, 1)  # [kv, block, head, token, dim]
    assert blocks[1, 1, :, 0, 0].tolist() == [120.0, 121.0]  # V, token 2, heads 0 and 1
    assert blocks[:, 1, :, 1].abs().sum() == 0
    assert torch.equal(blocks_to_tokens(blocks, "HND")[:, :3], tokens)


def test_assemble_joins_remote_ranks_heads_and_blocks(
    make_topology: Callable[..., KVTopology], tokens: torch.Tensor
) -> None:
    # Two prefill ranks (one head each, blocks of 1 token, HND) -> one decode rank (blocks of 2, NHD).
    remote = make_topology(tp_size=2, block_size=1, layout="HND")
    plan = plan_reads(make_topology(), remote)
    received = [tokens[:, :, [head]].reshape(2, 3, 1, 1, 1) for head in (0, 1)]
    blocks = assemble_local_blocks(received, plan)
    assert blocks.shape == (2, 2, 2, 2, 1)
    assert torch.equal(blocks.flatten(1, 2)[:, :3], tokens)


def test_assemble_rejects_buffers_that_do_not_match_the_plan(make_topology: Callable[..., KVTopology]) -> None:
    plan = plan_reads(make_topology(), make_topology(tp_size=2, block_size=1, layout="HND"))
    with pytest.raises(TransferShapeError) as info:
        assemble_local_blocks([torch.zeros(2, 3, 1, 1, 1)], plan)
    assert str(info.value) == "read plan has 2 head slices, got 1 received buffers"
    with pytest.raises(TransferShapeError) as info:
        assemble_local_blocks([torch.zeros(2, 3, 1, 1, 1), torch.zeros(2, 3, 1, 2, 1)], plan)
    assert str(info.value) == "buffer from remote rank 1 has shape (2, 3, 1, 2, 1), expected (2, 3, 1, 1, 1)"


def test_store_and_gather_blocks_by_id() -> None:
    cache = torch.zeros(2, 4, 2, 1, 1)
    blocks = torch.arange(8.0).reshape(2, 2, 2, 1, 1)
    store_blocks(cache, [3, 0], blocks)
    assert torch.equal(gather_blocks(cache, [3, 0]), blocks)
    assert cache[:, [1, 2]].abs().sum() == 0
    with pytest.raises(BlockMappingError) as info:
        store_blocks(cache, [1], blocks)
    assert str(info.value) == (
        "2 blocks of shape (2, 1, 1) do not fit 1 block ids of a cache with blocks of shape (2, 1, 1)"
    )


def test_kv_planes_of_a_cpu_cache_are_the_k_and_v_halves_vllm_reads() -> None:
    # vLLM's CPU backend views [blocks, heads, block_size, 2 * head_dim] as [blocks, heads, 2 * block_size, head_dim]
    # and takes the first block_size rows as K, the rest as V.
    cache = torch.arange(3 * 2 * 4 * 10.0).reshape(3, 2, 4, 10)
    key, value = cache.view(3, 2, 8, 5).chunk(2, dim=2)
    planes = kv_planes(cache, "H2ND")
    assert planes.shape == (2, 3, 2, 4, 5)  # HND planes
    assert torch.equal(planes[0], key) and torch.equal(planes[1], value)
    assert torch.equal(join_kv_planes(planes), cache)
    planes[1, 2, 1, 3] = -1.0
    assert (cache.view(3, 2, 8, 5)[2, 1, 4 + 3] == -1.0).all(), "the planes are a view of the cache"
    assert torch.equal(blocks_to_tokens(planes, "H2ND"), blocks_to_tokens(planes, "HND"))
