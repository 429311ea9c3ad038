"""The simulator's data model: its inputs (``SloTargets``, ``SharedCore``, the ``Policy`` it asks), the
engines and requests it moves through a cluster, the kinds of its events, and what a run returns
(``RequestRecord``, ``SimulationResult``).

``orchestrator.autoscale.simulator`` runs them (``Simulator``, ``simulate``), with its collaborators
``sim_scaling`` (the decisions and pool changes) and ``sim_cores`` (engines that share cores). They are plain
records: what an engine or a request does is the simulator's.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.autoscale.observation import ClusterObservation, ScalingDecision

__all__ = [
    "EVEN_SHARE",
    "EngineState",
    "Policy",
    "RequestRecord",
    "SharedCore",
    "SimulationResult",
    "SloTargets",
]

EPS = 1e-9
# Event kinds, in the order simultaneous events are handled.
READY, PREFILL_DONE, TRANSFER_DONE, DECODE_DONE, ARRIVAL, DECIDE, SPIN_END, WARM_END, MOVED = range(9)


@dataclass(slots=True, frozen=True)
class SharedCore:
    """How many times slower than alone an engine works beside one busy engine on its core
    (``lab/probe_shared_start.py`` and ``lab/probe_decode_pair.py`` measure it on a CPU cluster), and
    beside one that is starting. The default splits a core evenly between the engines busy on it and
    leaves a start-up, and the work beside one, alone."""

    prefill: float = 2.0  # a prefill pass
    decode: float = 2.0  # a decode step (beside a busy prefill engine; beside a decode engine too, unless:)
    startup: float = 1.0  # from "start" to "serves", over the profile's startup_s (a start with the cluster)
    decode_beside_start: float = 1.0  # a decode step while a neighbour loads its model
    prefill_beside_start: float = 1.0  # a prefill pass while a neighbour loads its model
    # A decode step beside a busy decode engine; None: as beside any busy engine (``decode``). Two engines
    # that step in turn leave each other the core while each waits between its steps.
    decode_beside_decode: float | None = None
    # A prefill pass / decode step while an engine on another core computes (the cores share the host:
    # its memory, its caches, and the processes no core is pinned for); lab/probe_host_load.py --other-core.
    host_prefill: float = 1.0
    host_decode: float = 1.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None and getattr(self, f.name) < 1.0:
                raise ValueError(f"SharedCore.{f.name} must be 1 or more (got {getattr(self, f.name)})")


EVEN_SHARE = SharedCore()


class Policy(Protocol):
    def decide(self, obs: ClusterObservation) -> ScalingDecision: ...


class EngineState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    LEAVING = "leaving"  # moving away: out of its pool's routing, finishing its work there
    MOVING = "moving"  # the same engine in its new pool, counted there (rules.MOVING), until it serves
    STOPPED = "stopped"


PROVISIONED = (EngineState.STARTING, EngineState.SERVING, EngineState.MOVING)  # a pool's size (rules.SERVING)
ARRIVING = (EngineState.STARTING, EngineState.MOVING)  # counted in a pool, not serving in it yet
NOT_COUNTED = (EngineState.STOPPED, EngineState.LEAVING)  # a leaving engine is counted as its successor


@dataclass(slots=True, frozen=True)
class SloTargets:
    ttft_s: float
    itl_s: float


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    prefill_left: int
    first_token: float = -1.0
    done: float = -1.0
    start_step: float = 0.0
    kv_holder: PrefillEngine | None = None  # the prefill engine holding its KV until the decode side read it


@dataclass(slots=True, eq=False)
class Engine:
    replica: int
    started: float
    state: EngineState
    stopped: float = -1.0
    spins_until: float = -1.0  # when its worker stops polling after its last pass or step (sim_cores.SPIN_S)
    warm_until: float = -1.0  # drained and kept warm until then (keep_warm_s); -1: not kept warm
    cores_id: str = ""  # the engine id its cores are pinned for, when it moved here from the other pool
    # A move: the LEAVING engine of the old pool and its MOVING successor in the new point to each other.
    twin: Engine | None = None

    def hours(self, end: float) -> float:
        stop = min(self.stopped if self.stopped >= 0 else end, end)
        return max(0.0, stop - self.started) / 3600


@dataclass(slots=True, eq=False)
class PrefillEngine(Engine):
    queue: deque[Request] = field(default_factory=deque)
    queued_tokens: int = 0
    busy: bool = False
    # What vLLM's waiting gauge shows (requests, prompt tokens): those its last pass left unscheduled. One
    # that arrives during a pass reaches the scheduler only when the pass ends, and is scheduled then.
    gauge_waiting: tuple[int, int] = (0, 0)
    unread: int = 0  # requests it prefilled whose KV no decode engine has read yet (it holds their blocks)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.busy


@dataclass(slots=True, eq=False)
class DecodeEngine(Engine):
    waiting: deque[Request] = field(default_factory=deque)
    waiting_kv: int = 0
    transferring: int = 0
    running: list[tuple[float, int, Request]] = field(default_factory=list)  # heap by finish step
    kv_used: int = 0
    steps: float = 0.0  # decode steps done so far (fractional between events)
    t_ref: float = 0.0
    step_s: float = 0.0
    sum_prompt: int = 0
    sum_start: float = 0.0
    version: int = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.transferring and not self.running


def cores_id_of(engine: Engine) -> str:
    """The engine id ``engine``'s cores are pinned for (``prefill-0`` ..., as ``orchestrator.launch`` pins them):
    its own, or the one it moved here from."""
    role = "prefill" if isinstance(engine, PrefillEngine) else "decode"
    return engine.cores_id or f"{role}-{engine.replica}"


@dataclass(slots=True, frozen=True)
class RequestRecord:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: float  # mean inter-token latency; 0 for one-token outputs
    done: float


@dataclass(slots=True)
class SimulationResult:
    records: list[RequestRecord]
    targets: SloTargets
    duration_s: float  # arrival of the first request to completion of the last
    engine_hours: float
    timeline: list[dict[str, Any]]
    # The prefill passes by engine and simulator.PASS_BIN_S of their start: {(replica, bin start): [passes, tokens,
    # sequences, seconds, seconds x sequences]}, to set beside the cluster's engine steps
    # (vllm:iteration_tokens_total) and prefill time per request (vllm:request_prefill_time_seconds).
    prefill_passes: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    @property
    def good(self) -> int:
        t = self.targets
        return sum(1 for r in self.records if r.ttft_s <= t.ttft_s and r.itl_s <= t.itl_s)

    def summary(self) -> dict[str, Any]:
        n, good = len(self.records), self.good
        ttft = sorted(r.ttft_s for r in self.records)
        itl = sorted(r.itl_s for r in self.records)
        return {
            "requests": n,
            "slo_attainment": good / n if n else 0.0,
            "goodput_rps": good / self.duration_s if self.duration_s > 0 else 0.0,
            "engine_hours": self.engine_hours,
            "goodput_per_engine_hour": good / self.engine_hours if self.engine_hours > 0 else 0.0,
            "duration_s": self.duration_s,
            "ttft_p50_s": quantile(ttft, 0.5),
            "ttft_p90_s": quantile(ttft, 0.9),
            "itl_p50_s": quantile(itl, 0.5),
            "itl_p90_s": quantile(itl, 0.9),
            "targets": {"ttft_p90_s": self.targets.ttft_s, "itl_p90_s": self.targets.itl_s},
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "timeline": self.timeline}


def quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def new_window() -> dict[str, Any]:
    """The tallies of one decision interval, which the next decision's ``ClusterObservation`` is made of."""
    return {
        "arrivals": 0,
        "prefilled": 0,
        "prompt": 0,
        "prompt_sq": 0,
        "finished": 0,
        "ttft": [],
        "itl": [],
    }
