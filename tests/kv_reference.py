"""A torch reference of where a sequence's KV lives in paged caches, written out apart from ``connectors``.

Tests build one sequence's whole KV (``[2, tokens, heads, head_dim]``, all
heads; ``[1, tokens, 1, latent]`` for MLA), store each TP rank's heads the way
vLLM does in the layout under test, move it with the code under test, and
compare with what these helpers say the reading rank's cache must hold.

A cache is allocated in memory order (``cache_shape``); ``vllm_view`` is the
tensor vLLM hands the connector for it, and the tokens are read from that as
vLLM's attention backends read them (``_token_view``). vLLM 0.32's layouts, one
layer's cache in memory order, and what vLLM hands:

- ``H2ND``: ``[num_blocks, heads, block_size, 2 * head_dim]``, vLLM's CPU cache: per
  block and head, the K rows of every token, then the V rows.
- ``HN2D``: ``[num_blocks, heads, block_size, 2 * head_dim]``: vLLM 0.32 on GPU (LBHNC), K and V the
  halves of the last dim
- ``NH2D``: ``[num_blocks, block_size, heads, 2 * head_dim]`` (LBNHC), handed as ``[num_blocks, heads, block_size,
  2 * head_dim]``
- ``MLA``:  ``[num_blocks, 1, block_size, latent]``: one latent per token, in one head slot
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rank_heads(tp_size: int, rank: int, total_heads: int) -> list[int]:
    """Global KV heads of ``rank``: a contiguous share, or one head copied on tp/heads ranks."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    return [rank // (tp_size // total_heads)]


def cache_shape(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cache in memory order."""
    shapes = {
        "H2ND": (num_blocks, heads, block_size, 2 * head_dim),
        "HN2D": (num_blocks, heads, block_size, 2 * head_dim),
        "NH2D": (num_blocks, block_size, heads, 2 * head_dim),
        "MLA": (num_blocks, 1, block_size, head_dim),
    }
    return shapes[layout]


def vllm_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor vLLM hands the connector for ``cache`` (allocated as ``cache_shape`` says): a view."""
    if layout == "NH2D":
        return cache.transpose(1, 2)  # [num_blocks, heads, block_size, 2 * head_dim] with LBNHC strides
    return cache


def _token_view(cache: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """``cache`` as ``[kv, num_blocks, block_size, heads, head_dim]``; a view: writes reach ``cache``."""
    handed = vllm_view(cache, layout)
    if layout == "H2ND":
        # vLLM's CPU backend: per (block, head), [2 * block_size, head_dim] rows, chunked in two: K's first
        num_blocks, heads, block_size, _ = handed.shape
        return handed.view(num_blocks, heads, 2, block_size, head_dim).permute(2, 0, 3, 1, 4)
    if layout == "MLA":
        return handed.transpose(1, 2).unsqueeze(0)  # one latent per token, "head" 0
    # vLLM 0.32's GPU backends: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return handed.transpose(1, 2).unflatten(-1, (2, head_dim)).permute(3, 0, 1, 2, 4)


def write_tokens(cache: torch.Tensor, layout: str, block_ids: Sequence[int], tokens: torch.Tensor) -> None:
    """Store ``tokens`` (``[kv, n, heads, head_dim]``) in ``block_ids``, in token order; later slots are left."""
    view = _token_view(cache, layout, tokens.shape[-1])
    block_size = view.shape[2]
    for i, block_id in enumerate(block_ids):
        chunk = tokens[:, i * block_size : (i + 1) * block_size]
        if chunk.shape[1] == 0:
            break
        view[:, block_id, : chunk.shape[1]] = chunk


def read_tokens(cache: torch.Tensor, layout: str, block_ids: Sequence[int], head_dim: int) -> torch.Tensor:
    """The tokens held in ``block_ids``, in order: ``[kv, len(block_ids) * block_size, heads, head_dim]``."""
    view = _token_view(cache, layout, head_dim)
    return view[:, list(block_ids)].flatten(1, 2).clone()


def noise_cache(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A cache full of stale noise, so that unwritten or misplaced bytes show."""
    return torch.randn(tuple(shape), generator=generator).to(dtype)


def padded(tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``tokens`` (``[kv, n, heads, head_dim]``) zero-padded (or cut) to ``num_tokens``."""
    out = tokens.new_zeros((tokens.shape[0], num_tokens, *tokens.shape[2:]))
    count = min(num_tokens, tokens.shape[1])
    out[:, :count] = tokens[:, :count]
    return out
