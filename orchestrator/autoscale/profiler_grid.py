"""What ``pdserve profile`` measures: the grid of points (``ProfileGrid``), its checks against the engines'
limits, and the default and quick grids the CLI starts from (``grid_with``: with the options given).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ProfilingError

__all__ = ["DEFAULT_GRID", "QUICK_GRID", "ProfileGrid", "grid_with"]


@dataclass(slots=True, frozen=True)
class ProfileGrid:
    """What to measure. Prefill passes never exceed ``max_num_batched_tokens`` (a longer prompt is
    chunked into several passes, which is not a point of the table); the defaults fit the CPU demo
    (SmolLM2-135M on one core per engine) in about eight minutes. Prefill batches go to 8: a loaded
    engine packs that many prompts into a pass, and on CPU a pass of 8 x 256 tokens is much cheaper than
    one of 2048 (attention grows with each sequence's square); a table that stops at 2 makes the simulator
    clamp there and overstate a busy engine's passes 2-3x. Decode batches go to 32: in bursts the demo's
    decode engine runs 30-60 streams, whose steps a table that stops at 8 extrapolates from 4-8."""

    prefill_tokens: tuple[int, ...] = (64, 256, 1024, 2048)
    prefill_batch: tuple[int, ...] = (1, 2, 4, 8)
    decode_batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context: tuple[int, ...] = (128, 512)
    transfer_tokens: tuple[int, ...] = (256, 1024, 2048)
    repeats: int = 2
    decode_tokens: int = 24

    def check(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, disagg_from: int) -> None:
        """Raise ``ProfilingError`` naming the option whose values the engines cannot measure."""
        axes = {
            "--prefill-tokens": self.prefill_tokens,
            "--prefill-batch": self.prefill_batch,
            "--decode-batch": self.decode_batch,
            "--decode-context": self.decode_context,
            "--transfer-tokens": self.transfer_tokens,
        }
        for option, values in axes.items():
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ProfilingError(f"{option}: must be increasing positive numbers (got {list(values)})")
        if self.repeats < 1 or self.decode_tokens < 3:
            raise ProfilingError(f"--repeats must be >= 1, --decode-tokens >= 3 ({self.repeats}, {self.decode_tokens})")
        if self.prefill_tokens[-1] > max_num_batched_tokens:
            raise ProfilingError(
                f"--prefill-tokens: {self.prefill_tokens[-1]} exceeds the engines' max_num_batched_tokens "
                f"({max_num_batched_tokens}): such a prefill is several passes, not one"
            )
        if self.prefill_tokens[0] < self.prefill_batch[-1]:
            raise ProfilingError(
                f"--prefill-tokens: {self.prefill_tokens[0]} tokens cannot be split into "
                f"{self.prefill_batch[-1]} sequences (--prefill-batch)"
            )
        if self.prefill_tokens[-1] // self.prefill_batch[0] >= max_model_len:
            raise ProfilingError(f"--prefill-tokens: {self.prefill_tokens[-1]} exceeds max_model_len {max_model_len}")
        if self.decode_batch[-1] > max_num_seqs:
            raise ProfilingError(f"--decode-batch: {self.decode_batch[-1]} exceeds max_num_seqs {max_num_seqs}")
        if self.decode_context[-1] + self.decode_tokens > max_model_len:
            raise ProfilingError(
                f"--decode-context: {self.decode_context[-1]} + {self.decode_tokens} output tokens exceed "
                f"max_model_len {max_model_len}"
            )
        if self.transfer_tokens[-1] + 2 > max_model_len:
            raise ProfilingError(f"--transfer-tokens: {self.transfer_tokens[-1]} exceeds max_model_len {max_model_len}")
        if self.transfer_tokens[0] < disagg_from:
            raise ProfilingError(
                f"--transfer-tokens: {self.transfer_tokens[0]} is below proxy.decode_only_below_tokens "
                f"({disagg_from}): the proxy would serve it without a KV transfer"
            )


DEFAULT_GRID = ProfileGrid()
QUICK_GRID = ProfileGrid(
    prefill_tokens=(64, 256, 1024),
    prefill_batch=(1, 2),
    decode_batch=(1, 4),
    decode_context=(128, 512),
    transfer_tokens=(256, 1024),
    repeats=1,
    decode_tokens=16,
)
"""A smoke run: every table gets values, in about a third of the default's time."""


def grid_with(base: ProfileGrid, **overrides: Any) -> ProfileGrid:
    """``base`` with the options the user gave (``None``: keep ``base``'s)."""
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, **given)
