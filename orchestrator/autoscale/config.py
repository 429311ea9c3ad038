"""The autoscaler's settings (a cluster spec's ``autoscaling`` section), defined once.

``AutoscalingConfig`` is what the policy (``orchestrator.autoscale.policy``),
the actuator and ``pdserve simulate`` read; the cluster spec embeds it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.wire import ROLES
from orchestrator.errors import FieldError


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolLimits(_Settings):
    """How small and how large the autoscaler may make one pool."""

    min: int = Field(default=1, ge=1, description="Fewest engines the autoscaler keeps in this pool.")
    max: int = Field(ge=1, description="Most engines the autoscaler may run in this pool.")


class LatencyTargets(_Settings):
    """What the autoscaler sizes the pools for."""

    ttft_p90_s: float = Field(gt=0, description="Target p90 time to first token, in seconds.")
    itl_p90_s: float = Field(gt=0, description="Target p90 inter-token latency (a request's mean gap), in seconds.")


class ScheduleEntry(_Settings):
    """The arrival rate expected on some days between two times of day."""

    rps: float = Field(ge=0, description="Requests per second expected then.")
    start: str = Field(default="00:00", pattern=r"^([01]\d|2[0-3]):[0-5]\d$", description="From (HH:MM).")
    end: str = Field(
        default="00:00",
        pattern=r"^([01]\d|2[0-3]):[0-5]\d$",
        description="Until (HH:MM; 00:00 is midnight, an end before the start runs past midnight).",
    )
    days: list[Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]] = Field(
        default=["mon", "tue", "wed", "thu", "fri", "sat", "sun"], min_length=1, description="On these days."
    )


class AutoscalingConfig(_Settings):
    """Sizes of both pools chosen from load (orchestrator.autoscale.policy); absent: fixed replicas."""

    prefill: PoolLimits = Field(description="Replica range of the prefill pool.")
    decode: PoolLimits = Field(description="Replica range of the decode pool.")
    max_engines: int = Field(ge=2, description="Engines both pools may have together (the budget).")
    targets: LatencyTargets = Field(description="Latency targets the autoscaler sizes the pools for.")
    profile: str | None = Field(
        default=None,
        description="Performance profile file of the engines (orchestrator.autoscale.profile); "
        "a relative path is relative to the spec file.",
    )
    interval_s: float = Field(default=30.0, gt=0, description="Seconds between two scaling decisions.")
    scale_up_cooldown_s: float = Field(
        default=0.0,
        ge=0,
        description="A pool grows again only this long after its last change (0: at the next decision; "
        "engines still starting count as provisioned, so growing again asks only for what is missing).",
    )
    scale_down_cooldown_s: float = Field(
        default=300.0,
        ge=0,
        description="A pool shrinks only this long after its last change, and never below its largest "
        "wish over this window.",
    )
    hysteresis: float = Field(
        default=0.1, ge=0, lt=1, description="A pool shrinks only to free more than this fraction of it."
    )
    burst_guard: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A pool shrinks only to its demand plus this share of the largest rise of demand within "
        "burst_memory_s (the next burst finds that much already serving; 0: off).",
    )
    burst_memory_s: float = Field(
        default=1800.0, ge=0, description="How long a rise of demand is remembered by burst_guard."
    )
    target_utilization: float = Field(
        default=0.8, gt=0, le=1, description="Fraction of the largest ITL-safe decode batch each engine is given."
    )
    keep_warm_s: float = Field(
        default=0.0,
        ge=0,
        description="An engine the autoscaler retired stays up this long once drained, idle and out of the "
        "proxy's pool: a scale-up meanwhile takes it back at once instead of starting one (0: stopped once "
        "drained). It counts against max_engines: a scale-up that needs its room stops it.",
    )

    schedule: list[ScheduleEntry] | None = Field(
        default=None,
        description="Arrival rates expected by time of day and weekday (the first entry that covers a time "
        "gives its rate): the autoscaler sizes the pools a start-up ahead for them, trusting the schedule as "
        "far as the measured rate has matched it.",
    )
    schedule_utc_offset_h: float = Field(
        default=0.0, ge=-12, le=14, description="The schedule's times are this many hours east of UTC."
    )
    learn_season: bool = Field(
        default=False,
        description="Learn the daily and weekly season of the arrivals (each quarter hour's rate, from two days "
        "or weeks of it on) and size a start-up ahead for it, as for a schedule; kept across controller restarts.",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> AutoscalingConfig:
        for role in ROLES:
            limits = getattr(self, role)
            if limits.min > limits.max:
                raise FieldError(f"{role}.min", f"min {limits.min} is above max {limits.max}")
        mins = self.prefill.min + self.decode.min
        if self.max_engines < mins:
            raise FieldError(
                "max_engines",
                f"budget {self.max_engines} is below the pools' minimums together "
                f"({self.prefill.min} + {self.decode.min} = {mins})",
            )
        return self

    def limits(self, role: str) -> PoolLimits:
        return self.prefill if role == "prefill" else self.decode
