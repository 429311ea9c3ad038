"""Request traces for the simulator: read, write and generate them.

A trace is a JSON-lines file, one request per line, in arrival order::

    {"t": 0.132, "prompt_tokens": 1843, "output_tokens": 212}

``t`` is seconds from the start of the trace. The generators below are
deterministic: the same arguments and seed give the same trace, byte for byte.

- ``poisson``: steady Poisson arrivals at one rate.
- ``bursty``: Poisson arrivals whose rate jumps to ``burst_factor`` times the base
  for exponentially distributed bursts (a two-state Markov-modulated Poisson process).
- ``diurnal``: a rate that follows a day's shape (trough to peak and back) over
  ``period_s``, repeated.
- ``shaped``: any rate over time, of which ``poisson`` and ``diurnal`` are two.

Each draws a non-homogeneous Poisson process by thinning, and takes a ``LengthMix``
for prompt and output lengths: ``MIXES`` holds the
chat mix, the long-prompt and long-output mixes, a heavy-tailed mix, and a short
mix for CPU engines. ``burst_edges`` are the draws that place a bursty trace's bursts.
"""

from __future__ import annotations

import json
import math
import os
import random
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import PdserveError

__all__ = [
    "MIXES",
    "LengthMix",
    "TraceError",
    "TraceRequest",
    "burst_edges",
    "bursty",
    "diurnal",
    "poisson",
    "read_trace",
    "shaped",
    "write_trace",
]


class TraceError(PdserveError, ValueError):
    """A trace file is wrong: names the file and line."""


@dataclass(slots=True, frozen=True)
class TraceRequest:
    t: float
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A log-normal length with the given mean, clipped to [low, high]."""

    mean: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        mu = math.log(self.mean) - self.sigma**2 / 2
        return int(min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma)))))


@dataclass(slots=True, frozen=True)
class LengthMix:
    """Request classes (weight, prompt length, output length); each request draws its class, then its lengths."""

    name: str
    classes: tuple[tuple[float, LengthDist, LengthDist], ...]

    def draw(self, rng: random.Random) -> tuple[int, int]:
        pick = rng.random() * sum(weight for weight, _, _ in self.classes)
        chosen = self.classes[-1]
        for chosen in self.classes:  # noqa: B007 - the loop picks the class
            pick -= chosen[0]
            if pick <= 0:
                break
        return chosen[1].draw(rng), chosen[2].draw(rng)


_CHAT_PROMPT = LengthDist(2000, 0.8, 32, 16000)
_CHAT_OUTPUT = LengthDist(250, 0.8, 4, 2048)
MIXES: dict[str, LengthMix] = {
    "chat": LengthMix("chat", ((1.0, _CHAT_PROMPT, _CHAT_OUTPUT),)),
    # A quarter of the requests carry long documents (RAG, code context).
    "long-prompt": LengthMix(
        "long-prompt", ((0.75, _CHAT_PROMPT, _CHAT_OUTPUT), (0.25, LengthDist(12000, 0.4, 4000, 32000), _CHAT_OUTPUT))
    ),
    # A quarter of the requests write at length (reasoning, reports).
    "long-output": LengthMix(
        "long-output", ((0.75, _CHAT_PROMPT, _CHAT_OUTPUT), (0.25, _CHAT_PROMPT, LengthDist(2000, 0.4, 500, 8192)))
    ),
    # Heavy tails: log-normal with sigma 1.2 (the p99 prompt is ~10x the median), prompts up to 8k
    # tokens, outputs up to 2k. Sizing from the mean alone under-provisions it.
    "heavy": LengthMix("heavy", ((1.0, LengthDist(1500, 1.2, 16, 8192), LengthDist(250, 1.2, 4, 2048)),)),
    # Short requests a CPU engine serves in seconds (the CPU demo, lab/validate_simulator.py).
    "short": LengthMix("short", ((1.0, LengthDist(300, 0.5, 64, 1024), LengthDist(24, 0.5, 8, 64)),)),
}


def _arrivals(rate_at: Callable[[float], float], peak: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Non-homogeneous Poisson arrivals by thinning a rate-``peak`` process."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if rng.random() * peak <= rate_at(t):
            yield t


def _with_lengths(times: Iterable[float], mix: LengthMix, rng: random.Random) -> list[TraceRequest]:
    out = []
    for t in times:
        prompt, output = mix.draw(rng)
        out.append(TraceRequest(round(t, 6), prompt, output))
    return out


def shaped(
    rate_at: Callable[[float], float], peak_rps: float, duration_s: float, mix: LengthMix = MIXES["chat"], seed: int = 0
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate_at(t)`` req/s (never above ``peak_rps``) for ``duration_s``."""
    rng = random.Random(seed)
    return _with_lengths(_arrivals(rate_at, peak_rps, duration_s, rng), mix, rng)


def poisson(rate_rps: float, duration_s: float, mix: LengthMix = MIXES["chat"], seed: int = 0) -> list[TraceRequest]:
    return shaped(lambda t: rate_rps, rate_rps, duration_s, mix, seed)


def bursty(
    base_rps: float,
    duration_s: float,
    burst_factor: float = 3.0,
    mean_burst_s: float = 180.0,
    mean_gap_s: float = 600.0,
    ramp_s: float = 0.0,
    mix: LengthMix = MIXES["chat"],
    seed: int = 0,
) -> list[TraceRequest]:
    """Base rate with bursts of ``burst_factor`` x base; burst and gap lengths are exponential.

    ``ramp_s`` > 0: each burst's rate climbs linearly to its level over that long (and falls back
    likewise) instead of jumping.
    """
    rng = random.Random(seed)
    edges = burst_edges(rng, duration_s, mean_burst_s, mean_gap_s)

    def rate_at(t: float) -> float:
        # Odd number of edges passed: inside a burst.
        passed = bisect_right(edges, t)
        level = 1.0 if passed % 2 else 0.0
        if ramp_s > 0 and passed:
            since = t - edges[passed - 1]
            if since < ramp_s:  # still climbing towards (or falling from) the new level
                level = since / ramp_s if passed % 2 else 1 - since / ramp_s
        return base_rps * (1.0 + (burst_factor - 1.0) * level)

    return _with_lengths(_arrivals(rate_at, base_rps * max(burst_factor, 1.0), duration_s, rng), mix, rng)


def burst_edges(rng: random.Random, duration_s: float, mean_burst_s: float, mean_gap_s: float) -> list[float]:
    """Alternating gap and burst lengths, as the times they end: a burst runs from an odd edge to the next.
    ``bursty`` draws them first from its seed's generator, so the same draws from ``random.Random(seed)`` say
    where a trace's bursts are."""
    edges, t, in_burst = [], 0.0, False
    while t < duration_s:
        t += rng.expovariate(1 / (mean_burst_s if in_burst else mean_gap_s))
        edges.append(t)
        in_burst = not in_burst
    return edges


def diurnal(
    trough_rps: float,
    peak_rps: float,
    duration_s: float,
    period_s: float = 86400.0,
    mix: LengthMix = MIXES["chat"],
    seed: int = 0,
) -> list[TraceRequest]:
    """Rate from ``trough_rps`` (at t=0) up to ``peak_rps`` (at period/2) and back, as a raised cosine."""

    def rate_at(t: float) -> float:
        return trough_rps + (peak_rps - trough_rps) * (1 - math.cos(2 * math.pi * t / period_s)) / 2

    return shaped(rate_at, max(peak_rps, trough_rps), duration_s, mix, seed)


def write_trace(requests: Iterable[TraceRequest], path: str | os.PathLike[str]) -> int:
    n = 0
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"t": r.t, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}) + "\n")
            n += 1
    return n


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read file: {e.strerror}") from e
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            request = TraceRequest(float(raw["t"]), int(raw["prompt_tokens"]), int(raw["output_tokens"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(
                f'{path}:{number}: expected {{"t": seconds, "prompt_tokens": n, "output_tokens": m}} ({e})'
            ) from e
        if request.t < 0 or request.prompt_tokens < 1 or request.output_tokens < 1:
            raise TraceError(f"{path}:{number}: t must be >= 0 and token counts >= 1 (got {line.strip()})")
        out.append(request)
    if not out:
        raise TraceError(f"{path}: no requests")
    return out
