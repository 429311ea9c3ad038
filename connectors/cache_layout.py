"""Which of vLLM 0.32's KV cache layouts a cache tensor is: its ``KVLayout`` and block size.

vLLM hands each layer's cache to the connector as a tensor; its shape and strides (and the device: the CPU
backend keeps K and V apart within each head) tell the layout, which ``connectors.topology.KVTopology`` then
carries to the peers and ``connectors.block_ranges`` cuts into byte runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.errors import ConnectorError
from connectors.topology import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["describe_kv_cache"]


def describe_kv_cache(
    cache: torch.Tensor, num_heads: int, head_dim: int, *, use_mla: bool = False, device_type: str | None = None
) -> tuple[KVLayout, int]:
    """``(layout, block_size)`` of one layer's vLLM KV cache tensor on this rank.

    ``num_heads`` counts the rank's KV heads and ``head_dim`` is vLLM's head
    size (MLA's latent: kv_lora_rank + qk_rope_head_dim). What vLLM 0.32 hands us:

    - every backend: ``[num_blocks, heads, block_size, 2 * head_dim]``, whose
      strides say its KVCacheLayout. The shape does not say where K and V are:
      GPU kernels take the two halves of the last dim (HN2D for LBHNC, NH2D for
      LBNHC), the CPU backend the two halves of each head's ``2 * block_size``
      rows (H2ND). So the device decides: ``device_type``, by default the cache's.
    - MLA (``use_mla``): ``[num_blocks, 1, block_size, head_dim]``.

    Any other shape (those of older vLLM among them) is refused with a
    ``ConnectorError`` naming the shape expected. Transports cut blocks by
    address, so each block must be dense and blocks outermost: ``ConnectorError``
    names the layout otherwise (vLLM's LHBNC, the cross-layer BLHNC, BLNHC, BHLNC).
    """
    shape, device = tuple(cache.shape), device_type or cache.device.type
    if device not in ("cpu", "cuda"):
        raise ConnectorError(f"KV cache on device {device!r}: the pdserve connector reads caches on cpu or cuda")
    # Each candidate: (layout, the cache's dims outermost first in memory); dim 2 counts a block's tokens.
    candidates: tuple[tuple[KVLayout, tuple[int, ...]], ...] = ()
    if use_mla:
        if len(shape) == 4 and shape[1] == 1 and shape[3] == head_dim:
            candidates = ((KVLayout.MLA, (0, 1, 2, 3)),)
        held = f"an MLA latent of size {head_dim}"
        expected = f"[num_blocks, 1, block_size, {head_dim}] (vLLM 0.32)"
    else:
        if len(shape) == 4 and shape[1] == num_heads and shape[3] == 2 * head_dim:
            if device == "cpu":
                candidates = ((KVLayout.H2ND, (0, 1, 2, 3)),)
            else:
                candidates = ((KVLayout.HN2D, (0, 1, 2, 3)), (KVLayout.NH2D, (0, 2, 1, 3)))
        held = f"{num_heads} KV heads of size {head_dim} on this rank"
        expected = (
            f"[num_blocks, {num_heads}, block_size, {2 * head_dim}] "
            "(vLLM 0.32's [num_blocks, heads, block_size, 2*head_dim])"
        )
    if not candidates:
        raise ConnectorError(f"unsupported KV cache shape {shape} for {held}; expected {expected}")
    for layout, memory_order in candidates:
        if _dense_in_order(cache, memory_order):
            return layout, shape[2]
    raise ConnectorError(
        f"unsupported KV cache layout: a cache {shape} with strides {cache.stride()} keeps {_misplaced(cache)}; "
        "the pdserve connector reads caches whose blocks are outermost and dense: vLLM's KV cache layouts LBHNC "
        "and LBNHC (VLLM_KV_CACHE_LAYOUT; LBHNC on CPU)"
    )


def _dense_in_order(cache: torch.Tensor, memory_order: tuple[int, ...]) -> bool:
    """Whether ``cache`` is one dense span whose dims, outermost first, are ``memory_order`` (size-1 dims anywhere)."""
    stride = 1
    for dim in reversed(memory_order):
        if cache.shape[dim] > 1 and cache.stride(dim) != stride:
            return False
        stride *= cache.shape[dim]
    return True


def _misplaced(cache: torch.Tensor) -> str:
    """What a cache whose blocks are not outermost and dense does instead, in vLLM's names where we know them."""
    if cache.dim() == 4 and cache.shape[1] > 1 and cache.stride(1) > cache.stride(0):
        return "heads outside blocks (vLLM's LHBNC)"
    if cache.stride(0) > cache[0].numel():
        return "the blocks of several layers in one tensor (vLLM's cross-layer BLHNC, BLNHC or BHLNC)"
    return "its rows in an order this connector does not know"
