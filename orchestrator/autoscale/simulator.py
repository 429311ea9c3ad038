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
busy engines). An engine counts as busy for ``SPIN_S`` (1 s, ``sim_cores``) after its last pass
or step: vLLM's worker polls its queue that long before it sleeps, and takes its
share of the core meanwhile. A decode engine's step is re-timed whenever a
neighbour starts work or stops polling; a pass in flight keeps the time it
started with. A new engine's start-up is stretched the same way (``SharedCore.startup``,
by default 1: not at all) by the neighbours busy when it begins, and a start-up slows the
decode steps and prefill passes beside it while it lasts (``SharedCore.decode_beside_start``,
``prefill_beside_start``, by default 1). A decode step beside a busy decode engine may take its
own factor (``SharedCore.decode_beside_decode``; by default the same as beside any busy engine).
An engine also works ``SharedCore.host_prefill`` / ``host_decode`` times slower while an
engine on none of its cores computes (the host's memory and caches, and the processes no
core is pinned for, are shared; by default 1).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.autoscale.profile import PerformanceProfile
from orchestrator.autoscale.sim_cores import SPIN_S, CoreSharing
from orchestrator.autoscale.sim_model import (
    ARRIVAL,
    DECIDE,
    DECODE_DONE,
    EPS,
    EVEN_SHARE,
    MOVED,
    PREFILL_DONE,
    READY,
    SPIN_END,
    TRANSFER_DONE,
    WARM_END,
    DecodeEngine,
    Engine,
    EngineState,
    Policy,
    PrefillEngine,
    Request,
    RequestRecord,
    SharedCore,
    SimulationResult,
    SloTargets,
    new_window,
)
from orchestrator.autoscale.sim_scaling import Scaling
from orchestrator.autoscale.traces import TraceRequest
from proxy.policies import simulated_as

logger = logging.getLogger(__name__)

__all__ = ["SimOptions", "Simulator", "simulate"]

PASS_BIN_S = 10  # SimulationResult.prefill_passes' bins
# The events that never change which engines serve in a pool (the per-request ones): ``_pick`` keeps each
# pool's serving engines (``_serving``) across them, and drops them after any other event (an event kind added
# later is then safe by default) and in ``serve_pending``, which routes as soon as an engine serves.
_KEEP_SERVING = frozenset({ARRIVAL, PREFILL_DONE, TRANSFER_DONE, DECODE_DONE, SPIN_END})


@dataclass(slots=True, frozen=True)
class SimOptions:
    """How a simulated cluster runs, beside its profile, policy, targets and starting pools; the module's
    docstring says what each one models. ``Simulator`` and ``simulate`` take one."""

    interval_s: float = 30.0  # between two decisions of the policy
    startup_s: float | None = None  # from "start an engine" to "it serves"; None: the profile's
    cores: dict[str, frozenset[Any]] | None = None  # engines that share CPU cores: each one's cores, by engine id
    spin_s: float = SPIN_S  # how long an engine keeps its core busy polling after its last pass or step
    routing: tuple[str, str] = ("least_loaded", "least_loaded")  # the proxy's (prefill, decode) policies
    shared: SharedCore = EVEN_SHARE  # how much a busy neighbour on a core slows an engine
    first_decision_s: float | None = None  # when the policy first decides, in (0, interval_s]; None: interval_s
    keep_warm_s: float = 0.0  # how long a drained engine stays up while the targets and warm engines fit
    max_engines: int | None = None  # the budget kept-warm engines must fit in with the targets
    moves: bool = False  # engines move between the pools (the spec's role_moves)
    start_clock_s: float = 0.0  # the trace's start as epoch seconds, the clock a schedule reads

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 (got {self.interval_s})")
        if self.first_decision_s is not None and not 0 < self.first_decision_s <= self.interval_s:
            raise ValueError(f"first_decision_s must be in (0, interval_s] (got {self.first_decision_s})")


class Simulator:
    """One run: build it, then ``run(trace)``. Deterministic: the same inputs give the same result.

    It keeps the clock, the events and the engines, and routes and serves the requests; its collaborators
    change the pools at each decision (``scaling``: ``sim_scaling.Scaling``) and slow the engines that share
    cores (``sharing``: ``sim_cores.CoreSharing``)."""

    def __init__(
        self,
        profile: PerformanceProfile,
        policy: Policy,
        targets: SloTargets,
        initial: tuple[int, int],
        options: SimOptions | None = None,
    ) -> None:
        options = SimOptions() if options is None else options
        interval_s, routing = options.interval_s, options.routing
        self.first_decision_s = interval_s if options.first_decision_s is None else options.first_decision_s
        self.start_clock_s = options.start_clock_s  # the trace's start as epoch seconds (a schedule's clock)
        # The proxy's policy per pool, as its registry says the simulator models it (proxy.policies): in turn,
        # or the least loaded; a policy it cannot model is refused by name.
        self._in_turn = tuple(simulated_as(policy) == "in_turn" for policy in routing)
        self._turns = (itertools.count(), itertools.count())  # the proxy's pick counter per pool
        self._serving: list[list | None] = [None, None]  # each pool's serving engines, kept by _pick
        self.profile, self.targets = profile, targets
        self.interval_s = interval_s
        self.shared = options.shared
        self.sharing = CoreSharing(self, options.cores or {}, options.spin_s, options.shared)
        self.scaling = Scaling(self, policy, initial, options.keep_warm_s, options.max_engines, options.moves)
        self.startup_s = profile.engine.startup_s if options.startup_s is None else options.startup_s
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.prefill: list[PrefillEngine] = []
        self.decode: list[DecodeEngine] = []
        self.proxy_queue: deque[Request] = deque()  # no prefill engine serving
        self.decode_pending: deque[Request] = deque()  # no decode engine serving
        self._records: list[RequestRecord] = []
        self.in_flight = 0
        self.window: dict[str, Any] = new_window()  # the decision interval's tallies (Scaling reads them)
        self.finished_output = 0  # output tokens of the finished requests so far
        self.timeline: list[dict[str, Any]] = []
        self._passes: dict[tuple[int, int], list[float]] = {}
        self.prefill.extend(PrefillEngine(n, 0.0, EngineState.SERVING) for n in range(initial[0]))
        self.decode.extend(DecodeEngine(n, 0.0, EngineState.SERVING) for n in range(initial[1]))

    # --- event plumbing -----------------------------------------------------------------------

    def at(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.events, (t, kind, next(self._seq), payload))

    def run(self, trace: Iterable[TraceRequest]) -> SimulationResult:
        arrivals = iter(sorted(trace, key=lambda r: r.t))
        first = next(arrivals, None)
        if first is None:
            raise ValueError("the trace has no requests")
        t0 = first.t
        self._next_arrival(first)
        self._arrivals = arrivals
        self.at(self.first_decision_s, DECIDE, None)
        handlers = {
            ARRIVAL: self._on_arrival,
            READY: self.scaling.on_ready,
            PREFILL_DONE: self._on_prefill_done,
            TRANSFER_DONE: self._on_transfer_done,
            DECODE_DONE: self._on_decode_done,
            DECIDE: self.scaling.on_decide,
            SPIN_END: self.sharing.on_spin_end,
            WARM_END: self.scaling.on_warm_end,
            MOVED: self.scaling.on_moved,
        }
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            self.now = t
            handlers[kind](payload)
            if kind not in _KEEP_SERVING:
                self._serving = [None, None]
        end = max(r.done for r in self._records)
        hours = sum(e.hours(end) for e in self.prefill + self.decode)
        return SimulationResult(self._records, self.targets, end - t0, hours, self.timeline, self._passes)

    def _next_arrival(self, item: TraceRequest | None) -> None:
        if item is not None:
            self.at(item.t, ARRIVAL, item)

    # --- prefill ------------------------------------------------------------------------------

    def _on_arrival(self, item: TraceRequest) -> None:
        self._next_arrival(next(self._arrivals, None))
        self.window["arrivals"] += 1
        prompt = max(1, item.prompt_tokens)
        req = Request(len(self._records) + self.in_flight, item.t, prompt, max(1, item.output_tokens), prompt)
        self.in_flight += 1
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

    def _route_prefill(self, req: Request) -> None:
        best: PrefillEngine | None = self._pick(self.prefill, 0, _prefill_loads)
        if best is None:
            self.proxy_queue.append(req)
            return
        best.queue.append(req)
        best.queued_tokens += req.prefill_left
        if not best.busy:
            self._start_prefill_pass(best)
            self.sharing.neighbours_changed(best)  # it was idle

    def _start_prefill_pass(self, engine: PrefillEngine) -> None:
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
        shared = self.shared
        share = self.sharing.share(engine, shared.prefill, shared.prefill_beside_start, shared.host_prefill)
        seconds = self.profile.prefill_seconds(tokens, len(chunks)) * share
        key = (engine.replica, int(self.now // PASS_BIN_S) * PASS_BIN_S)
        tally = self._passes.setdefault(key, [0, 0, 0, 0.0, 0.0])
        for i, v in enumerate((1, tokens, len(chunks), seconds, seconds * len(chunks))):
            tally[i] += v
        self.at(self.now + seconds, PREFILL_DONE, (engine, chunks))

    def _on_prefill_done(self, payload: tuple[PrefillEngine, list[tuple[Request, int]]]) -> None:
        engine, chunks = payload
        engine.busy = False
        for req, chunk in chunks:
            req.prefill_left -= chunk
            engine.queued_tokens -= chunk
        w = self.window
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
            self.sharing.went_idle(engine)
            if engine.state is EngineState.DRAINING:
                self.scaling.drained(engine)
            elif engine.state is EngineState.LEAVING:
                self.scaling.left(engine)

    # --- decode -------------------------------------------------------------------------------

    def _decode_loads(self, engines: list[DecodeEngine]) -> list[float]:
        """The proxy's least-loaded scores (``proxy.pool.EngineState.load``): an engine's decode legs there,
        vLLM's waiting gauge (requests waiting, their KV loading included), and the KV cache in use (0-1)."""
        capacity = self.profile.engine.kv_capacity_tokens
        return [2 * (len(e.waiting) + e.transferring) + len(e.running) + e.kv_used / capacity for e in engines]

    def _route_decode(self, req: Request) -> None:
        best: DecodeEngine | None = self._pick(self.decode, 1, self._decode_loads)
        if best is None:
            self.decode_pending.append(req)
            return
        best.waiting.append(req)
        best.waiting_kv += req.prompt + req.output
        self._admit(best)

    def _admit(self, engine: DecodeEngine) -> None:
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
            self.at(self.now + delay, TRANSFER_DONE, (engine, req))

    def _to_step_end(self, engine: DecodeEngine) -> float:
        """Seconds until ``engine``'s step in progress ends; 0 when it steps nothing."""
        if not engine.running or engine.step_s <= 0:
            return 0.0
        self.advance(engine)
        return max(0.0, math.ceil(engine.steps - 1e-6) - engine.steps) * engine.step_s

    def steps_now(self, engine: DecodeEngine) -> float:
        """The decode steps ``engine`` has done by now (fractional between events)."""
        if engine.running and engine.step_s > 0:
            return engine.steps + (self.now - engine.t_ref) / engine.step_s
        return engine.steps

    def advance(self, engine: DecodeEngine) -> None:
        engine.steps = self.steps_now(engine)
        engine.t_ref = self.now

    def reschedule(self, engine: DecodeEngine) -> None:
        engine.version += 1
        n = len(engine.running)
        if not n:
            engine.step_s = 0.0
            return
        context = (engine.sum_prompt + n * engine.steps - engine.sum_start) / n
        shared = self.shared
        share = self.sharing.share(
            engine, shared.decode, shared.decode_beside_start, shared.host_decode, shared.decode_beside_decode
        )
        engine.step_s = self.profile.decode_step_seconds(n, context) * share
        finish = engine.running[0][0]
        self.at(self.now + max(0.0, finish - engine.steps) * engine.step_s, DECODE_DONE, (engine, engine.version))

    def _on_transfer_done(self, payload: tuple[DecodeEngine, Request]) -> None:
        engine, req = payload
        if req.kv_holder is not None:  # read: the prefill engine frees its blocks
            holder, req.kv_holder = req.kv_holder, None
            holder.unread -= 1
            if holder.state is EngineState.LEAVING:
                self.scaling.left(holder)
        wait = self._to_step_end(engine)
        if wait > EPS:  # the scheduler hears of a finished load, and takes the request in, between steps
            self.at(self.now + wait, TRANSFER_DONE, payload)
            return
        self.advance(engine)
        engine.transferring -= 1
        req.start_step = engine.steps
        heapq.heappush(engine.running, (engine.steps + req.output, req.rid, req))
        engine.sum_prompt += req.prompt
        engine.sum_start += engine.steps
        self.reschedule(engine)
        req.first_token = self.now + engine.step_s
        self.window["ttft"].append(req.first_token - req.arrival)
        if len(engine.running) == 1:
            self.sharing.neighbours_changed(engine)  # it was idle

    def _on_decode_done(self, payload: tuple[DecodeEngine, int]) -> None:
        engine, version = payload
        if version != engine.version:
            return
        self.advance(engine)
        # This event was timed for the first finish: float rounding must not leave it a hair short.
        engine.steps = max(engine.steps, engine.running[0][0])
        while engine.running and engine.running[0][0] <= engine.steps + 1e-6:
            _, _, req = heapq.heappop(engine.running)
            engine.sum_prompt -= req.prompt
            engine.sum_start -= req.start_step
            engine.kv_used -= req.prompt + req.output
            self._finish(req)
        self._admit(engine)
        self.reschedule(engine)
        if not engine.running:
            self.sharing.went_idle(engine)
        if engine.state is EngineState.DRAINING and engine.idle:
            self.scaling.drained(engine)
        elif engine.state is EngineState.LEAVING:
            self.scaling.left(engine)

    def _finish(self, req: Request) -> None:
        req.done = self.now
        itl = (req.done - req.first_token) / (req.output - 1) if req.output > 1 else 0.0
        self._records.append(
            RequestRecord(req.arrival, req.prompt, req.output, req.first_token - req.arrival, max(itl, 0.0), req.done)
        )
        w = self.window
        w["itl"].append(itl)
        w["finished"] += 1
        self.finished_output += req.output
        self.in_flight -= 1

    def serve_pending(self, engine: Engine) -> None:
        self._serving = [None, None]  # ``engine`` serves now
        if isinstance(engine, PrefillEngine):
            while self.proxy_queue:
                self._route_prefill(self.proxy_queue.popleft())
        else:
            while self.decode_pending:
                self._route_decode(self.decode_pending.popleft())


def _prefill_loads(engines: list[PrefillEngine]) -> list[int]:
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
    options: SimOptions | None = None,
) -> SimulationResult:
    """Run ``trace`` through a cluster that starts with ``initial`` = (prefill, decode) serving engines, run
    as ``options`` say (default: ``SimOptions()``)."""
    return Simulator(profile, policy, targets, initial, options).run(trace)
