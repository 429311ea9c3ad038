"""What an autoscaling policy reads and what it answers.

Every ``interval_s`` the caller builds a ``ClusterObservation`` of the last window: the actuator from a
cluster's metrics (``orchestrator.autoscale.actuator``), the simulator from its model
(``orchestrator.autoscale.sim_scaling``). A policy (``orchestrator.autoscale.policy``) answers with a
``ScalingDecision``: the two pools' target sizes and the reasons, one line per step of its arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ClusterObservation", "PoolObservation", "ScalingDecision"]


@dataclass(slots=True)
class PoolObservation:
    """One pool as the proxy and its engines see it at decision time."""

    replicas: int  # engines serving (not starting, not draining)
    starting: int = 0  # engines asked for and not serving yet
    queue_depth: int = 0  # requests waiting for this pool (not yet being computed)
    queued_tokens: int = 0  # their prompt tokens (prefill) or KV tokens (decode)
    running: int = 0  # requests being computed
    kv_cache_usage: float = 0.0  # mean fraction of the engines' KV cache in use (0-1)

    @property
    def provisioned(self) -> int:
        return self.replicas + self.starting


@dataclass(slots=True)
class ClusterObservation:
    """Load over the last window (usually one decision interval) and the pools now."""

    t: float  # seconds, on the caller's clock
    arrival_rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    prefill: PoolObservation
    decode: PoolObservation
    ttft_p90_s: float | None = None  # measured over the window; None when no request finished one
    itl_p90_s: float | None = None
    prompt_tokens_cv2: float = 1.0  # variance / mean^2 of the window's prompt lengths (1: as exponential)
    clock_s: float | None = None  # the window's end as epoch seconds (a schedule's and a season's clock)

    def pool(self, role: str) -> PoolObservation:
        return self.prefill if role == "prefill" else self.decode


@dataclass(slots=True)
class ScalingDecision:
    """What the pools should have: the actuator starts or drains engines to reach it."""

    t: float
    prefill: int
    decode: int
    reasons: list[str] = field(default_factory=list)

    def target(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode
