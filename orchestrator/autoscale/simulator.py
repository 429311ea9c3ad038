"""A discrete-event model of a pdserve cluster, to judge scaling policies on traces.

A request's life, as modelled (times from the performance profile):

1. It arrives at the proxy, which sends it to the serving prefill engine with the
   fewest prompt tokens queued (or holds it while no prefill engine serves).
2. The prefill engine computes its queue in order, in passes of at most
   ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences (chunked
   prefill: a long prompt spans passes, a pass may hold several prompts).
3. When its prompt is done the proxy sends it to the serving decode engine with
   the least KV cache promised. The decode engine admits it when a batch slot
   and KV room for prompt + output tokens are free (waiting until then), then
   its KV cache moves over and the hand-off's fixed cost passes (``handoff_seconds``:
   the transfer plus the profile's ``handoff_s``). As in vLLM, a busy decode engine
   starts the load only when its step in progress ends, and takes the loaded request
   into its batch only at the end of the step in which the load finished.
4. It joins the decode batch (continuous batching); each step emits one token
   for every sequence in the batch and lasts ``decode_step_seconds(batch, mean
   context)``. TTFT is arrival to the end of its first step; ITL is the mean gap
   between its later tokens.

Decode is advanced in stretches rather than step by step: between two changes
of a batch (a join or a finish) every step lasts the same, so the engine keeps a
fractional step counter and the next finish is computed, not stepped to.

Every ``interval_s`` the policy gets a ``ClusterObservation`` of the last
interval and returns target counts; the first time at ``first_decision_s`` (by default one
interval in; on a cluster, where the controller's clock ticks into the trace). Its prefill
queue is what the controller reads off a cluster, vLLM's waiting gauge: the requests an
engine's last pass left unscheduled (one that arrived during the pass is scheduled when it
ends, unseen).
New engines serve after ``startup_s``; removed ones stop taking requests and stop
once their own work is done (drain). Which engines start and which retire follows the controller's rules
(``orchestrator.autoscale.rules``): the newest retire first, and a scale-up
takes back draining engines (serving again at once) before it starts new ones.
With ``moves`` (the spec's ``role_moves``, pools of one shape: ``ClusterSpec.move_problem``) a decision
that grows one pool while it shrinks the other is made by moves first, as the controller makes it
(``rules.moves_for``, ``rules.move_order``): the shrinking pool's serving engines move, newest first, keeping
their replica numbers and cores. A moving engine takes no new work in its old pool and counts towards its
new pool from the decision on (as one starting); it finishes its old work (a prefill engine also waits
until every KV it computed has been read: until its requests' loads on the decode engines are done), then
serves in the new pool the profile's ``move_s`` later. A retirement that picks a moving engine calls the
move off: it drains in its old pool. The rest of the decision is starts and retirements, as without moves;
a pool that grows moves in the other pool's draining (or kept-warm) engines before it starts any.
With ``keep_warm_s`` (``autoscaling.keep_warm_s``) a drained engine stays up that long,
idle and takeable, while the targets and the engines kept warm fit ``max_engines``
(as the controller's ``_retire``). Engine-hours count every engine from start to stop,
starting, draining and kept warm included.
The proxy's routing policy of each pool (``routing``, the spec's ``proxy.routing``):
each policy is modelled as its entry of ``proxy.policies.REGISTRY`` says (``simulated_as``):
in turn (``round_robin``), or to the lowest of the proxy's score (its legs on the engine plus
vLLM's waiting gauge, plus KV use on decode), ties going round as the proxy's do
(``least_loaded``, and ``prefix_aware``: prefixes are not modelled); a policy the registry
gives no model is refused by name.

Engines that share CPU cores (``cores``: each engine's cores by id, ``prefill-0``
..., as ``orchestrator.launch`` pins them; a CPU cluster with
``resources.share_cores``) share their speed: a prefill pass or a decode step
takes the profile's time (measured with the engine's cores to itself) times
``1 + (s - 1) * n``, ``n`` the other engines busy at once on its most crowded core
and ``s`` how much slower it works beside one busy engine (``SharedCore``, by
role; by default 2: the core split evenly, which makes the factor the number of
busy engines). An engine counts as busy for ``SPIN_S`` (1 s) after its last pass
or step: vLLM's worker polls its queue that long before it sleeps, and takes its
share of the core meanwhile. A decode engine's step is re-timed whenever a
neighbour starts work or stops polling; a pass in flight keeps the time it
started with. A new engine's start-up is stretched the same way (``SharedCore.startup``,
by default 1: not at all) by the neighbours busy when it begins, and a start-up slows the
decode steps beside it while it lasts (``SharedCore.decode_beside_start``, by default 1).
An engine also works ``SharedCore.host_prefill`` / ``host_decode`` times slower while an
engine on none of its cores computes (the host's memory and caches, and the processes no
core is pinned for, are shared; by default 1).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.autoscale.policy import ClusterObservation, PoolObservation, ScalingDecision
from orchestrator.autoscale.profile import PerformanceProfile
from orchestrator.autoscale.rules import (
    move_order,
    moves_for,
    new_replicas,
    retirement_order,
    take_back_order,
    warm_room,
    warm_to_stop,
)
from orchestrator.autoscale.traces import TraceRequest
from proxy.policies import simulated_as

logger = logging.getLogger(__name__)

__all__ = [
    "EVEN_SHARE",
    "Policy",
    "RequestRecord",
    "SharedCore",
    "SimulationResult",
    "Simulator",
    "SloTargets",
    "simulate",
]

_EPS = 1e-9
# Event kinds, in the order simultaneous events are handled.
_READY, _PREFILL_DONE, _TRANSFER_DONE, _DECODE_DONE, _ARRIVAL, _DECIDE, _SPIN_END, _WARM_END, _MOVED = range(9)
# vLLM's worker keeps polling its shared-memory queue for this long after its last message before it
# sleeps on a socket (``SpinCondition``'s ``busy_loop_s``, vllm.distributed.device_communicators.shm_broadcast):
# an engine that just finished a pass or step keeps its core busy this much longer.
SPIN_S = 1.0
PASS_BIN_S = 10  # SimulationResult.prefill_passes' bins
_NO_CORES: frozenset[Any] = frozenset()
# The events that never change which engines serve in a pool (the per-request ones): ``_pick`` keeps each
# pool's serving engines (``_serving``) across them, and drops them after any other event (an event kind added
# later is then safe by default) and in ``_serve_pending``, which routes as soon as an engine serves.
_KEEP_SERVING = frozenset({_ARRIVAL, _PREFILL_DONE, _TRANSFER_DONE, _DECODE_DONE, _SPIN_END})


@dataclass(slots=True, frozen=True)
class SharedCore:
    """How many times slower than alone an engine works beside one busy engine on its core
    (``lab/probe_shared_start.py`` measures it on a CPU cluster), and a decode step beside one that
    is starting. The default splits a core evenly between the engines busy on it and leaves a start-up,
    and a decode step beside one, alone."""

    prefill: float = 2.0  # a prefill pass
    decode: float = 2.0  # a decode step
    startup: float = 1.0  # from "start" to "serves", over the profile's startup_s (a start with the cluster)
    decode_beside_start: float = 1.0  # a decode step while a neighbour loads its model
    # A prefill pass / decode step while an engine on another core computes (the cores share the host:
    # its memory, its caches, and the processes no core is pinned for); lab/probe_host_load.py --other-core.
    host_prefill: float = 1.0
    host_decode: float = 1.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1.0:
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


_PROVISIONED = (EngineState.STARTING, EngineState.SERVING, EngineState.MOVING)  # a pool's size (rules.SERVING)
_ARRIVING = (EngineState.STARTING, EngineState.MOVING)  # counted in a pool, not serving in it yet
_NOT_COUNTED = (EngineState.STOPPED, EngineState.LEAVING)  # a leaving engine is counted as its successor


@dataclass(slots=True, frozen=True)
class SloTargets:
    ttft_s: float
    itl_s: float


@dataclass(slots=True, eq=False)
class _Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    prefill_left: int
    first_token: float = -1.0
    done: float = -1.0
    start_step: float = 0.0
    kv_holder: _PrefillEngine | None = None  # the prefill engine holding its KV until the decode side read it


@dataclass(slots=True, eq=False)
class _Engine:
    replica: int
    started: float
    state: EngineState
    stopped: float = -1.0
    spins_until: float = -1.0  # when its worker stops polling after its last pass or step (SPIN_S)
    warm_until: float = -1.0  # drained and kept warm until then (keep_warm_s); -1: not kept warm
    cores_id: str = ""  # the engine id its cores are pinned for, when it moved here from the other pool
    # A move: the LEAVING engine of the old pool and its MOVING successor in the new point to each other.
    twin: _Engine | None = None

    def hours(self, end: float) -> float:
        stop = min(self.stopped if self.stopped >= 0 else end, end)
        return max(0.0, stop - self.started) / 3600


@dataclass(slots=True, eq=False)
class _PrefillEngine(_Engine):
    queue: deque[_Request] = field(default_factory=deque)
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
class _DecodeEngine(_Engine):
    waiting: deque[_Request] = field(default_factory=deque)
    waiting_kv: int = 0
    transferring: int = 0
    running: list[tuple[float, int, _Request]] = field(default_factory=list)  # heap by finish step
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
    # The prefill passes by engine and PASS_BIN_S of their start: {(replica, bin start): [passes, tokens,
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
            "ttft_p50_s": _quantile(ttft, 0.5),
            "ttft_p90_s": _quantile(ttft, 0.9),
            "itl_p50_s": _quantile(itl, 0.5),
            "itl_p90_s": _quantile(itl, 0.9),
            "targets": {"ttft_p90_s": self.targets.ttft_s, "itl_p90_s": self.targets.itl_s},
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.summary(), "timeline": self.timeline}


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Simulator:
    """One run: build it, then ``run(trace)``. Deterministic: the same inputs give the same result."""

    def __init__(
        self,
        profile: PerformanceProfile,
        policy: Policy,
        targets: SloTargets,
        initial: tuple[int, int],
        interval_s: float = 30.0,
        startup_s: float | None = None,
        cores: dict[str, frozenset[Any]] | None = None,
        spin_s: float = SPIN_S,
        routing: tuple[str, str] = ("least_loaded", "least_loaded"),
        shared: SharedCore = EVEN_SHARE,
        first_decision_s: float | None = None,
        keep_warm_s: float = 0.0,
        max_engines: int | None = None,
        moves: bool = False,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 (got {interval_s})")
        if first_decision_s is not None and not 0 < first_decision_s <= interval_s:
            raise ValueError(f"first_decision_s must be in (0, interval_s] (got {first_decision_s})")
        self.first_decision_s = interval_s if first_decision_s is None else first_decision_s
        # The proxy's policy per pool, as its registry says the simulator models it (proxy.policies): in turn,
        # or the least loaded; a policy it cannot model is refused by name.
        self._in_turn = tuple(simulated_as(policy) == "in_turn" for policy in routing)
        self._turns = (itertools.count(), itertools.count())  # the proxy's pick counter per pool
        self._serving: list[list | None] = [None, None]  # each pool's serving engines, kept by _pick
        self.profile, self.policy, self.targets = profile, policy, targets
        self.interval_s = interval_s
        self.cores = cores or {}
        self.spin_s = spin_s
        self.shared = shared
        self.keep_warm_s, self.max_engines = keep_warm_s, max_engines
        self.moves = moves
        self.startup_s = profile.engine.startup_s if startup_s is None else startup_s
        self.now = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.prefill: list[_PrefillEngine] = []
        self.decode: list[_DecodeEngine] = []
        self._proxy_queue: deque[_Request] = deque()  # no prefill engine serving
        self._decode_pending: deque[_Request] = deque()  # no decode engine serving
        self._records: list[RequestRecord] = []
        self._in_flight = 0
        self._window: dict[str, Any] = self._new_window()
        self._finished_output = 0  # output tokens of the finished requests so far
        self._generated_mark = 0.0  # the decode engines' generated tokens (_generated) at the last decision
        self._last_means = (1.0, 1.0)
        self._last_cv2 = 1.0
        self.timeline: list[dict[str, Any]] = []
        self._passes: dict[tuple[int, int], list[float]] = {}
        self.prefill.extend(_PrefillEngine(n, 0.0, EngineState.SERVING) for n in range(initial[0]))
        self.decode.extend(_DecodeEngine(n, 0.0, EngineState.SERVING) for n in range(initial[1]))
        self.policy_targets = sum(initial)  # the pools' targets together, as the last decision set them

    # --- event plumbing -----------------------------------------------------------------------

    def _at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    # --- engines that share cores -------------------------------------------------------------

    def _cores(self, engine: _Engine) -> frozenset[Any]:
        return self.cores.get(self._cores_id(engine), _NO_CORES) if self.cores else _NO_CORES

    def _share(self, engine: _Engine, slowdown: float, beside_start: float = 1.0, host: float = 1.0) -> float:
        """How many times slower than alone ``engine`` works now: ``1 + (slowdown - 1) * n + (beside_start - 1)
        * m`` on its most crowded core, ``n`` the other engines busy on it (one still polling, too:
        ``SPIN_S``) and ``m`` those starting on it; times ``host`` while an engine on none of its cores
        computes."""
        mine = self._cores(engine)
        if not mine:
            return 1.0
        others = [e for e in itertools.chain(self.prefill, self.decode) if e is not engine]
        busy = [
            self._cores(e)
            for e in others
            if e.state not in (EngineState.STOPPED, EngineState.STARTING)
            and (not e.idle or e.spins_until > self.now + _EPS)
        ]
        starting = [self._cores(e) for e in others if e.state is EngineState.STARTING]
        elsewhere = host != 1.0 and any(not e.idle and not self._cores(e) & mine for e in others)
        return (host if elsewhere else 1.0) * max(
            1.0
            + (slowdown - 1.0) * sum(1 for theirs in busy if core in theirs)
            + (beside_start - 1.0) * sum(1 for theirs in starting if core in theirs)
            for core in mine
        )

    def _went_idle(self, engine: _Engine) -> None:
        """``engine`` has no work left: its neighbours speed up once its worker stops polling."""
        if not self._cores(engine):
            return
        if self.spin_s <= 0:
            self._neighbours_changed(engine)
            return
        engine.spins_until = self.now + self.spin_s
        self._at(engine.spins_until, _SPIN_END, (engine, engine.spins_until))

    def _on_spin_end(self, payload: tuple[_Engine, float]) -> None:
        engine, until = payload
        if engine.spins_until == until and engine.idle:  # not busy again since
            self._neighbours_changed(engine)

    def _neighbours_changed(self, engine: _Engine) -> None:
        """Re-time the decode steps of the engines sharing a core with ``engine`` (it started or ended work),
        and of every other engine on the host where an engine elsewhere slows them (``SharedCore.host_decode``)."""
        mine = self._cores(engine)
        if not mine:
            return
        everywhere = self.shared.host_decode != 1.0
        for other in self.decode:
            if other is not engine and other.running and (everywhere or mine & self._cores(other)):
                self._advance(other)
                self._reschedule(other)

    def run(self, trace: Iterable[TraceRequest]) -> SimulationResult:
        arrivals = iter(sorted(trace, key=lambda r: r.t))
        first = next(arrivals, None)
        if first is None:
            raise ValueError("the trace has no requests")
        t0 = first.t
        self._next_arrival(first)
        self._arrivals = arrivals
        self._at(self.first_decision_s, _DECIDE, None)
        handlers = {
            _ARRIVAL: self._on_arrival,
            _READY: self._on_ready,
            _PREFILL_DONE: self._on_prefill_done,
            _TRANSFER_DONE: self._on_transfer_done,
            _DECODE_DONE: self._on_decode_done,
            _DECIDE: self._on_decide,
            _SPIN_END: self._on_spin_end,
            _WARM_END: self._on_warm_end,
            _MOVED: self._on_moved,
        }
        while self._events:
            t, kind, _, payload = heapq.heappop(self._events)
            self.now = t
            handlers[kind](payload)
            if kind not in _KEEP_SERVING:
                self._serving = [None, None]
        end = max(r.done for r in self._records)
        hours = sum(e.hours(end) for e in self.prefill + self.decode)
        return SimulationResult(self._records, self.targets, end - t0, hours, self.timeline, self._passes)

    def _next_arrival(self, item: TraceRequest | None) -> None:
        if item is not None:
            self._at(item.t, _ARRIVAL, item)

    # --- prefill ------------------------------------------------------------------------------

    def _on_arrival(self, item: TraceRequest) -> None:
        self._next_arrival(next(self._arrivals, None))
        self._window["arrivals"] += 1
        prompt = max(1, item.prompt_tokens)
        req = _Request(len(self._records) + self._in_flight, item.t, prompt, max(1, item.output_tokens), prompt)
        self._in_flight += 1
        self._route_prefill(req)

    def _pick(self, pool: list, role: int, loads: Callable[[list], list[float]]) -> Any:
        """A serving engine of ``pool`` as the proxy's policy for it picks (``proxy.routing``): in turn, or the
        lowest of ``loads`` (the engines' scores, in their order) with ties going to the first from the turn's
        position on (so they rotate)."""
        serving = self._serving[role]
        if serving is None:
            serving = self._serving[role] = [e for e in pool if e.state is EngineState.SERVING]
        if not serving:
            return None
        k = next(self._turns[role]) % len(serving)
        if self._in_turn[role]:
            return serving[k]
        # The lowest load from the turn's position on (index() finds the first of equals): one call per
        # request, the simulator's hottest line, so the loads are rotated as a list rather than indexed.
        scores = loads(serving)
        scores = scores[k:] + scores[:k]
        return serving[(k + scores.index(min(scores))) % len(serving)]

    def _route_prefill(self, req: _Request) -> None:
        best: _PrefillEngine | None = self._pick(self.prefill, 0, _prefill_loads)
        if best is None:
            self._proxy_queue.append(req)
            return
        best.queue.append(req)
        best.queued_tokens += req.prefill_left
        if not best.busy:
            self._start_prefill_pass(best)
            self._neighbours_changed(best)  # it was idle

    def _start_prefill_pass(self, engine: _PrefillEngine) -> None:
        limits = self.profile.engine
        room, chunks = limits.max_num_batched_tokens, []
        for req in engine.queue:
            if room <= 0 or len(chunks) == limits.max_num_seqs:
                break
            chunk = min(req.prefill_left, room)
            chunks.append((req, chunk))
            room -= chunk
        if not chunks:
            return
        left = list(itertools.islice(engine.queue, len(chunks), None))
        engine.gauge_waiting = (len(left), sum(req.prefill_left for req in left))
        tokens = limits.max_num_batched_tokens - room
        engine.busy = True
        share = self._share(engine, self.shared.prefill, host=self.shared.host_prefill)
        seconds = self.profile.prefill_seconds(tokens, len(chunks)) * share
        key = (engine.replica, int(self.now // PASS_BIN_S) * PASS_BIN_S)
        tally = self._passes.setdefault(key, [0, 0, 0, 0.0, 0.0])
        for i, v in enumerate((1, tokens, len(chunks), seconds, seconds * len(chunks))):
            tally[i] += v
        self._at(self.now + seconds, _PREFILL_DONE, (engine, chunks))

    def _on_prefill_done(self, payload: tuple[_PrefillEngine, list[tuple[_Request, int]]]) -> None:
        engine, chunks = payload
        engine.busy = False
        for req, chunk in chunks:
            req.prefill_left -= chunk
            engine.queued_tokens -= chunk
        w = self._window
        while engine.queue and engine.queue[0].prefill_left == 0:
            req = engine.queue.popleft()
            w["prefilled"] += 1
            w["prompt"] += req.prompt
            w["prompt_sq"] += req.prompt**2
            req.kv_holder = engine
            engine.unread += 1
            self._route_decode(req)
        if engine.queue:
            self._start_prefill_pass(engine)
        else:
            engine.gauge_waiting = (0, 0)
            self._went_idle(engine)
            if engine.state is EngineState.DRAINING:
                self._drained(engine)
            elif engine.state is EngineState.LEAVING:
                self._left(engine)

    # --- decode -------------------------------------------------------------------------------

    def _decode_loads(self, engines: list[_DecodeEngine]) -> list[float]:
        """The proxy's least-loaded scores (``proxy.pool.EngineState.load``): an engine's decode legs there,
        vLLM's waiting gauge (requests waiting, their KV loading included), and the KV cache in use (0-1)."""
        capacity = self.profile.engine.kv_capacity_tokens
        return [2 * (len(e.waiting) + e.transferring) + len(e.running) + e.kv_used / capacity for e in engines]

    def _route_decode(self, req: _Request) -> None:
        best: _DecodeEngine | None = self._pick(self.decode, 1, self._decode_loads)
        if best is None:
            self._decode_pending.append(req)
            return
        best.waiting.append(req)
        best.waiting_kv += req.prompt + req.output
        self._admit(best)

    def _admit(self, engine: _DecodeEngine) -> None:
        limits = self.profile.engine
        while engine.waiting:
            req = engine.waiting[0]
            need = req.prompt + req.output
            busy = len(engine.running) + engine.transferring
            fits = engine.kv_used + need <= limits.kv_capacity_tokens or busy == 0
            if busy >= limits.max_num_seqs or not fits:
                return
            engine.waiting.popleft()
            engine.waiting_kv -= need
            engine.kv_used += need
            engine.transferring += 1
            # The KV load starts when the step in progress ends (vLLM's worker starts loads as a step begins).
            delay = self._to_step_end(engine) + self.profile.handoff_seconds(req.prompt)
            self._at(self.now + delay, _TRANSFER_DONE, (engine, req))

    def _to_step_end(self, engine: _DecodeEngine) -> float:
        """Seconds until ``engine``'s step in progress ends; 0 when it steps nothing."""
        if not engine.running or engine.step_s <= 0:
            return 0.0
        self._advance(engine)
        return max(0.0, math.ceil(engine.steps - 1e-6) - engine.steps) * engine.step_s

    def _steps_now(self, engine: _DecodeEngine) -> float:
        """The decode steps ``engine`` has done by now (fractional between events)."""
        if engine.running and engine.step_s > 0:
            return engine.steps + (self.now - engine.t_ref) / engine.step_s
        return engine.steps

    def _advance(self, engine: _DecodeEngine) -> None:
        engine.steps = self._steps_now(engine)
        engine.t_ref = self.now

    def _reschedule(self, engine: _DecodeEngine) -> None:
        engine.version += 1
        n = len(engine.running)
        if not n:
            engine.step_s = 0.0
            return
        context = (engine.sum_prompt + n * engine.steps - engine.sum_start) / n
        share = self._share(engine, self.shared.decode, self.shared.decode_beside_start, self.shared.host_decode)
        engine.step_s = self.profile.decode_step_seconds(n, context) * share
        finish = engine.running[0][0]
        self._at(self.now + max(0.0, finish - engine.steps) * engine.step_s, _DECODE_DONE, (engine, engine.version))

    def _on_transfer_done(self, payload: tuple[_DecodeEngine, _Request]) -> None:
        engine, req = payload
        if req.kv_holder is not None:  # read: the prefill engine frees its blocks
            holder, req.kv_holder = req.kv_holder, None
            holder.unread -= 1
            if holder.state is EngineState.LEAVING:
                self._left(holder)
        wait = self._to_step_end(engine)
        if wait > _EPS:  # the scheduler hears of a finished load, and takes the request in, between steps
            self._at(self.now + wait, _TRANSFER_DONE, payload)
            return
        self._advance(engine)
        engine.transferring -= 1
        req.start_step = engine.steps
        heapq.heappush(engine.running, (engine.steps + req.output, req.rid, req))
        engine.sum_prompt += req.prompt
        engine.sum_start += engine.steps
        self._reschedule(engine)
        req.first_token = self.now + engine.step_s
        self._window["ttft"].append(req.first_token - req.arrival)
        if len(engine.running) == 1:
            self._neighbours_changed(engine)  # it was idle

    def _on_decode_done(self, payload: tuple[_DecodeEngine, int]) -> None:
        engine, version = payload
        if version != engine.version:
            return
        self._advance(engine)
        # This event was timed for the first finish: float rounding must not leave it a hair short.
        engine.steps = max(engine.steps, engine.running[0][0])
        while engine.running and engine.running[0][0] <= engine.steps + 1e-6:
            _, _, req = heapq.heappop(engine.running)
            engine.sum_prompt -= req.prompt
            engine.sum_start -= req.start_step
            engine.kv_used -= req.prompt + req.output
            self._finish(req)
        self._admit(engine)
        self._reschedule(engine)
        if not engine.running:
            self._went_idle(engine)
        if engine.state is EngineState.DRAINING and engine.idle:
            self._drained(engine)
        elif engine.state is EngineState.LEAVING:
            self._left(engine)

    def _finish(self, req: _Request) -> None:
        req.done = self.now
        itl = (req.done - req.first_token) / (req.output - 1) if req.output > 1 else 0.0
        self._records.append(
            RequestRecord(req.arrival, req.prompt, req.output, req.first_token - req.arrival, max(itl, 0.0), req.done)
        )
        w = self._window
        w["itl"].append(itl)
        w["finished"] += 1
        self._finished_output += req.output
        self._in_flight -= 1

    # --- scaling ------------------------------------------------------------------------------

    def _new_window(self) -> dict[str, Any]:
        return {
            "arrivals": 0,
            "prefilled": 0,
            "prompt": 0,
            "prompt_sq": 0,
            "finished": 0,
            "ttft": [],
            "itl": [],
        }

    def _generated(self) -> float:
        """Output tokens the decode engines generated so far, as vLLM's ``vllm:generation_tokens_total`` counts
        them (one a step for each running sequence): the finished requests' and the running ones' steps so far."""
        running = sum(len(e.running) * self._steps_now(e) - e.sum_start for e in self.decode if e.running)
        return self._finished_output + running

    def _observe(self) -> ClusterObservation:
        # The means as a cluster's counters give them: prompt tokens of the requests whose prefill finished in
        # the window; output tokens the decode engines generated in the window (vLLM counts them at each step,
        # running requests' too) per request finished in it; the last known means hold through a window without.
        w = self._window
        mean_prompt, mean_output = self._last_means
        if w["prefilled"]:
            mean_prompt = w["prompt"] / w["prefilled"]
            self._last_cv2 = max(w["prompt_sq"] / w["prefilled"] / mean_prompt**2 - 1, 0.0)
        generated = self._generated()
        if w["finished"]:
            mean_output = (generated - self._generated_mark) / w["finished"]
        self._generated_mark = generated
        self._last_means = (mean_prompt, mean_output)
        prefill_serving = [e for e in self.prefill if e.state is EngineState.SERVING]
        decode_serving = [e for e in self.decode if e.state is EngineState.SERVING]
        # The queue as the controller reads it on a cluster: the engines' waiting gauges, and the proxy's.
        waiting = [e.gauge_waiting for e in prefill_serving]
        prefill = PoolObservation(
            replicas=len(prefill_serving),
            starting=sum(1 for e in self.prefill if e.state in _ARRIVING),
            queue_depth=sum(n for n, _ in waiting) + len(self._proxy_queue),
            queued_tokens=sum(tokens for _, tokens in waiting) + sum(r.prompt for r in self._proxy_queue),
            running=sum(1 for e in prefill_serving if e.busy),
        )
        capacity = self.profile.engine.kv_capacity_tokens
        decode = PoolObservation(
            replicas=len(decode_serving),
            starting=sum(1 for e in self.decode if e.state in _ARRIVING),
            # vLLM's waiting gauge counts the requests whose KV is still loading, too
            queue_depth=sum(len(e.waiting) + e.transferring for e in decode_serving) + len(self._decode_pending),
            queued_tokens=sum(e.waiting_kv for e in decode_serving),
            running=sum(len(e.running) for e in decode_serving),
            kv_cache_usage=sum(e.kv_used for e in decode_serving) / (capacity * len(decode_serving))
            if decode_serving
            else 0.0,
        )
        return ClusterObservation(
            t=self.now,
            arrival_rate_rps=w["arrivals"] / self.interval_s,
            mean_prompt_tokens=self._last_means[0],
            mean_output_tokens=self._last_means[1],
            prefill=prefill,
            decode=decode,
            ttft_p90_s=_quantile(sorted(w["ttft"]), 0.9),
            itl_p90_s=_quantile(sorted(w["itl"]), 0.9),
            prompt_tokens_cv2=self._last_cv2,
        )

    def _on_decide(self, _: None) -> None:
        obs = self._observe()
        decision = self.policy.decide(obs)
        self._window = self._new_window()
        self.policy_targets = decision.prefill + decision.decode
        moved = self._move(decision) if self.moves else None
        self._scale(self.prefill, decision.prefill, _PrefillEngine, "prefill")
        self._scale(self.decode, decision.decode, _DecodeEngine, "decode")
        self._fit_warm()
        self.timeline.append(
            {
                "t": round(self.now, 3),
                "arrival_rps": round(obs.arrival_rate_rps, 3),
                "prefill": decision.prefill,
                "decode": decision.decode,
                "prefill_serving": obs.prefill.replicas,
                "decode_serving": obs.decode.replicas,
                "engines": sum(1 for e in self.prefill + self.decode if e.state not in _NOT_COUNTED),
                "moved": moved,
                "ttft_p90_s": obs.ttft_p90_s,
                "itl_p90_s": obs.itl_p90_s,
                "prefill_queue": obs.prefill.queue_depth,
                "decode_queue": obs.decode.queue_depth,
                "reasons": decision.reasons,
            }
        )
        if self._in_flight or self._events:
            self._at(self.now + self.interval_s, _DECIDE, None)

    def _move(self, decision: ScalingDecision) -> str | None:
        """The part of ``decision`` that moves make, as the controller makes it (``rules.moves_for``): the
        source pool's serving engines, newest first (``rules.move_order``), leave its routing now and count
        towards the destination; each serves there once its old work is done and ``move_s`` has passed.
        ``"source->destination count"``, or None when no move helps."""
        pools = {"prefill": (self.prefill, _PrefillEngine), "decode": (self.decode, _DecodeEngine)}
        current = {role: sum(1 for e in pool if e.state in _PROVISIONED) for role, (pool, _) in pools.items()}
        movers = {
            role: move_order(pool, lambda e: e.state is EngineState.SERVING, lambda e: e.replica)
            for role, (pool, _) in pools.items()
        }
        wanted = {"prefill": decision.prefill, "decode": decision.decode}
        found = moves_for(current, wanted, {role: len(engines) for role, engines in movers.items()})
        if found is None:
            return None
        source, destination, count = found
        pool, kind = pools[destination]
        for engine in movers[source][:count]:
            self._begin_move(engine, pool, kind)
        return f"{source}->{destination} {count}"

    def _begin_move(self, engine: _Engine, pool: list, kind: type) -> None:
        """``engine`` leaves its pool; its successor in ``pool`` counts there from now on."""
        successor = kind(engine.replica, self.now, EngineState.MOVING, cores_id=self._cores_id(engine))
        engine.state, engine.stopped = EngineState.LEAVING, self.now  # its hours go on in the successor's
        engine.warm_until = -1.0
        engine.twin, successor.twin = successor, engine
        pool.append(successor)
        self._left(engine)

    def _left(self, engine: _Engine) -> None:
        """A LEAVING engine whose old work is done (a prefill engine's KV read, too) switches pools: it serves
        in the new one ``move_s`` later."""
        done = engine.idle and (not isinstance(engine, _PrefillEngine) or engine.unread == 0)
        if done and engine.twin is not None:
            self._at(self.now + self.profile.engine.move_s, _MOVED, engine)

    def _on_moved(self, engine: _Engine) -> None:
        successor = engine.twin
        if engine.state is not EngineState.LEAVING or successor is None:  # called off meanwhile
            return
        engine.state, engine.twin, successor.twin = EngineState.STOPPED, None, None
        successor.state = EngineState.SERVING
        self._serve_pending(successor)

    def _call_off(self, successor: _Engine) -> None:
        """A retirement picked a MOVING engine: the move is called off and the engine drains in its old pool
        (as the controller's ``_spawn_retire`` does)."""
        engine = successor.twin
        successor.state, successor.stopped, successor.twin = EngineState.STOPPED, successor.started, None
        if engine is None:
            return
        engine.state, engine.stopped, engine.twin = EngineState.DRAINING, -1.0, None
        if engine.idle:
            self._drained(engine)

    def _cores_id(self, engine: _Engine) -> str:
        role = "prefill" if isinstance(engine, _PrefillEngine) else "decode"
        return engine.cores_id or f"{role}-{engine.replica}"

    def _scale(self, pool: list, target: int, kind: type, role: str) -> None:
        """The controller's rules (``rules``): draining engines taken back first, then (with moves) the other
        pool's draining engines moved in, then new engines on the lowest free replicas; the newest retired first
        (a moving engine's move called off)."""
        provisioned = [e for e in pool if e.state in _PROVISIONED]
        missing = target - len(provisioned)
        if missing > 0:
            draining = [e for e in pool if e.state is EngineState.DRAINING]
            for engine in take_back_order(draining, lambda e: e.replica)[:missing]:
                engine.state = EngineState.SERVING
                engine.warm_until = -1.0
                missing -= 1
                self._serve_pending(engine)
            if self.moves and missing > 0:  # the other pool's draining engines move in (rules.resize_plan's others)
                other = self.decode if role == "prefill" else self.prefill
                leaving = [e for e in other if e.state is EngineState.DRAINING]
                for engine in take_back_order(leaving, lambda e: e.replica)[:missing]:
                    self._begin_move(engine, pool, kind)
                    missing -= 1
            held = (e.replica for e in pool if e.state is not EngineState.STOPPED)
            for replica in new_replicas(held, missing):
                engine = kind(replica, self.now, EngineState.STARTING)
                pool.append(engine)
                self._at(self.now + self.startup_s * self._share(engine, self.shared.startup), _READY, engine)
                self._neighbours_changed(engine)  # decode steps beside a start-up slow down
        elif missing < 0:
            order = retirement_order(provisioned, lambda e: e.state is EngineState.SERVING, lambda e: e.replica)
            for engine in order[:-missing]:
                if engine.state is EngineState.MOVING:
                    self._call_off(engine)
                elif engine.state is EngineState.STARTING:
                    self._stop(engine)
                else:
                    engine.state = EngineState.DRAINING
                    if engine.idle:
                        self._drained(engine)

    def _on_ready(self, engine: _Engine) -> None:
        if engine.state is EngineState.STARTING:
            engine.state = EngineState.SERVING
            self._neighbours_changed(engine)  # its start-up no longer slows them
            self._serve_pending(engine)

    def _serve_pending(self, engine: _Engine) -> None:
        self._serving = [None, None]  # ``engine`` serves now
        if isinstance(engine, _PrefillEngine):
            while self._proxy_queue:
                self._route_prefill(self._proxy_queue.popleft())
        else:
            while self._decode_pending:
                self._route_decode(self._decode_pending.popleft())

    def _warm(self) -> list[_Engine]:
        """Engines kept warm now."""
        return [e for e in self.prefill + self.decode if e.state is EngineState.DRAINING and e.warm_until >= 0]

    def _drained(self, engine: _Engine) -> None:
        """A retired engine has finished its work: kept warm while the budget has room (``keep_warm_s``), as
        the controller's ``_retire`` does, else stopped."""
        if self.keep_warm_s > 0 and warm_room(self.max_engines, self.policy_targets, len(self._warm())) > 0:
            engine.warm_until = self.now + self.keep_warm_s
            self._at(engine.warm_until, _WARM_END, (engine, engine.warm_until))
        else:
            self._stop(engine)

    def _on_warm_end(self, payload: tuple[_Engine, float]) -> None:
        engine, until = payload
        if engine.state is EngineState.DRAINING and engine.warm_until == until:  # not taken back (or cut) since
            self._stop(engine)

    def _fit_warm(self) -> None:
        """Stop engines kept warm while the targets and they exceed the budget (``rules.warm_to_stop``; all
        are kept equally long, so the one warm until soonest is the longest-warm)."""
        for engine in warm_to_stop(self._warm(), lambda e: e.warm_until, self.max_engines, self.policy_targets):
            self._stop(engine)

    def _stop(self, engine: _Engine) -> None:
        was_starting = engine.state is EngineState.STARTING
        engine.state = EngineState.STOPPED
        engine.stopped = self.now
        engine.warm_until = -1.0
        if was_starting:
            self._neighbours_changed(engine)


def _prefill_loads(engines: list[_PrefillEngine]) -> list[int]:
    """The proxy's least-loaded scores of prefill engines: an engine's prefill legs there (the requests in its
    queue, the pass in flight included) and vLLM's waiting gauge. Its KV use, the score's tie-breaker, is left
    out: a prefill engine holds KV only until the decode engine has read it."""
    return [len(e.queue) + e.gauge_waiting[0] for e in engines]


def simulate(
    profile: PerformanceProfile,
    policy: Policy,
    trace: Iterable[TraceRequest],
    targets: SloTargets,
    initial: tuple[int, int],
    interval_s: float = 30.0,
    startup_s: float | None = None,
    cores: dict[str, frozenset[Any]] | None = None,
    spin_s: float = SPIN_S,
    routing: tuple[str, str] = ("least_loaded", "least_loaded"),
    shared: SharedCore = EVEN_SHARE,
    first_decision_s: float | None = None,
    keep_warm_s: float = 0.0,
    max_engines: int | None = None,
    moves: bool = False,
) -> SimulationResult:
    """Run ``trace`` through a cluster that starts with ``initial`` = (prefill, decode) serving engines
    (``cores``: engines that share CPU cores, and ``spin_s`` how long one keeps polling after its work;
    ``routing``: the proxy's (prefill, decode) policies; ``shared``: how much a busy neighbour on a core
    slows an engine; ``first_decision_s``: when the policy first decides; ``keep_warm_s``: how long a drained
    engine stays up while the targets and the engines kept warm fit ``max_engines``; ``moves``: whether
    engines move between the pools; see the module's docstring)."""
    sim = Simulator(
        profile,
        policy,
        targets,
        initial,
        interval_s=interval_s,
        startup_s=startup_s,
        cores=cores,
        spin_s=spin_s,
        routing=routing,
        shared=shared,
        first_decision_s=first_decision_s,
        keep_warm_s=keep_warm_s,
        max_engines=max_engines,
        moves=moves,
    )
    return sim.run(trace)
