"""KV-cache topology of one engine rank, and the arithmetic that pairs a reader with a source.

Every TP rank of an engine keeps, per layer, a paged KV cache holding the KV
heads of its shard, ``block_size`` tokens per block. vLLM 0.32 keeps each
block of a layer in one plane, whose dims ``KVLayout`` names outermost first:
its GPU backends' (K and V halves of a ``2 * head_dim`` last dim), its CPU
cache's (K then V per head), or MLA's one latent per token (no K/V split, the
same on every TP rank: one KV head, replicated). ``KVTopology`` describes that
for one rank.
The reading side is called *local* (decode, in pull mode) and the side whose
blocks are read *remote* (prefill). Before a local rank reads a request's KV:

1. ``plan_reads(local, remote)`` says which remote ranks to read and which head
   slice of their blocks (``check_compatible`` runs first, so an unsupported
   pair fails with all its reasons at once);
2. ``connectors.block_ranges`` turns a head slice into the byte runs of a
   direct READ, remote block plane -> local block plane (several remote blocks
   per local block when the remote block size divides ours), for the
   transport's descriptors (``source_ranks`` answers which remote ranks before
   any handshake). The tests check those moves against the torch reference of
   ``tests/kv_reference``, through the in-memory and the NIXL transports.

The handshake compares ``compatibility_hash`` first and logs ``incompatibilities``.

Head placement is vLLM's: with TP <= H heads, rank r holds heads
[r*H/TP, (r+1)*H/TP); with TP > H, TP/H consecutive ranks hold copies of one head.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass

from connectors.errors import InvalidTopology, TopologyMismatch

__all__ = [
    "COMPATIBILITY_SCHEMA",
    "ELEMENT_SIZES",
    "HeadSlice",
    "KVLayout",
    "KVTopology",
    "ReadPlan",
    "block_size_ratio",
    "check_compatible",
    "compatibility_factors",
    "compatibility_hash",
    "incompatibilities",
    "plan_reads",
    "reader_ranks",
    "source_ranks",
]

# The rules of what can exchange KV: vLLM 0.32's layouts (H2ND, HN2D, NH2D, MLA), read across TP and block
# sizes. Bump it when they change: peers on different schemas then fail the hash check instead of misreading
# each other's blocks.
COMPATIBILITY_SCHEMA = 5

# Bytes per element of the KV cache dtypes we know; names as torch spells them
# (``str(tensor.dtype)`` without the ``torch.`` prefix) or as vLLM's cache_dtype.
ELEMENT_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class KVLayout(enum.StrEnum):
    """Order of the dims inside one block plane (one block of one layer: its K and V, or latents), outermost first.

    ``N`` counts the block's tokens, ``H`` the rank's KV heads, ``D`` a head's
    elements, ``2`` K then V. These are the layouts vLLM 0.32 hands the
    connector. Where each row lies: ``connectors.block_ranges``.
    """

    H2ND = "H2ND"  # [num_heads, 2, block_size, head_dim]: vLLM's CPU cache, a head slice is contiguous
    HN2D = "HN2D"  # [num_heads, block_size, 2 * head_dim]: vLLM 0.32 on GPU, KVCacheLayout.LBHNC: head-major
    NH2D = "NH2D"  # [block_size, num_heads, 2 * head_dim]: vLLM 0.32 on GPU, KVCacheLayout.LBNHC: token-major
    MLA = "MLA"  # [block_size, latent_dim]: one latent per token, no K/V (DeepSeek-style MLA)

    @property
    def kv_components(self) -> int:
        """Rows per (head, token): 2 (K and V), or 1 for MLA's latent."""
        return 1 if self is KVLayout.MLA else 2


@dataclass(frozen=True, slots=True)
class KVTopology:
    """One TP rank's KV cache geometry, as exchanged in the handshake.

    ``layout`` and ``dtype`` accept plain strings (``"HN2D"``, ``"torch.bfloat16"``)
    and are normalised; an inconsistent topology raises ``InvalidTopology``.
    An MLA cache counts as one KV head (``total_num_kv_heads`` 1), which every
    rank holds: vLLM replicates it, whatever the model's ``num_key_value_heads``.
    """

    tp_size: int
    tp_rank: int
    total_num_kv_heads: int
    block_size: int
    layout: KVLayout
    head_dim: int
    dtype: str
    num_layers: int
    model_identity: str = ""
    """Which weights produced this KV (``connectors.identity.model_identity``; "" when unknown)."""

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be >= 1, got {getattr(self, name)}"
            for name in ("tp_size", "total_num_kv_heads", "block_size", "head_dim", "num_layers")
            if getattr(self, name) < 1
        ]
        if problems:
            raise InvalidTopology("; ".join(problems))
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidTopology(f"tp_rank {self.tp_rank} is outside [0, tp_size {self.tp_size})")
        heads, tp = self.total_num_kv_heads, self.tp_size
        if tp <= heads and heads % tp:
            raise InvalidTopology(f"total_num_kv_heads {heads} is not divisible by tp_size {tp}")
        if tp > heads and tp % heads:
            raise InvalidTopology(
                f"tp_size {tp} is not a multiple of total_num_kv_heads {heads}, so heads cannot be replicated evenly"
            )
        try:
            object.__setattr__(self, "layout", KVLayout(self.layout))
        except ValueError:
            raise InvalidTopology(f"unknown layout {self.layout!r}; expected one of {', '.join(KVLayout)}") from None
        if self.layout is KVLayout.MLA and heads != 1:
            raise InvalidTopology(f"an MLA cache holds one latent per token: total_num_kv_heads must be 1, got {heads}")
        dtype = str(self.dtype).removeprefix("torch.")
        if dtype not in ELEMENT_SIZES:
            raise InvalidTopology(f"unknown KV cache dtype {self.dtype!r}; known: {', '.join(ELEMENT_SIZES)}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def num_heads(self) -> int:
        """KV heads this rank holds (1 when TP exceeds the head count)."""
        return max(1, self.total_num_kv_heads // self.tp_size)

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZES[self.dtype]

    @property
    def kv_components(self) -> int:
        return self.layout.kv_components

    @property
    def planes_per_layer(self) -> int:
        """Block planes per block and layer, as the transports count regions: 1, every layout keeps a block's
        K and V (or its latents) in one plane."""
        return 1

    @property
    def block_plane_bytes(self) -> int:
        """Bytes of one block plane for one layer on this rank: all its rows, K and V (or the latent)."""
        return self.kv_components * self.num_heads * self.block_size * self.head_dim * self.element_size

    def head_start(self, rank: int | None = None) -> int:
        """First global KV head held by ``rank`` (default: this rank)."""
        rank = self.tp_rank if rank is None else rank
        if not 0 <= rank < self.tp_size:
            raise InvalidTopology(f"rank {rank} is outside [0, tp_size {self.tp_size})")
        return rank * self.total_num_kv_heads // self.tp_size

    def with_rank(self, tp_rank: int) -> KVTopology:
        """The same engine's topology as seen by another of its ranks."""
        return dataclasses.replace(self, tp_rank=tp_rank)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One read: ``num_heads`` heads of every block of ``remote_rank``.

    ``remote_head_start`` indexes the remote rank's own heads, ``local_head_start``
    the local rank's own heads; both are offsets, not global head numbers.
    """

    remote_rank: int
    remote_head_start: int
    local_head_start: int
    num_heads: int


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Everything one local rank reads from a remote engine, per request block.

    ``slices`` are ordered by ``local_head_start`` and together cover the local
    rank's heads exactly once.
    """

    slices: tuple[HeadSlice, ...]

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        return tuple(s.remote_rank for s in self.slices)


# ---------------------------------------------------------------- compatibility


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """How many remote blocks fill one local block; raises ``TopologyMismatch`` if not a whole number >= 1."""
    reason = _block_size_problem(local_block_size, remote_block_size)
    if reason:
        raise TopologyMismatch([reason])
    return local_block_size // remote_block_size


def _block_size_problem(local_block_size: int, remote_block_size: int) -> str | None:
    if remote_block_size > local_block_size:
        return (
            f"remote block size {remote_block_size} is larger than local block size {local_block_size} "
            "(only a remote block size that divides the local one is supported)"
        )
    if local_block_size % remote_block_size:
        return f"local block size {local_block_size} is not a multiple of remote block size {remote_block_size}"
    return None


def incompatibilities(local: KVTopology, remote: KVTopology) -> list[str]:
    """Every reason ``local`` cannot read KV from ``remote``; empty when it can.

    A read maps rows between any two layouts (``connectors.block_ranges``) but
    MLA's: its rows are latents, not K and V, so MLA pairs only with MLA.
    """
    reasons = [
        f"{name} differs: local {getattr(local, name)}, remote {getattr(remote, name)}"
        for name in ("dtype", "head_dim", "num_layers", "total_num_kv_heads")
        if getattr(local, name) != getattr(remote, name)
    ]
    if (local.layout is KVLayout.MLA) != (remote.layout is KVLayout.MLA):
        reasons.append(
            f"MLA KV (one latent per token) pairs only with MLA KV: local layout {local.layout}, "
            f"remote layout {remote.layout}"
        )
    if local.model_identity != remote.model_identity:
        reasons.append(
            f"model identity differs (another checkpoint, or another configuration): local "
            f"{local.model_identity[:16] or 'unknown'}, remote {remote.model_identity[:16] or 'unknown'}"
        )
    big, small = max(local.tp_size, remote.tp_size), min(local.tp_size, remote.tp_size)
    if big % small:
        reasons.append(f"tp sizes do not divide one another: local {local.tp_size}, remote {remote.tp_size}")
    block_reason = _block_size_problem(local.block_size, remote.block_size)
    if block_reason:
        reasons.append(block_reason)
    return reasons


def check_compatible(local: KVTopology, remote: KVTopology) -> None:
    """Raise ``TopologyMismatch`` carrying every reason, if ``local`` cannot read from ``remote``."""
    reasons = incompatibilities(local, remote)
    if reasons:
        raise TopologyMismatch(reasons)


def compatibility_factors(topology: KVTopology) -> dict[str, object]:
    """The fields two peers must agree on exactly, as hashed by ``compatibility_hash``.

    TP size, block size and layout are left out: they may differ within the
    rules ``incompatibilities`` checks pairwise. ``layouts`` names the layouts
    this code converts between, so a peer that cannot convert hashes
    differently; ``kv_components`` tells MLA (1) from K and V (2), which never pair.
    """
    return {
        "schema": COMPATIBILITY_SCHEMA,
        "dtype": topology.dtype,
        "head_dim": topology.head_dim,
        "kv_components": topology.kv_components,
        "num_layers": topology.num_layers,
        "total_num_kv_heads": topology.total_num_kv_heads,
        "model_identity": topology.model_identity,
        "layouts": sorted(KVLayout),
    }


def compatibility_hash(topology: KVTopology) -> str:
    """SHA-256 hex digest of ``compatibility_factors``: equal on peers that may try to pair.

    Equal hashes are necessary, not sufficient: ``check_compatible`` still
    applies the pairwise TP and block-size rules.
    """
    encoded = json.dumps(compatibility_factors(topology), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode()).hexdigest()


# ---------------------------------------------------------------- TP mapping


def plan_reads(local: KVTopology, remote: KVTopology) -> ReadPlan:
    """Which remote ranks ``local`` reads, and which head slice of each.

    The local rank looks at the remote ranks in its proportional share of the
    remote engine (one rank when remote TP <= local TP, remote/local TP ranks
    otherwise) and takes from each the heads it needs that no earlier rank in
    that share already gave. So several local ranks split one remote rank's
    heads (remote TP < local TP), one local rank concatenates several remote
    ranks' heads (remote TP > local TP), and of remote replicas of one head
    only one is read. Spreading readers over the share also spreads them
    over the replicas. ``remote.tp_rank`` is not used: the plan is about the whole remote engine.
    """
    check_compatible(local, remote)
    if local.tp_size >= remote.tp_size:
        first = local.tp_rank * remote.tp_size // local.tp_size
        share = range(first, first + 1)
    else:
        per_local = remote.tp_size // local.tp_size
        share = range(local.tp_rank * per_local, (local.tp_rank + 1) * per_local)
    wanted_start = local.head_start()
    wanted_stop = wanted_start + local.num_heads
    covered = wanted_start  # remote head ranges grow with rank: heads are gathered in order
    slices: list[HeadSlice] = []
    for rank in share:
        held_start = remote.head_start(rank)
        start, stop = max(held_start, covered), min(held_start + remote.num_heads, wanted_stop)
        if start >= stop:
            continue  # a replica of heads already planned
        slices.append(HeadSlice(rank, start - held_start, start - wanted_start, stop - start))
        covered = stop
    if covered != wanted_stop:  # unreachable for topologies that pass check_compatible
        raise TopologyMismatch(
            [f"remote ranks {list(share)} do not hold heads [{covered}, {wanted_stop}) of local rank {local.tp_rank}"]
        )
    return ReadPlan(tuple(slices))


def reader_ranks(remote_rank: int, local: KVTopology, remote: KVTopology) -> tuple[int, ...]:
    """Local ranks whose plan reads ``remote_rank``: how many reads a source waits for before freeing blocks."""
    remote.head_start(remote_rank)  # validates the rank
    return tuple(
        rank for rank in range(local.tp_size) if remote_rank in plan_reads(local.with_rank(rank), remote).remote_ranks
    )


def source_ranks(local: KVTopology, remote_tp_size: int) -> tuple[int, ...]:
    """Remote ranks ``local`` reads when the remote engine has ``remote_tp_size`` ranks.

    Which ranks depends only on TP sizes and the head count, so the decode side
    knows whom to handshake with before it has seen any remote topology.
    Raises ``TopologyError`` when ``remote_tp_size`` cannot pair with ``local``.
    """
    remote = dataclasses.replace(local, tp_size=remote_tp_size, tp_rank=0)
    return plan_reads(local, remote).remote_ranks
