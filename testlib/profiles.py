"""Made-up performance profiles and policies for simulator tests: a profile of given prefill and decode speeds
with free transfers, a Poisson trace, a policy that asks for the sizes it is given."""

from __future__ import annotations

import random

from orchestrator.autoscale.observation import ClusterObservation, ScalingDecision
from orchestrator.autoscale.profile import EngineLimits, Grid1D, Grid2D, PerformanceProfile
from orchestrator.autoscale.sim_model import SloTargets
from orchestrator.autoscale.traces import TraceRequest

TARGETS = SloTargets(ttft_s=1e9, itl_s=1e9)
INSTANT = 1e-6


def make_profile(
    prefill_s_per_token: float = 0.001,
    decode_step: tuple[float, float] = (INSTANT, INSTANT),
    max_num_seqs: int = 1,
    startup_s: float = 0.0,
) -> PerformanceProfile:
    """Prefill time = tokens x ``prefill_s_per_token``; decode step = a + b x (batch - 1); free transfers."""
    a, b = decode_step
    return PerformanceProfile(
        name="test",
        provenance="test",
        engine=EngineLimits(max_num_seqs, 10**9, 10**9, 1, startup_s),
        prefill=Grid2D([1.0, 1e6], [1.0, 2.0], [[prefill_s_per_token] * 2, [1e6 * prefill_s_per_token] * 2]),
        decode=Grid2D([1.0, 1e6], [1.0, 2.0], [[a, a], [a + b * (1e6 - 1), a + b * (1e6 - 1)]]),
        transfer=Grid1D([1.0, 2.0], [0.0, 0.0]),
    )


def poisson_trace(rate: float, n: int, prompt, output=lambda rng: 1, seed: int = 7) -> list[TraceRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, prompt(rng), output(rng)))
    return out


class Script:
    """A policy that asks for the sizes it is given, one per decision."""

    def __init__(self, sizes: list[tuple[int, int]]) -> None:
        self.sizes = sizes
        self.seen: list[ClusterObservation] = []

    def decide(self, obs: ClusterObservation) -> ScalingDecision:
        self.seen.append(obs)
        prefill, decode = self.sizes[min(len(self.seen) - 1, len(self.sizes) - 1)]
        return ScalingDecision(obs.t, prefill, decode)
