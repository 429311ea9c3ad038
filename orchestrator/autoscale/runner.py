"""Simulate a cluster spec: the glue ``pdserve simulate`` and the lab (lab/autoscale_study.py,
lab/validate_simulator.py) share.

``parse_policy("autoscale" | "static:P,D")`` names a policy; ``simulate_spec`` runs
a trace through the spec's cluster under it, with the spec's ``autoscaling``
targets, interval and starting replicas.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator import placement
from orchestrator.autoscale.policy import AutoscalePolicy, StaticPolicy
from orchestrator.autoscale.profile import PerformanceProfile, load_profile
from orchestrator.autoscale.sim_model import EVEN_SHARE, Policy, SharedCore, SimulationResult, SloTargets
from orchestrator.autoscale.simulator import SimOptions, simulate
from orchestrator.autoscale.traces import TraceRequest
from orchestrator.errors import PdserveError
from orchestrator.spec import ClusterSpec

__all__ = [
    "SimulationSetupError",
    "load_spec_and_profile",
    "moves_allowed",
    "parse_policy",
    "shared_cores",
    "simulate_spec",
]


class SimulationSetupError(PdserveError):
    """The spec, profile or policy named for a simulation cannot be used."""


def parse_policy(text: str) -> tuple[int, int] | None:
    """``"autoscale"`` -> None; ``"static:P,D"`` -> (P, D)."""
    if text == "autoscale":
        return None
    kind, _, split = text.partition(":")
    parts = split.split(",")
    if kind != "static" or len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SimulationSetupError(f"--policy must be 'autoscale' or 'static:P,D' (got {text!r})")
    prefill, decode = (int(p) for p in parts)
    if prefill < 1 or decode < 1:
        raise SimulationSetupError(f"a static split needs at least one engine per pool (got {text!r})")
    return prefill, decode


def load_spec_and_profile(
    config: str | os.PathLike[str], profile: str | os.PathLike[str] | None = None, model: str | None = None
) -> tuple[ClusterSpec, PerformanceProfile]:
    """The spec's view of ``model`` (None: its one model) and the profile its autoscaler would use."""
    spec = ClusterSpec.from_file(config).view(model)
    if spec.autoscaling is None:
        raise SimulationSetupError(f"{config}: has no 'autoscaling' section (targets, limits and the profile)")
    path = Path(profile) if profile else spec.profile_path(config)
    if path is None:
        raise SimulationSetupError(f"{config}: autoscaling.profile is not set and no --profile was given")
    return spec, load_profile(path)


def simulate_spec(
    spec: ClusterSpec,
    profile: PerformanceProfile,
    trace: list[TraceRequest],
    static: tuple[int, int] | None,
    start: tuple[int, int] | None = None,
    cores: dict[str, frozenset[tuple[int, int]]] | None = None,
    policy: Policy | None = None,
    shared: SharedCore = EVEN_SHARE,
    first_decision_s: float | None = None,
    moves: bool = True,
    start_clock_s: float = 0.0,
) -> SimulationResult:
    """Run ``trace`` under the autoscaler (``static`` None) or a fixed ``static`` = (prefill, decode) split,
    or under ``policy`` when given (a study's own, with ``static`` None). The autoscaler (or ``policy``)
    starts with ``start`` engines serving (default: the spec's replicas); ``cores``: the engines' shared
    cores as a cluster ran them (default: the plan the spec makes now, ``shared_cores``), and ``shared`` how
    much a busy neighbour on a core slows an engine (``SharedCore``); ``first_decision_s``: when the
    policy first decides (default: one interval in); ``moves``: engines move between the pools where the spec
    allows it (``ClusterSpec.move_problem``), as the controller moves them; False: never (``--no-moves``);
    ``start_clock_s``: the trace's start as epoch seconds (the clock of the spec's ``schedule``)."""
    scaling = spec.autoscaling
    if scaling is None:
        raise SimulationSetupError("the spec has no 'autoscaling' section")
    targets = SloTargets(scaling.targets.ttft_p90_s, scaling.targets.itl_p90_s)
    if static is not None:
        if sum(static) > scaling.max_engines:
            raise SimulationSetupError(
                f"static:{static[0]},{static[1]} uses {sum(static)} engines, over max_engines {scaling.max_engines}"
            )
        policy, initial = StaticPolicy(*static), static
    else:
        # From the spec's sizes it starts cold; from ``start`` (a split sized for the load), it does not.
        policy = policy or AutoscalePolicy(scaling, profile, moves=moves_allowed(spec, moves), cold_start=start is None)
        initial = start or (spec.prefill.replicas, spec.decode.replicas)
    routing = (spec.proxy.routing.prefill, spec.proxy.routing.decode)
    options = SimOptions(
        interval_s=scaling.interval_s,
        cores=cores or shared_cores(spec),
        routing=routing,
        shared=shared,
        first_decision_s=first_decision_s,
        keep_warm_s=scaling.keep_warm_s if static is None else 0.0,
        max_engines=scaling.max_engines,
        moves=moves_allowed(spec, moves),
        start_clock_s=start_clock_s,
    )
    return simulate(profile, policy, trace, targets, initial, options)


def moves_allowed(spec: ClusterSpec, moves: bool = True) -> bool:
    """Whether engines move between the pools: ``moves`` asked for and the spec allows it."""
    return moves and spec.move_problem() is None


def shared_cores(spec: ClusterSpec) -> dict[str, frozenset[tuple[int, int]]] | None:
    """For a CPU spec whose engines share cores (``resources.share_cores``): each engine's cores as
    ``orchestrator.launch`` pins them, as (placement domain, core), every domain taken as one machine;
    else None (each engine has its cores to itself)."""
    if spec.device != "cpu" or not spec.resources.share_cores:
        return None
    from orchestrator.launch import host_core_ranges

    cores: dict[str, frozenset[tuple[int, int]]] = {}
    for domain, roles in enumerate(placement.placement_domains(spec).values()):
        for engine_id, ranks in host_core_ranges(spec, roles).items():
            cores[engine_id] = frozenset((domain, core) for rank in ranks.split("|") for core in _cores_of(rank))
    return cores


def _cores_of(binding: str) -> list[int]:
    """``"0-3"`` or ``"0,2"`` (one rank's OpenMP binding) as core numbers."""
    if "-" in binding:
        first, last = binding.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(core) for core in binding.split(",")]
