"""How the controller changes its pools: scale (grow, shrink), move engines between the pools, retire them.

``PoolChanges`` is the controller's collaborator (``orchestrator.pools``) that decides which engines start, move,
drain, are kept warm and stop, by the rules the simulator follows too (``orchestrator.autoscale.rules``): growing
takes back the pool's draining engines first, then moves in the other pool's (where engines may move), then starts
the lowest free replicas; shrinking retires the newest. A retirement drains (``_wait_drained``: nothing in flight,
queued, running or held for a reader), may keep the engine warm for a scale-up to take back
(``autoscaling.keep_warm_s``), then stops it. A move takes a ready engine out of its pool's routing at once and,
once its old work is done, publishes it in the other pool.

It works on the controller's ``Pools``; it starts and stops engines through ``EngineStarts`` (the
``EngineSupervisor``), tells the proxy through ``Publisher`` (the ``ProxyLink``) and says what it did in ``Events``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from contract.wire import ROLES
from orchestrator.autoscale.actuator import AUTOSCALER_REASON
from orchestrator.autoscale.rules import (
    MOVING,
    move_order,
    moves_for,
    new_replicas,
    resize_plan,
    warm_room,
    warm_to_stop,
)
from orchestrator.engine_metrics import engine_gauges
from orchestrator.engine_record import EngineRecord, first_line, replica, warm_since
from orchestrator.placement import Node, assign
from orchestrator.pools import MONITOR_INTERVAL_S, EngineStarts, Events, Pools, Publisher, Tasks

MOVE_POLL_S = 0.2
"""How often a moving engine is asked whether its old pool's work is done: a move serves in its new pool within
this of its last request there (a retirement's drain asks once a second)."""


class PoolChanges:
    def __init__(
        self,
        pools: Pools,
        starts: EngineStarts,
        proxy: Publisher,
        events: Events,
        tasks: Tasks,
        nodes: Callable[[], list[Node] | None],
    ) -> None:
        self.pools, self.starts, self.proxy, self.events, self.tasks, self.nodes = (
            pools, starts, proxy, events, tasks, nodes)  # fmt: skip
        self.scaled_by_hand: Callable[[dict[str, int]], None] | None = None  # the autoscaler's, once it has one
        self._retiring: dict[str, asyncio.Task] = {}  # engine id -> its _retirement, while it may be taken back

    async def scale(
        self, targets: dict[str, int], reason: str = "by hand", keep_warm_s: float = 0.0, move: bool = False
    ) -> dict[str, Any]:
        """Grow or shrink pools to ``targets`` (``{role: replicas}``); return at once with the plan.

        Growing takes back the pool's draining engines first (they serve again at
        once), then starts the lowest free replicas; each joins the proxy's pool when
        ready. Shrinking retires the newest engines (those still starting first;
        ``orchestrator.autoscale.rules``, which the simulator follows too):
        each leaves the proxy's pool at once, finishes its running requests, and a
        prefill engine keeps its KV until the decode engines have read it; then it
        is stopped (``_retirement``), or first kept warm, idle, for ``keep_warm_s`` (the autoscaler's
        ``autoscaling.keep_warm_s``), where a scale-up takes it back as it would a draining one.
        ``move`` (the autoscaler's, where the spec allows moves): when one pool grows while the other shrinks,
        the part they share is made by moving ready engines (``rules.moves_for``; ``move``), the rest as above.
        ``{"error": ...}`` when a target is out of bounds.
        """
        if self.pools.phase != "ready":
            return {"error": f"the cluster is {self.pools.phase}, not ready"}
        for role, target in targets.items():
            if role not in ROLES:
                return {"error": f"unknown pool {role!r}; pools are {', '.join(ROLES)}"}
            low, high = self.pools.spec.min_replicas(role), self.pools.spec.max_replicas(role)
            if not low <= target <= high:
                return {"error": f"{role}={target} is outside {low}..{high} (the pool's bounds in the spec)"}
        if self.pools.spec.autoscaling is not None:
            total = sum(targets.get(role, self.pools.targets[role]) for role in ROLES)
            if total > self.pools.spec.autoscaling.max_engines:
                return {"error": f"{total} engines exceed autoscaling.max_engines ({self.pools.max_engines()})"}
        if problems := self._unplaceable({**self.pools.targets, **targets}):
            return {"error": "the Ray cluster cannot hold that: " + "; ".join(problems)}
        plan: dict[str, dict[str, list[str]]] = {}
        by_hand = not reason.startswith(AUTOSCALER_REASON)
        if self.scaled_by_hand is not None and by_hand:
            self.scaled_by_hand(targets)  # not undone before its scale-down cooldown
        if move and self.pools.spec.move_problem() is None:
            movable = {role: len(self._movers(role)) for role in ROLES}
            if found := moves_for(self.pools.targets, targets, movable):
                source, destination, count = found
                moved = await self._start_moves(self._movers(source)[:count], source, destination, reason)
                plan["move"] = {f"{source}->{destination}": moved}
        for role, target in targets.items():
            self.pools.targets[role] = target
            plan[role] = await self.resize(role, reason, keep_warm_s, retry_now=by_hand)
            await self.proxy.publish(role)  # the proxy's /metrics says the new target at once
        if not keep_warm_s:  # by hand: an engine of the pools it names is stopped now, kept warm or not
            for record in self._warm():
                if record.role in targets:
                    self._cut_warm(record, f"scaled by hand ({reason})")
        self._fit_warm()
        self.events.save()
        return {"plan": plan, "targets": dict(self.pools.targets)}

    async def move(self, source: str, destination: str, count: int = 1, reason: str = "by hand") -> dict[str, Any]:
        """Move ``count`` ready engines from pool ``source`` to ``destination`` without restarting them (the
        newest first, ``rules.move_order``); return at once with the plan. Each leaves ``source``'s routing
        now, finishes what it has there (requests; a prefill engine's KV its readers have not read), then serves
        in ``destination`` (``finish_move``). ``{"error": ...}`` when the spec forbids it or a bound would break."""
        if self.pools.phase != "ready":
            return {"error": f"the cluster is {self.pools.phase}, not ready"}
        if {source, destination} != set(ROLES):
            return {"error": f"a move goes between the pools {' and '.join(ROLES)}, not {source!r} -> {destination!r}"}
        if problem := self.pools.spec.move_problem():
            return {"error": f"engines cannot move: {problem}"}
        low, high = self.pools.spec.min_replicas(source), self.pools.spec.max_replicas(destination)
        if count < 1:
            return {"error": f"a move needs at least one engine, not {count}"}
        if self.pools.targets[source] - count < low:
            return {"error": f"moving {count} would leave {source} below its minimum ({low})"}
        if self.pools.targets[destination] + count > high:
            return {"error": f"moving {count} would take {destination} above its maximum ({high})"}
        movers = self._movers(source)
        if len(movers) < count:
            return {"error": f"{source} has {len(movers)} ready engine(s) that could move, not {count}"}
        if self.scaled_by_hand is not None and not reason.startswith(AUTOSCALER_REASON):
            self.scaled_by_hand(
                {source: self.pools.targets[source] - count, destination: self.pools.targets[destination] + count}
            )
        moved = await self._start_moves(movers[:count], source, destination, reason)
        self.events.save()
        return {"plan": {"move": {f"{source}->{destination}": moved}}, "targets": dict(self.pools.targets)}

    def _movers(self, role: str) -> list[EngineRecord]:
        """The engines of pool ``role`` that may move, in the order they move."""
        pool = [r for r in self.pools.engines.values() if r.role == role]
        return move_order(pool, lambda r: r.state == "ready", lambda r: replica(r.engine_id))

    async def _start_moves(self, records: list[EngineRecord], source: str, destination: str, reason: str) -> list[str]:
        """Take ``records`` out of ``source``'s routing now (they count towards ``destination`` from here on)
        and move each in a task of its own."""
        self.pools.targets[source] -= len(records)
        self.pools.targets[destination] += len(records)
        decided = time.monotonic()
        for record in records:
            self._begin_move(record, destination, reason, decided)
        await self.proxy.publish(source)
        await self.proxy.publish(destination)  # the proxy's /metrics says the new targets at once
        return [r.engine_id for r in records]

    def _begin_move(self, record: EngineRecord, destination: str, reason: str, decided: float) -> None:
        """``record`` counts towards ``destination`` from now on; it serves there once its old work is done."""
        source = record.role
        record.role, record.moving_from, record.state = destination, source, MOVING
        self.events.add(
            f"{record.engine_id} moving {source} -> {destination} ({reason}): out of the {source} pool, "
            f"finishing its {source} work"
        )
        self.tasks.spawn(self.finish_move(record, decided))

    async def finish_move(self, record: EngineRecord, decided: float) -> None:
        """``_start_moves``'s task: once the engine's old work is done, it serves in its new pool."""
        source, destination = record.moving_from, record.role
        await self._wait_drained(record, MOVE_POLL_S)
        if record.state != MOVING or self.pools.engines.get(record.engine_id) is not record:
            return  # retired, failed or stopped meanwhile
        drained = time.monotonic()
        record.state, record.moving_from = "ready", None
        await self.proxy.publish(source)  # out of the old pool's table before it joins the new one
        await self.proxy.publish(destination)
        done = time.monotonic()
        move = {
            "engine_id": record.engine_id,
            "from": source,
            "to": destination,
            "at": time.time(),
            "finishing_s": round(drained - decided, 3),
            "switch_s": round(done - drained, 3),
        }
        self.pools.moves.append(move)
        self.events.add(
            f"{record.engine_id} serves {destination} now: moved in {done - decided:.2f}s "
            f"({move['finishing_s']:.2f}s finishing its {source} work, {move['switch_s']:.2f}s switching)"
        )
        self.events.save()

    async def resize(
        self, role: str, reason: str, keep_warm_s: float = 0.0, retry_now: bool = False
    ) -> dict[str, list[str]]:
        """Bring the pool towards its target: take back draining engines, move in the other pool's draining
        ones (where engines may move), start failed ones again (once their back-off ended, or ``retry_now``),
        start new ones, or retire; failed engines it does not need stop."""
        target = self.pools.targets[role]
        pool = [r for r in self.pools.engines.values() if r.role == role]
        movable = self.pools.spec.move_problem() is None
        others = [r for r in self.pools.engines.values() if r.role != role] if movable else []
        plan = resize_plan(pool, target, time.monotonic(), retry_now, lambda r: replica(r.engine_id), others)
        taken, again, retiring = plan.take_back, plan.start_again, plan.retire
        started = self._grow(role, plan.start)
        if started or retiring or taken or again or plan.move_in:
            self.events.add(f"scaling {role} {plan.serving} -> {target} ({reason})")
        for record in taken:
            was = self._call_off_retirement(record)
            record.state = "ready"
            self.events.add(f"{record.engine_id} taken back: it was {was}; in the proxy's pool again")
        if taken:
            await self.proxy.publish(role)
        decided = time.monotonic()
        for record in plan.move_in:  # it was leaving its pool anyway: it serves here once its work there is done
            was = self._call_off_retirement(record)
            self._begin_move(record, role, f"{reason}; it was {was} in {record.role}", decided)
        for record in retiring:
            self.retire(record, keep_warm_s=keep_warm_s)
        for record in again:
            record.state = "pending"  # counted as serving at once: a scale that follows does not start it twice
            self.events.add(
                f"{record.engine_id} starting again (start {record.failures + 1}; it failed: "
                f"{first_line(record.error)})"
            )
            self.tasks.spawn(self.starts.start_again(record))
        for record in plan.stop_failed:
            self.events.add(f"{record.engine_id} failed and its pool is at its target without it: stopping it")
            self.retire(record, drain=False)
        stopping = [r.engine_id for r in self.pools.engines.values() if r.role == role and r.stopping]
        if plan.serving + len(taken) + len(plan.move_in) + len(started) + len(again) < target and stopping:
            self.events.add(f"{role}: the other engine(s) start once {', '.join(stopping)} stopped (replicas held)")
        return {
            "take_back": [r.engine_id for r in taken],
            "move_in": [r.engine_id for r in plan.move_in],
            "start": started + [r.engine_id for r in again],
            "retire": [r.engine_id for r in retiring],
        }

    def _call_off_retirement(self, record: EngineRecord) -> str:
        """End a draining engine's retirement (its ``_retirement`` task, its keeping warm); what it was, in words."""
        if task := self._retiring.pop(record.engine_id, None):
            task.cancel()
        was = "kept warm" if record.warm_since is not None else "draining"
        record.warm_since = record.warm_cut = None
        return was

    def _unplaceable(self, targets: dict[str, int]) -> list[str]:
        """Why the alive nodes cannot hold pools of ``targets`` engines (none: they can), so that a new
        engine never waits for a host its pool may not use or that has no room."""
        if all(targets[role] <= self.pools.targets[role] for role in ROLES):
            return []  # shrinking needs no room
        pools = {role: self.pools.spec.pool(role).model_copy(update={"replicas": targets[role]}) for role in ROLES}
        nodes = self.nodes()
        if nodes is None:  # then let Ray try
            return []
        return assign(self.pools.spec.model_copy(update=pools), nodes)[1]

    def _grow(self, role: str, count: int) -> list[str]:
        """Start up to ``count`` engines on the lowest free replicas (one that is stopping holds its
        replica until it stopped; ``_retirement`` then grows the pool to its target)."""
        started: list[str] = []
        if count <= 0:
            return started
        held = (replica(e) for e in self.pools.engines if self.pools.launches[e].role == role)
        wanted = set(new_replicas(held, count))
        launches = [launch for launch in self.pools.launches_of(role) if replica(launch.engine_id) in wanted]
        if len(launches) < count and self.pools.spec.move_problem() is None:
            # The pool's own launches are held by engines that moved away: the other pool's free ones have the
            # same shape (an engine serves the pool its record says, whatever its id).
            free = [e for e in self.pools.launches.values() if e.role != role and e.engine_id not in self.pools.engines]
            launches += free[: count - len(launches)]
        for launch in launches:
            self.pools.add(launch, role)
            self.starts.launch(launch.engine_id)
            started.append(launch.engine_id)
        return started

    def retire(self, record: EngineRecord, drain: bool | None = None, keep_warm_s: float = 0.0) -> None:
        """Retire an engine: drain it (when it served: ``drain`` None; ``drain`` says so after a restart)
        and stop it, in a task of its own, which a scale-up cancels to take the engine back while it drains.
        Its state changes now, so that a scale that follows at once counts it as retiring."""
        announce = drain is None
        if record.state == MOVING:  # called off: it retires from the pool it has not left yet
            record.role, record.moving_from = record.moving_from, None  # type: ignore[assignment]
            record.state, drain = "ready", None
        if drain is None:
            drain = record.state == "ready"
            record.state = "draining"
        record.stopping = not drain  # one that does not serve is not taken back
        self._retiring[record.engine_id] = self.tasks.spawn(
            self._retirement(record, drain, announce and drain, keep_warm_s if drain else 0.0)
        )

    async def _retirement(self, record: EngineRecord, drain: bool, announce: bool, keep_warm_s: float = 0.0) -> None:
        """``retire``'s task: out of the proxy's pool (``announce``), drained, kept warm, stopped."""
        if announce:
            await self.proxy.publish(record.role)
            self.events.add(f"{record.engine_id} draining: out of the proxy's pool; finishing its requests")
        if drain:
            await self._wait_drained(record)
        if keep_warm_s > 0 and self._warm_room() > 0:
            await self._keep_warm(record, keep_warm_s)
        record.stopping = True  # from here on it stops: a scale-up starts another engine instead
        self._retiring.pop(record.engine_id, None)
        await self.starts.stop(record)
        if self.pools.phase == "ready":  # a scale-up while it stopped waited for its replica
            await self.resize(record.role, "its replica is free again")

    async def _keep_warm(self, record: EngineRecord, keep_warm_s: float) -> None:
        """Idle and up for ``keep_warm_s``, unless ``_fit_warm`` needs its room first; a take-back cancels it."""
        record.warm_since, record.warm_cut = time.monotonic(), asyncio.Event()
        self.events.add(
            f"{record.engine_id} drained; kept warm for {keep_warm_s:g}s (autoscaling.keep_warm_s): a scale-up "
            "meanwhile takes it back at once"
        )
        try:
            await asyncio.wait_for(record.warm_cut.wait(), keep_warm_s)  # _cut_warm: stopped before its time
        except TimeoutError:
            self.events.add(f"{record.engine_id} not taken back in {keep_warm_s:g}s: stopping it")
        record.warm_since = record.warm_cut = None

    def _warm(self) -> list[EngineRecord]:
        """Engines kept warm now, the longest-warm first."""
        warm = [r for r in self.pools.engines.values() if r.warm_cut is not None and not r.warm_cut.is_set()]
        return sorted(warm, key=warm_since)

    def _warm_room(self) -> int:
        """How many more engines may be kept warm (``rules.warm_room``)."""
        return warm_room(self.pools.max_engines(), sum(self.pools.targets.values()), len(self._warm()))

    def _fit_warm(self) -> None:
        """Stop engines kept warm while the targets and they exceed the budget (``rules.warm_to_stop``)."""
        serving = sum(self.pools.targets.values())
        for record in warm_to_stop(self._warm(), warm_since, self.pools.max_engines(), serving):
            self._cut_warm(record, "autoscaling.max_engines needs its room")

    def _cut_warm(self, record: EngineRecord, why: str) -> None:
        record.warm_cut.set()  # type: ignore[union-attr]
        self.events.add(f"{record.engine_id} no longer kept warm: {why}")

    async def _wait_drained(self, record: EngineRecord, poll_s: float = MONITOR_INTERVAL_S) -> None:
        """Until the engine has nothing in flight, queued, running or held (KV not yet read), or
        ``engine.drain_timeout_s`` passed; asked every ``poll_s``."""
        deadline = time.monotonic() + self.pools.spec.engine.drain_timeout_s
        while True:
            busy = await self._busy(record)
            if not busy:
                return
            if time.monotonic() > deadline:
                self.events.add(
                    f"{record.engine_id} still busy after {self.pools.spec.engine.drain_timeout_s:g}s "
                    f"(engine.drain_timeout_s): {busy}; stopping it anyway"
                )
                return
            await asyncio.sleep(poll_s)

    async def _busy(self, record: EngineRecord) -> str:
        """What keeps a draining engine busy, in words; '' when nothing does (or it is gone)."""
        reasons, role = [], record.moving_from or record.role  # a moving engine finishes its old pool's work
        if in_flight := await self.proxy.in_flight(record.engine_id, role):
            reasons.append(f"{in_flight} request(s) in flight at the proxy")
        gauges = await engine_gauges(record.url)
        if gauges is None:
            return ""  # not answering: nothing left to wait for
        if running := gauges.get("vllm:num_requests_running", 0) + gauges.get("vllm:num_requests_waiting", 0):
            reasons.append(f"{running:g} request(s) running or queued")
        if role == "prefill" and (used := gauges.get("vllm:kv_cache_usage_perc", 0)):
            reasons.append(f"{used:.1%} of its KV cache still held for decode engines")
        return "; ".join(reasons)
