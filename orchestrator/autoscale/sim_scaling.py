"""The simulated cluster's scaling: what the controller does at each decision, and the pool changes after it.

``Scaling`` is the ``Simulator``'s collaborator for the controller's side of a run. Every ``interval_s`` it
makes a ``ClusterObservation`` of the last interval as a cluster's metrics would show it, asks the policy for
targets, and changes the pools by the controller's rules (``orchestrator.autoscale.rules``): moves first
(with ``moves``), then take-backs, starts and retirements; a retired engine drains, may be kept warm
(``keep_warm_s``) and stops. It starts, moves and stops the simulator's engines; routing requests and their
work stay the simulator's. The simulator's module docstring says what is modelled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.autoscale.observation import ClusterObservation, PoolObservation, ScalingDecision
from orchestrator.autoscale.rules import (
    move_order,
    moves_for,
    new_replicas,
    retirement_order,
    take_back_order,
    warm_room,
    warm_to_stop,
)
from orchestrator.autoscale.sim_model import (
    ARRIVING,
    DECIDE,
    MOVED,
    NOT_COUNTED,
    PROVISIONED,
    READY,
    WARM_END,
    DecodeEngine,
    Engine,
    EngineState,
    Policy,
    PrefillEngine,
    cores_id_of,
    new_window,
    quantile,
)

if TYPE_CHECKING:
    from orchestrator.autoscale.simulator import Simulator

__all__ = ["Scaling"]


class Scaling:
    """One run's decisions and pool changes: ``policy`` decides, ``moves`` whether engines move between the
    pools, ``keep_warm_s`` how long a drained engine stays up while the targets and the engines kept warm fit
    ``max_engines``."""

    def __init__(
        self,
        sim: Simulator,
        policy: Policy,
        initial: tuple[int, int],
        keep_warm_s: float,
        max_engines: int | None,
        moves: bool,
    ) -> None:
        self.sim = sim
        self.policy = policy
        self.keep_warm_s, self.max_engines = keep_warm_s, max_engines
        self.moves = moves
        self.policy_targets = sum(initial)  # the pools' targets together, as the last decision set them
        self._generated_mark = 0.0  # the decode engines' generated tokens (_generated) at the last decision
        self._last_means = (1.0, 1.0)
        self._last_cv2 = 1.0

    # --- the observation ----------------------------------------------------------------------

    def _generated(self) -> float:
        """Output tokens the decode engines generated so far, as vLLM's ``vllm:generation_tokens_total`` counts
        them (one a step for each running sequence): the finished requests' and the running ones' steps so far."""
        sim = self.sim
        running = sum(len(e.running) * sim.steps_now(e) - e.sum_start for e in sim.decode if e.running)
        return sim.finished_output + running

    def _observe(self) -> ClusterObservation:
        # The means as a cluster's counters give them: prompt tokens of the requests whose prefill finished in
        # the window; output tokens the decode engines generated in the window (vLLM counts them at each step,
        # running requests' too) per request finished in it; the last known means hold through a window without.
        sim = self.sim
        w = sim.window
        mean_prompt, mean_output = self._last_means
        if w["prefilled"]:
            mean_prompt = w["prompt"] / w["prefilled"]
            self._last_cv2 = max(w["prompt_sq"] / w["prefilled"] / mean_prompt**2 - 1, 0.0)
        generated = self._generated()
        if w["finished"]:
            mean_output = (generated - self._generated_mark) / w["finished"]
        self._generated_mark = generated
        self._last_means = (mean_prompt, mean_output)
        prefill_serving = [e for e in sim.prefill if e.state is EngineState.SERVING]
        decode_serving = [e for e in sim.decode if e.state is EngineState.SERVING]
        # The queue as the controller reads it on a cluster: the engines' waiting gauges, and the proxy's.
        waiting = [e.gauge_waiting for e in prefill_serving]
        prefill = PoolObservation(
            replicas=len(prefill_serving),
            starting=sum(1 for e in sim.prefill if e.state in ARRIVING),
            queue_depth=sum(n for n, _ in waiting) + len(sim.proxy_queue),
            queued_tokens=sum(tokens for _, tokens in waiting) + sum(r.prompt for r in sim.proxy_queue),
            running=sum(1 for e in prefill_serving if e.busy),
        )
        capacity = sim.profile.engine.kv_capacity_tokens
        decode = PoolObservation(
            replicas=len(decode_serving),
            starting=sum(1 for e in sim.decode if e.state in ARRIVING),
            # vLLM's waiting gauge counts the requests whose KV is still loading, too
            queue_depth=sum(len(e.waiting) + e.transferring for e in decode_serving) + len(sim.decode_pending),
            queued_tokens=sum(e.waiting_kv for e in decode_serving),
            running=sum(len(e.running) for e in decode_serving),
            kv_cache_usage=sum(e.kv_used for e in decode_serving) / (capacity * len(decode_serving))
            if decode_serving
            else 0.0,
        )
        return ClusterObservation(
            t=sim.now,
            arrival_rate_rps=w["arrivals"] / sim.interval_s,
            mean_prompt_tokens=self._last_means[0],
            mean_output_tokens=self._last_means[1],
            prefill=prefill,
            decode=decode,
            ttft_p90_s=quantile(sorted(w["ttft"]), 0.9),
            itl_p90_s=quantile(sorted(w["itl"]), 0.9),
            prompt_tokens_cv2=self._last_cv2,
            clock_s=sim.start_clock_s + sim.now,
        )

    # --- a decision ---------------------------------------------------------------------------

    def on_decide(self, _: None) -> None:
        sim = self.sim
        obs = self._observe()
        decision = self.policy.decide(obs)
        sim.window = new_window()
        self.policy_targets = decision.prefill + decision.decode
        moved = self._move(decision) if self.moves else None
        self._scale(sim.prefill, decision.prefill, PrefillEngine, "prefill")
        self._scale(sim.decode, decision.decode, DecodeEngine, "decode")
        self._fit_warm()
        sim.timeline.append(
            {
                "t": round(sim.now, 3),
                "arrival_rps": round(obs.arrival_rate_rps, 3),
                "prefill": decision.prefill,
                "decode": decision.decode,
                "prefill_serving": obs.prefill.replicas,
                "decode_serving": obs.decode.replicas,
                "engines": sum(1 for e in sim.prefill + sim.decode if e.state not in NOT_COUNTED),
                "moved": moved,
                "ttft_p90_s": obs.ttft_p90_s,
                "itl_p90_s": obs.itl_p90_s,
                "prefill_queue": obs.prefill.queue_depth,
                "decode_queue": obs.decode.queue_depth,
                "reasons": decision.reasons,
            }
        )
        if sim.in_flight or sim.events:
            sim.at(sim.now + sim.interval_s, DECIDE, None)

    # --- moves --------------------------------------------------------------------------------

    def _move(self, decision: ScalingDecision) -> str | None:
        """The part of ``decision`` that moves make, as the controller makes it (``rules.moves_for``): the
        source pool's serving engines, newest first (``rules.move_order``), leave its routing now and count
        towards the destination; each serves there once its old work is done and ``move_s`` has passed.
        ``"source->destination count"``, or None when no move helps."""
        pools = {"prefill": (self.sim.prefill, PrefillEngine), "decode": (self.sim.decode, DecodeEngine)}
        current = {role: sum(1 for e in pool if e.state in PROVISIONED) for role, (pool, _) in pools.items()}
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

    def _begin_move(self, engine: Engine, pool: list, kind: type) -> None:
        """``engine`` leaves its pool; its successor in ``pool`` counts there from now on."""
        now = self.sim.now
        successor = kind(engine.replica, now, EngineState.MOVING, cores_id=cores_id_of(engine))
        engine.state, engine.stopped = EngineState.LEAVING, now  # its hours go on in the successor's
        engine.warm_until = -1.0
        engine.twin, successor.twin = successor, engine
        pool.append(successor)
        self.left(engine)

    def left(self, engine: Engine) -> None:
        """A LEAVING engine whose old work is done (a prefill engine's KV read, too) switches pools: it serves
        in the new one ``move_s`` later."""
        done = engine.idle and (not isinstance(engine, PrefillEngine) or engine.unread == 0)
        if done and engine.twin is not None:
            self.sim.at(self.sim.now + self.sim.profile.engine.move_s, MOVED, engine)

    def on_moved(self, engine: Engine) -> None:
        successor = engine.twin
        if engine.state is not EngineState.LEAVING or successor is None:  # called off meanwhile
            return
        engine.state, engine.twin, successor.twin = EngineState.STOPPED, None, None
        successor.state = EngineState.SERVING
        self.sim.serve_pending(successor)

    def _call_off(self, successor: Engine) -> None:
        """A retirement picked a MOVING engine: the move is called off and the engine drains in its old pool
        (as the controller's ``_spawn_retire`` does)."""
        engine = successor.twin
        successor.state, successor.stopped, successor.twin = EngineState.STOPPED, successor.started, None
        if engine is None:
            return
        engine.state, engine.stopped, engine.twin = EngineState.DRAINING, -1.0, None
        if engine.idle:
            self.drained(engine)

    # --- starts and retirements ---------------------------------------------------------------

    def _scale(self, pool: list, target: int, kind: type, role: str) -> None:
        """The controller's rules (``rules``): draining engines taken back first, then (with moves) the other
        pool's draining engines moved in, then new engines on the lowest free replicas; the newest retired first
        (a moving engine's move called off)."""
        sim = self.sim
        provisioned = [e for e in pool if e.state in PROVISIONED]
        missing = target - len(provisioned)
        if missing > 0:
            draining = [e for e in pool if e.state is EngineState.DRAINING]
            for engine in take_back_order(draining, lambda e: e.replica)[:missing]:
                engine.state = EngineState.SERVING
                engine.warm_until = -1.0
                missing -= 1
                sim.serve_pending(engine)
            if self.moves and missing > 0:  # the other pool's draining engines move in (rules.resize_plan's others)
                other = sim.decode if role == "prefill" else sim.prefill
                leaving = [e for e in other if e.state is EngineState.DRAINING]
                for engine in take_back_order(leaving, lambda e: e.replica)[:missing]:
                    self._begin_move(engine, pool, kind)
                    missing -= 1
            held = (e.replica for e in pool if e.state is not EngineState.STOPPED)
            for replica in new_replicas(held, missing):
                engine = kind(replica, sim.now, EngineState.STARTING)
                pool.append(engine)
                sim.at(sim.now + sim.startup_s * sim.sharing.share(engine, sim.shared.startup), READY, engine)
                sim.sharing.neighbours_changed(engine)  # decode steps beside a start-up slow down
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
                        self.drained(engine)

    def on_ready(self, engine: Engine) -> None:
        if engine.state is EngineState.STARTING:
            engine.state = EngineState.SERVING
            self.sim.sharing.neighbours_changed(engine)  # its start-up no longer slows them
            self.sim.serve_pending(engine)

    def _warm(self) -> list[Engine]:
        """Engines kept warm now."""
        sim = self.sim
        return [e for e in sim.prefill + sim.decode if e.state is EngineState.DRAINING and e.warm_until >= 0]

    def drained(self, engine: Engine) -> None:
        """A retired engine has finished its work: kept warm while the budget has room (``keep_warm_s``), as
        the controller's ``_retire`` does, else stopped."""
        if self.keep_warm_s > 0 and warm_room(self.max_engines, self.policy_targets, len(self._warm())) > 0:
            engine.warm_until = self.sim.now + self.keep_warm_s
            self.sim.at(engine.warm_until, WARM_END, (engine, engine.warm_until))
        else:
            self._stop(engine)

    def on_warm_end(self, payload: tuple[Engine, float]) -> None:
        engine, until = payload
        if engine.state is EngineState.DRAINING and engine.warm_until == until:  # not taken back (or cut) since
            self._stop(engine)

    def _fit_warm(self) -> None:
        """Stop engines kept warm while the targets and they exceed the budget (``rules.warm_to_stop``; all
        are kept equally long, so the one warm until soonest is the longest-warm)."""
        for engine in warm_to_stop(self._warm(), lambda e: e.warm_until, self.max_engines, self.policy_targets):
            self._stop(engine)

    def _stop(self, engine: Engine) -> None:
        was_starting = engine.state is EngineState.STARTING
        engine.state = EngineState.STOPPED
        engine.stopped = self.sim.now
        engine.warm_until = -1.0
        if was_starting:
            self.sim.sharing.neighbours_changed(engine)
