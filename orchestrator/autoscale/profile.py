"""The engines' performance profile: how long prefill, decode and KV transfer take.

The autoscaling policy turns load into replica counts with it, and the simulator
times every prefill step, decode step and KV transfer with it. ``pdserve profile``
(measured on real engines) writes one; ``configs/profiles/`` ships examples.

File format (YAML or JSON, chosen by the file's suffix; ``format`` is checked first)::

    format: pdserve-profile/1
    name: example-gpu
    provenance: how the numbers were obtained (measured where, with what; or "illustrative")
    engine:                          # the engine configuration the numbers hold for
      max_num_seqs: 256              # decode batch limit (vLLM --max-num-seqs)
      max_num_batched_tokens: 8192   # prefill token budget per step (chunked prefill)
      kv_capacity_tokens: 460000     # KV cache of one decode engine, in tokens
      kv_bytes_per_token: 327680     # KV bytes one prompt token moves from prefill to decode
      startup_s: 60                  # from "start an engine" to "it serves"
      handoff_s: 0.15                # optional (0): a disaggregated request's fixed cost between the
                                     # prefill pass and the decode engine's first step, beyond the KV
                                     # transfer (HTTP both ways, the decode engine's scheduling of it)
      move_s: 0.1                    # optional (0.1): a ready engine's switch from one pool to the other
                                     # once its old work is done (out of one routing table, into the
                                     # other; no restart: every engine runs the connector as kv_both)
    prefill:                         # one forward pass computing `tokens` prompt tokens of `batch` sequences
      tokens: [256, 1024, 4096, 8192]
      batch: [1, 2, 4]
      seconds: [[...], ...]          # one row per `tokens` value, one column per `batch` value
    decode:                          # one decode step of `batch` sequences of mean context length `context`
      batch: [1, 8, 64, 256]
      context: [1024, 4096, 16384]
      seconds: [[...], ...]          # one row per `batch` value, one column per `context` value
    transfer:                        # moving one request's KV from a prefill to a decode engine
      bytes: [1.0e6, 1.0e9]
      seconds: [0.002, 0.045]

Lookups interpolate linearly between grid points (bilinearly on the 2-D tables),
hold the first value below the grid (a pass never gets cheaper than the smallest
one measured) and extend the last segment's slope above it (held flat when that
segment falls).
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import PdserveError

FORMAT = "pdserve-profile/1"
# A role move's switch time when the profile does not say (engine.move_s): an idle engine of the CPU demo serves
# in its new pool about 0.04 s after the decision (scripts/bench_moves.py measures it), and the controller sees a
# busy one's old work done within its 0.2-s check, 0.1 s later on average.
DEFAULT_MOVE_S = 0.1

__all__ = [
    "DEFAULT_MOVE_S",
    "FORMAT",
    "EngineLimits",
    "Grid1D",
    "Grid2D",
    "PerformanceProfile",
    "ProfileError",
    "load_profile",
]


class ProfileError(PdserveError):
    """A profile file is wrong: names the file, the field and the reason."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field}: {reason}" if field else f"{source}: {reason}")

    def __reduce__(self):
        return (type(self), (self.source, self.field, self.reason))


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ys(x); constant below xs[0], last segment's slope above xs[-1].

    Above the grid a falling last segment is held flat, not extended: a measured
    pass that got cheaper between the last two points (two short sequences attend
    over less than one long one; noise) must not extrapolate to zero or below.
    """
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = min(bisect_right(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    if x > x1 and y1 < y0:
        return y1
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(slots=True, frozen=True)
class Grid1D:
    x: list[float]
    y: list[float]

    def __call__(self, x: float) -> float:
        return max(0.0, _interp(self.x, self.y, x))


@dataclass(slots=True, frozen=True)
class Grid2D:
    """``seconds[i][j]`` is the value at ``(rows[i], cols[j])``."""

    rows: list[float]
    cols: list[float]
    seconds: list[list[float]]

    def __call__(self, row: float, col: float) -> float:
        rows, cols, table = self.rows, self.cols, self.seconds
        if row <= rows[0] or len(rows) == 1:
            return max(0.0, _interp(cols, table[0], col))
        i = min(bisect_right(rows, row), len(rows) - 1)
        below, above = _interp(cols, table[i - 1], col), _interp(cols, table[i], col)
        if row > rows[i] and above < below:  # held flat above the grid, as in _interp
            return max(0.0, above)
        return max(0.0, below + (above - below) * (row - rows[i - 1]) / (rows[i] - rows[i - 1]))


@dataclass(slots=True, frozen=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    startup_s: float
    handoff_s: float = 0.0  # fixed cost of the prefill -> decode hand-off beyond the KV transfer
    move_s: float = DEFAULT_MOVE_S  # a role move's switch, once the engine's old work is done


@dataclass(slots=True, frozen=True)
class PerformanceProfile:
    name: str
    provenance: str
    engine: EngineLimits
    prefill: Grid2D  # rows: tokens in the pass, cols: sequences in the pass
    decode: Grid2D  # rows: batch size, cols: mean context length
    transfer: Grid1D  # x: bytes

    def prefill_seconds(self, tokens: float, batch: int = 1) -> float:
        """One prefill pass that computes ``tokens`` prompt tokens of ``batch`` sequences."""
        return self.prefill(tokens, batch)

    def decode_step_seconds(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences whose mean context is ``context`` tokens."""
        return self.decode(batch, context)

    def kv_transfer_seconds(self, prompt_tokens: int) -> float:
        return self.transfer(prompt_tokens * self.engine.kv_bytes_per_token)

    def handoff_seconds(self, prompt_tokens: int) -> float:
        """From the end of a prompt's prefill pass to its decode engine's first step: KV transfer + hand-off."""
        return self.kv_transfer_seconds(prompt_tokens) + self.engine.handoff_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "provenance": self.provenance,
            "engine": asdict(self.engine),
            "prefill": {"tokens": self.prefill.rows, "batch": self.prefill.cols, "seconds": self.prefill.seconds},
            "decode": {"batch": self.decode.rows, "context": self.decode.cols, "seconds": self.decode.seconds},
            "transfer": {"bytes": self.transfer.x, "seconds": self.transfer.y},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        else:
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<profile>") -> PerformanceProfile:
        return _Reader(source).profile(raw)


def load_profile(path: str | os.PathLike[str]) -> PerformanceProfile:
    """Read and check a profile file (``.json`` as JSON, anything else as YAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(str(path), "", f"cannot read file: {e.strerror}") from e
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ProfileError(str(path), "", f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from e
    return PerformanceProfile.from_dict(raw, source=str(path))


class _Reader:
    """Checks a raw profile mapping field by field; every error names its dotted field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, reason: str) -> ProfileError:
        return ProfileError(self.source, field, reason)

    def section(self, raw: dict[str, Any], key: str, prefix: str = "") -> dict[str, Any]:
        value = raw.get(key)
        if not isinstance(value, dict):
            raise self.fail(prefix + key, "required mapping is missing" if value is None else "must be a mapping")
        return value

    def number(self, raw: dict[str, Any], key: str, field: str, positive: bool = True) -> float:
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(field, f"must be a number (got {value!r})")
        if positive and value <= 0:
            raise self.fail(field, f"must be greater than 0 (got {value!r})")
        return float(value)

    def optional(self, engine: dict[str, Any], key: str, default: float) -> float:
        """``engine.<key>``: optional (profiles from before it have none: ``default``), never negative."""
        if key not in engine:
            return default
        value = self.number(engine, key, f"engine.{key}", positive=False)
        if value < 0:
            raise self.fail(f"engine.{key}", f"must be 0 or more (got {value!r})")
        return value

    def axis(self, raw: dict[str, Any], key: str, field: str) -> list[float]:
        values = raw.get(key)
        if not isinstance(values, list) or not values:
            raise self.fail(field, "must be a non-empty list of numbers")
        axis = [self.number({"v": v}, "v", field) for v in values]
        if any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
            raise self.fail(field, f"must be strictly increasing (got {values})")
        return axis

    def seconds(self, values: Any, field: str, length: int) -> list[float]:
        if not isinstance(values, list) or len(values) != length:
            raise self.fail(field, f"must be a list of {length} numbers (got {values!r})")
        return [self.number({"v": v}, "v", field) for v in values]

    def grid2d(self, raw: dict[str, Any], name: str, row_key: str, col_key: str) -> Grid2D:
        section = self.section(raw, name)
        rows = self.axis(section, row_key, f"{name}.{row_key}")
        cols = self.axis(section, col_key, f"{name}.{col_key}")
        table = section.get("seconds")
        if not isinstance(table, list) or len(table) != len(rows):
            raise self.fail(f"{name}.seconds", f"must have one row per {row_key} value ({len(rows)} rows)")
        lines = [self.seconds(line, f"{name}.seconds[{i}]", len(cols)) for i, line in enumerate(table)]
        return Grid2D(rows, cols, lines)

    def profile(self, raw: Any) -> PerformanceProfile:
        if not isinstance(raw, dict):
            raise self.fail("", "a profile must be a mapping")
        if raw.get("format") != FORMAT:
            raise self.fail("format", f"expected {FORMAT!r} (got {raw.get('format')!r})")
        unknown = sorted(set(raw) - {"format", "name", "provenance", "engine", "prefill", "decode", "transfer"})
        if unknown:
            raise self.fail(unknown[0], "unknown key")
        engine = self.section(raw, "engine")
        limits = EngineLimits(
            max_num_seqs=int(self.number(engine, "max_num_seqs", "engine.max_num_seqs")),
            max_num_batched_tokens=int(self.number(engine, "max_num_batched_tokens", "engine.max_num_batched_tokens")),
            kv_capacity_tokens=int(self.number(engine, "kv_capacity_tokens", "engine.kv_capacity_tokens")),
            kv_bytes_per_token=int(self.number(engine, "kv_bytes_per_token", "engine.kv_bytes_per_token")),
            startup_s=self.number(engine, "startup_s", "engine.startup_s", positive=False),
            handoff_s=self.optional(engine, "handoff_s", 0.0),
            move_s=self.optional(engine, "move_s", DEFAULT_MOVE_S),
        )
        transfer = self.section(raw, "transfer")
        nbytes = self.axis(transfer, "bytes", "transfer.bytes")
        return PerformanceProfile(
            name=str(raw.get("name", "unnamed")),
            provenance=str(raw.get("provenance", "")),
            engine=limits,
            prefill=self.grid2d(raw, "prefill", "tokens", "batch"),
            decode=self.grid2d(raw, "decode", "batch", "context"),
            transfer=Grid1D(nbytes, self.seconds(transfer.get("seconds"), "transfer.seconds", len(nbytes))),
        )
