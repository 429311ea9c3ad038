"""A torch reference of where a sequence's KV lives in paged caches, written out apart from ``connectors``.

Tests build one sequence's whole KV (``[2, tokens, heads, head_dim]``, all
heads), store each TP rank's heads the way vLLM does in the layout under
test, move it with the code under test, and compare with what these helpers
say the reading rank's cache must hold. Layouts (one layer's cache):

- ``NHD``:  ``[2, num_blocks, block_size, heads, head_dim]``
- ``HND``:  ``[2, num_blocks, heads, block_size, head_dim]``
- ``H2ND``: ``[num_blocks, heads, block_size, 2 * head_dim]``, vLLM's CPU cache: per
  block and head, the K rows of every token, then the V rows.
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
    if layout == "NHD":
        return (2, num_blocks, block_size, heads, head_dim)
    if layout == "HND":
        return (2, num_blocks, heads, block_size, head_dim)
    return (num_blocks, heads, block_size, 2 * head_dim)


def _token_view(cache: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """``cache`` as ``[2, num_blocks, block_size, heads, head_dim]``; a view: writes reach ``cache``."""
    if layout == "NHD":
        return cache
    if layout == "HND":
        return cache.transpose(2, 3)
    num_blocks, heads, block_size, _ = cache.shape
    # per (block, head): [2 * block_size, head_dim] rows, K's first
    return cache.view(num_blocks, heads, 2, block_size, head_dim).permute(2, 0, 3, 1, 4)


def write_tokens(cache: torch.Tensor, layout: str, block_ids: Sequence[int], tokens: torch.Tensor) -> None:
    """Store ``tokens`` (``[2, n, heads, head_dim]``) in ``block_ids``, in token order; later slots are left."""
    view = _token_view(cache, layout, tokens.shape[-1])
    block_size = view.shape[2]
    for i, block_id in enumerate(block_ids):
        chunk = tokens[:, i * block_size : (i + 1) * block_size]
        if chunk.shape[1] == 0:
            break
        view[:, block_id, : chunk.shape[1]] = chunk


def read_tokens(cache: torch.Tensor, layout: str, block_ids: Sequence[int], head_dim: int) -> torch.Tensor:
    """The tokens held in ``block_ids``, in order: ``[2, len(block_ids) * block_size, heads, head_dim]``."""
    view = _token_view(cache, layout, head_dim)
    return view[:, list(block_ids)].flatten(1, 2).clone()


def noise_cache(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A cache full of stale noise, so that unwritten or misplaced bytes show."""
    return torch.randn(tuple(shape), generator=generator).to(dtype)


def padded(tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``tokens`` (``[2, n, heads, head_dim]``) zero-padded (or cut) to ``num_tokens``."""
    out = tokens.new_zeros((2, num_tokens, *tokens.shape[2:]))
    count = min(num_tokens, tokens.shape[1])
    out[:, :count] = tokens[:, :count]
    return out
