"""Torch side of a KV transfer: NHD <-> HND, and turning received remote blocks into local blocks.

Tensors here are one layer's KV blocks, K and V planes first as in vLLM's
per-layer cache: ``[2, num_blocks, block_size, num_heads, head_dim]`` (NHD) or
``[2, num_blocks, num_heads, block_size, head_dim]`` (HND). An H2ND cache
(vLLM's CPU cache, ``[num_blocks, num_heads, block_size, 2 * head_dim]``)
enters as its ``kv_planes`` view, HND, and ``join_kv_planes`` builds one.

For each ``HeadSlice`` of its ``ReadPlan`` a local rank reads that slice of
every remote block into a staging tensor
``[2, num_remote_blocks, *received_block_shape(remote, slice.num_heads)]``.
``assemble_local_blocks`` (vLLM's ``kv_postprocess_*`` in one step) views each
staging tensor token-major, concatenates the slices along heads, regroups the
tokens into local-sized blocks, zero-filling the tail of the last one, and lays
them out in the local layout. ``store_blocks`` writes them into the local cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.errors import BlockMappingError, TransferShapeError
from connectors.topology import KVLayout, ReadPlan, received_block_shape

__all__ = [
    "assemble_local_blocks",
    "blocks_to_tokens",
    "convert_layout",
    "gather_blocks",
    "join_kv_planes",
    "kv_planes",
    "split_layout",
    "store_blocks",
    "tokens_to_blocks",
]


def split_layout(layout: KVLayout | str) -> KVLayout:
    """The layout of ``layout``'s K and V planes taken apart: H2ND's are HND."""
    layout = KVLayout(layout)
    return KVLayout.HND if layout is KVLayout.H2ND else layout


def kv_planes(cache: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """A layer's cache as ``[2, num_blocks, *block]`` in ``split_layout(layout)``; a view, so writes reach ``cache``."""
    if KVLayout(layout) is not KVLayout.H2ND:
        return cache
    num_blocks, num_heads, block_size, two_dims = cache.shape
    return cache.view(num_blocks, num_heads, 2, block_size, two_dims // 2).permute(2, 0, 1, 3, 4)


def join_kv_planes(blocks: torch.Tensor) -> torch.Tensor:
    """HND ``[2, num_blocks, num_heads, block_size, head_dim]`` as an H2ND cache.

    The result is ``[num_blocks, num_heads, block_size, 2 * head_dim]``, contiguous, as vLLM's CPU backend keeps it.
    """
    _, num_blocks, num_heads, block_size, head_dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4).reshape(num_blocks, num_heads, block_size, 2 * head_dim)


def convert_layout(blocks: torch.Tensor, src: KVLayout | str, dst: KVLayout | str) -> torch.Tensor:
    """``blocks`` (``[..., N, H, D]`` or ``[..., H, N, D]``) re-laid out from ``src`` to ``dst``, contiguous.

    H2ND stands for its ``kv_planes`` form (HND).
    """
    if split_layout(src) is split_layout(dst):
        return blocks.contiguous()
    # The two layouts differ only in the order of the token and head dims.
    return blocks.transpose(-3, -2).contiguous()


def blocks_to_tokens(blocks: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """``[2, num_blocks, *block]`` in ``layout`` -> ``[2, num_blocks * block_size, num_heads, head_dim]``."""
    nhd = convert_layout(blocks, layout, KVLayout.NHD)
    return nhd.flatten(1, 2)


def tokens_to_blocks(tokens: torch.Tensor, block_size: int, layout: KVLayout | str) -> torch.Tensor:
    """``[2, num_tokens, num_heads, head_dim]`` -> ``[2, ceil(num_tokens / block_size), *block]`` in ``layout``.

    The last block's tokens past ``num_tokens`` are zeros: a decode that grows
    into them must not meet stale bytes (NaNs) from an earlier request.
    """
    kv, num_tokens, num_heads, head_dim = tokens.shape
    num_blocks = -(-num_tokens // block_size)
    padded = tokens.new_zeros((kv, num_blocks * block_size, num_heads, head_dim))
    padded[:, :num_tokens] = tokens
    return convert_layout(padded.view(kv, num_blocks, block_size, num_heads, head_dim), KVLayout.NHD, layout)


def assemble_local_blocks(received: Sequence[torch.Tensor], plan: ReadPlan) -> torch.Tensor:
    """Local-layout blocks ``[2, num_local_blocks, *local block]`` built from one staging tensor per slice.

    ``received[i]`` holds ``plan.slices[i]`` of the same remote blocks, in
    request order; local block j gets remote blocks [j*ratio, (j+1)*ratio).
    """
    if len(received) != len(plan.slices):
        raise TransferShapeError(f"read plan has {len(plan.slices)} head slices, got {len(received)} received buffers")
    num_remote_blocks = received[0].shape[1] if received else 0
    for buffer, head_slice in zip(received, plan.slices, strict=True):
        expected = (2, num_remote_blocks, *received_block_shape(plan.remote, head_slice.num_heads))
        if tuple(buffer.shape) != expected:
            raise TransferShapeError(
                f"buffer from remote rank {head_slice.remote_rank} has shape {tuple(buffer.shape)}, expected {expected}"
            )
    # Slices are ordered by local head and contiguous, so concatenation is the local head order.
    tokens = torch.cat([blocks_to_tokens(buffer, plan.remote.layout) for buffer in received], dim=2)
    return tokens_to_blocks(tokens, plan.local.block_size, plan.local.layout)


def store_blocks(cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """Write ``blocks`` (``[2, len(block_ids), *block]``) into ``cache`` at ``block_ids``."""
    if blocks.shape[1] != len(block_ids) or blocks.shape[2:] != cache.shape[2:]:
        raise BlockMappingError(
            f"{blocks.shape[1]} blocks of shape {tuple(blocks.shape[2:])} do not fit {len(block_ids)} block ids "
            f"of a cache with blocks of shape {tuple(cache.shape[2:])}"
        )
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    cache.index_copy_(1, index, blocks.to(device=cache.device, dtype=cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """``cache``'s blocks at ``block_ids``, in that order: ``[2, len(block_ids), *block]``."""
    return cache.index_select(1, torch.tensor(block_ids, dtype=torch.long, device=cache.device))
