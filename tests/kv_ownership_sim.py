"""KV ownership explored on the production code: every order of the events of a few requests, with only the
process edges simulated.

What runs is the connector as vLLM drives it: each engine's scheduler side (``PdserveScheduler``) and its
workers (``PdserveWorker``, one per TP rank, with the real ``KVReader``, ``ReadRecord``s, ``HandshakeCache``,
``LeaseHolder``, ``LeaseTable`` and ``NixlKVTransport``). What is simulated is what lies outside a process:

- NIXL's API (``tests/fake_nixl.py``): a READ stays in flight until the explorer lands it (copying what its
  source blocks hold *then*), fails it, or, when the scope says NIXL cancels, its release cancels it; a release
  of a READ in flight is refused otherwise (it may land after its abort);
- the side channel: handshakes and pins run on an executor whose calls the explorer answers in any order, or
  answers and loses the answer; releases (the proxy's, the reader's) are delivered in any order, or lost;
- the clock (one clock for every module, moved by ``tick``; these edges are ``tests/kv_sim_edges.py``);
- vLLM's side of the engines: the block pools (a block freed goes back LIFO, as vLLM reuses non-cached blocks,
  and is scribbled over at once: whatever reuses it), each step's calls of the connector in vLLM's order, the
  requests' compute (a computed block holds its request's stamp), a failed load recomputed in fresh blocks;
- a restart of either engine (its process killed: its memory and READs into it gone; a new start under the
  same engine id and side-channel ports).

Checked after every event, on what a user would see: a decode request served from a READ holds its prompt's
KV (``served-wrong-kv``: its source blocks were freed, reused, or of another start while the READ ran); a
decode block vLLM handed to anyone else is never written by a READ (``landed-in-reused``); nothing the
connector contains raises (``internal``). At the end of time, with every message delivered and every READ
over: every lease and read record ended within lease + margin, every decode request was served, no block is
held or keyed by a request id any more, and every block is back in its pool or quarantined (``never-ends``).

A state is the whole world's: every field of the production objects (deadlines included), the messages and
READs in flight, the pools and stamps, the clock. ``explore`` walks every state reachable from the empty
one, depth first, once each.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import io
import logging
import os
import pickle
import random
import threading
import types
from collections.abc import Callable, Hashable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import connectors.holder
import connectors.reader
import connectors.transport.base
import connectors.transport.nixl
import connectors.worker
from connectors.errors import TransportError
from connectors.identity import ENGINE_EPOCH_ENV
from connectors.reader import KVReader
from connectors.scheduler import PdserveScheduler
from connectors.transport.nixl import NixlKVTransport
from connectors.worker import PdserveWorker
from contract import wire
from contract.auth import SECRET_ENV, SECRET_FILE_ENV
from contract.wire import parse_tcp_endpoint
from tests.fake_nixl import Fabric
from tests.kv_probes import held_leases, holder_tracked, reader_tracked, scheduler_tracked
from tests.kv_sim_edges import (
    _CLOCKED,
    CLOCK,
    Call,
    Clock,
    Executor,
    Ids,
    Message,
    Peers,
    Releases,
    Server,
    _fields,
    unlock,
)

TTL, MARGIN, TRANSFER_TIMEOUT = 2, 1, 3
"""Ticks: a lease's life, the read margin (and the holder's grace), a READ's timeout and an abort's drain time."""
BLOCK_SIZE, HEAD_DIM, LAYERS, HEADS = 16, 4, 2, 2
TOKENS = 16  # one block per prompt
PREFILL_PORT, DECODE_PORT = 17600, 17700
SECRET = "the-ownership-exploration-secret-0123"
MODEL = {"model": "sim/model", "revision": None, "hf_config": SimpleNamespace(to_dict=lambda: {"hidden": 8})}


@dataclasses.dataclass(frozen=True)
class Scope:
    """What one exploration lets happen."""

    prompts: tuple[str, ...] = ("A",)
    prefill_tp: int = 2
    samples: int = 1
    """Decode requests per prompt (``n``): vLLM's ``{i}_{parent}`` fan-out, one of them reads."""
    faults: int = 1
    """How many faults one run may have: a READ failed, a side-channel answer or release lost."""
    proxy_releases: bool = True
    prefill_restart: bool = False
    decode_restart: bool = False
    cancels: bool = False
    """NIXL accepts the release of a READ in flight (cancels it: nothing of it lands)."""
    end: int = TTL + 1
    """The last tick explored; then everything is delivered and time runs past every lease."""


# ---------------------------------------------------------------- vLLM's side of an engine


@dataclasses.dataclass(eq=False)
class Block:
    """vLLM's ``KVCacheBlock``, as the connector sees it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Any = None
    is_null: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """vLLM's ``Request``, as the connector sees it."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=lambda: list(range(TOKENS)))
    num_computed_tokens: int = 0
    status: Any = None
    blocks: list[Block] = dataclasses.field(default_factory=list)
    phase: str = "waiting"  # waiting, loading, served, finished
    stamp: Hashable = None  # what its blocks must hold once served (its prompt's KV)
    prompt: str = ""


class Pool:
    """An engine's block pool: a freed block goes back last-in first-out (as vLLM reuses blocks with no hash)."""

    def __init__(self, size: int) -> None:
        self.blocks = [Block(i) for i in range(size)]
        self.free = list(range(size - 1, -1, -1))

    def allocate(self, count: int) -> list[Block] | None:
        if len(self.free) < count:
            return None
        taken = [self.blocks[self.free.pop()] for _ in range(count)]
        for block in taken:
            block.ref_cnt = 1
        return taken

    def give_back(self, blocks: list[Block]) -> list[int]:
        """vLLM frees a request's blocks; those with no reference left are free (returned)."""
        freed = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free.append(block.block_id)
                freed.append(block.block_id)
        return freed


def vllm_config(engine_id: str, tp_size: int) -> SimpleNamespace:
    extra = {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": PREFILL_PORT if engine_id == "prefill" else DECODE_PORT,
        "lease_ttl_s": TTL,
        "read_margin_s": MARGIN,
        "transfer_timeout_s": TRANSFER_TIMEOUT,
        "handshake_timeout_s": 1,
        "load_wait_s": 0,
        "transports": ["nixl"],
    }
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HEAD_DIM, use_mla=False, **MODEL
        ),  # fmt: skip
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
    )


class Engine:
    """One start of an engine: vLLM's scheduler (pool, requests) with our scheduler side, and its workers."""

    def __init__(self, world: World, engine_id: str, tp_size: int, start: int, pool_size: int) -> None:
        self.engine_id, self.tp_size, self.start = engine_id, tp_size, start
        self.pool = Pool(pool_size)
        self.requests: dict[str, Request] = {}
        self.sending: dict[str, int] = {}  # ranks that reported a request finished sending
        self.recving: dict[str, int] = {}
        self.alive = True
        config = vllm_config(engine_id, tp_size)
        os.environ[ENGINE_EPOCH_ENV] = f"{'a' if engine_id == 'prefill' else 'd'}{start}"  # hex, as engines' are
        self.scheduler = PdserveScheduler(config, engine_id)
        self.scheduler._releases = Releases(world)
        self.workers: list[PdserveWorker] = []
        for rank in range(tp_size):
            Ids.next = f"{engine_id[0]}{start}r{rank}"
            worker = PdserveWorker(config, engine_id, SimpleNamespace(num_blocks=pool_size), world.transport)
            worker._reader = KVReader(
                engine_id, worker.settings, worker._auth, worker._answered, peers=Peers(world), executor=Executor(world)
            )
            heads = HEADS // tp_size
            caches = {f"layer.{i}": torch.zeros((pool_size, heads, BLOCK_SIZE, 2 * HEAD_DIM)) for i in range(LAYERS)}
            worker.register_kv_caches(caches, rank)
            self.workers.append(worker)
        del os.environ[ENGINE_EPOCH_ENV]

    @property
    def agents(self) -> list[str]:
        return [worker._transport.get("nixl").agent_name for worker in self.workers]

    def rank_at(self, port: int) -> PdserveWorker:
        return self.workers[port - PREFILL_PORT]


# ---------------------------------------------------------------- the world


class World:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.t = 0
        self.pool_size = 2 * len(scope.prompts) * scope.samples + 1  # room for a recompute beside quarantined blocks
        self.fabric = Fabric(self.pool_size, cancels=scope.cancels)
        self.calls: list[Call] = []
        self.messages: list[Message] = []
        self.violations: list[str] = []
        self.issued: dict[str, dict[str, Any]] = {}  # prompt -> its prefill's kv_transfer_params (the proxy's)
        self.sent: set[str] = set()  # prompts sent to a decode engine
        self.proxy_released: set[str] = set()
        self.restarts = {"prefill": 0, "decode": 0}
        self.faults = 0
        self.prefill = self._engine("prefill")
        self.decode = self._engine("decode")

    def _engine(self, role: str) -> Engine:
        start = self.restarts[role]
        tp_size = self.scope.prefill_tp if role == "prefill" else 1
        engine = Engine(self, role, tp_size, start, self.pool_size)
        unlock(engine)
        return engine

    def transport(self, name: str, engine_id: str, timeout_s: float) -> NixlKVTransport:
        return NixlKVTransport(engine_id, transfer_timeout_s=timeout_s, progress="caller", nixl_api=self.fabric.api())

    # ------------------------------------------------------------ events

    def events(self) -> Iterator[str]:
        scope = self.scope
        faults = self.faults < scope.faults
        for prompt in scope.prompts:
            if prompt not in self.issued:
                yield f"prefill {prompt}"
            elif prompt not in self.sent:
                yield f"decode {prompt}"
            if prompt in self.issued and prompt not in self.proxy_released and scope.proxy_releases:
                yield f"proxy-release {prompt}"
        if self._prefill_has_work():
            yield "p-step"
        if self._decode_has_work():
            yield "d-step"
        for request in self.decode.requests.values():
            if request.phase == "served":
                yield f"finish {request.request_id}"
        if any(call.what == "handshake" for call in self.calls):
            yield "handshakes"  # answered together: they commute with everything but a restart
        for i, call in enumerate(self.calls):
            if call.what == "pin":
                yield f"answer {i}"
                if faults:
                    yield f"lose {i}"
        for i, _ in enumerate(self.messages):
            yield f"deliver {i}"
            if faults:
                yield f"drop {i}"
        for i, _ in enumerate(self.fabric.in_flight):
            yield f"land {i}"
            if faults:
                yield f"fail {i}"
        if self.t < scope.end:
            yield "tick"
        if scope.prefill_restart and self.restarts["prefill"] == 0:
            yield "p-restart"
        if scope.decode_restart and self.restarts["decode"] == 0:
            yield "d-restart"

    def _prefill_has_work(self) -> bool:
        """Whether a prefill step can change anything (a step that cannot is not explored: same state)."""
        engine = self.prefill
        if engine.scheduler._to_hold:
            return True
        for worker in engine.workers:
            holder, agent = worker._holder, worker._transport.get("nixl")._agent
            deadlines = holder._leases._deadlines
            if holder.releases_in.queue or holder.notifications_in.queue or agent.notifications or holder._early:
                return True
            if deadlines and deadlines[0][0] <= self.t:
                return True
        return False

    def _decode_has_work(self) -> bool:
        engine = self.decode
        reader = engine.workers[0]._reader
        waiting = any(r.phase in ("waiting", "loading") for r in engine.requests.values())
        return bool(
            waiting or reader._records or reader._quarantine or reader._sources._stale or engine.scheduler._to_receive
        )

    def run(self, event: str) -> None:
        """One event, on the production objects; an exception out of our code is a violation."""
        verb, _, arg = event.partition(" ")
        Clock.t = float(self.t)
        try:
            getattr(self, "on_" + verb.replace("-", "_"))(arg)
        except Exception as e:  # noqa: BLE001 - whatever it is, it is what the exploration looks for
            self.violations.append(f"internal: {event} raised {type(e).__name__}: {e}")

    def on_tick(self, _: str) -> None:
        self.t += 1

    def on_prefill(self, prompt: str) -> None:
        from vllm.v1.request import RequestStatus

        engine = self.prefill
        blocks = engine.pool.allocate(1)
        params = {wire.DO_REMOTE_DECODE: True, wire.PDSERVE_READER: "decode"}
        request = Request(prompt, params, num_computed_tokens=TOKENS, status=RequestStatus.FINISHED_LENGTH_CAPPED)
        request.blocks, request.stamp = blocks, (prompt, engine.start)
        for agent in engine.agents:
            self.fabric.write(agent, [b.block_id for b in blocks], request.stamp)
        held, issued = engine.scheduler.request_finished(request, [b.block_id for b in blocks])
        if held:
            engine.requests[prompt] = request
        else:
            self._free(engine, blocks)
        self.issued[prompt] = dict(issued or {}, prompt_stamp=request.stamp)

    def on_decode(self, prompt: str) -> None:
        self.sent.add(prompt)
        params = {k: v for k, v in self.issued[prompt].items() if k != "prompt_stamp"}
        samples = self.scope.samples
        for i in range(samples):
            request_id = f"{i}_{prompt}" if samples > 1 else prompt
            request = Request(request_id, dict(params) if params else None, prompt=prompt)
            request.stamp = self.issued[prompt]["prompt_stamp"]
            self.decode.requests[request_id] = request
        self._schedule_decode()

    def _schedule_decode(self) -> None:
        """vLLM's scheduler: waiting requests ask the connector, get blocks, and load or compute."""
        engine = self.decode
        for request in engine.requests.values():
            if request.phase != "waiting":
                continue
            count, load = engine.scheduler.get_num_new_matched_tokens(request, 0)
            if count is None:
                continue  # a sample waiting for its sibling's load
            blocks = engine.pool.allocate(1)
            if blocks is None:
                continue
            request.blocks = blocks
            kv_blocks = SimpleNamespace(blocks=(blocks,))
            engine.scheduler.update_state_after_alloc(request, kv_blocks, count if load else 0)
            if load:
                request.phase = "loading"
            else:
                self._compute(request)

    def _compute(self, request: Request) -> None:
        """The engine computes the prompt into the request's blocks (a hit of its prefix cache: the same KV)."""
        self.fabric.write(self.decode.agents[0], [b.block_id for b in request.blocks], request.stamp)
        request.phase = "served"

    def on_proxy_release(self, prompt: str) -> None:
        self.proxy_released.add(prompt)
        release = self.issued[prompt].get(wire.PDSERVE_RELEASE)
        if release:
            for endpoint in release["endpoints"]:
                self.messages.append(Message(parse_tcp_endpoint(endpoint)[1], "release", prompt))

    def on_p_step(self, _: str) -> None:
        engine = self.prefill
        meta = engine.scheduler.build_connector_meta()
        for worker in engine.workers:
            worker.start_load_kv(meta)
        for worker in engine.workers:
            sending, _, _ = worker.transfer_results()
            self._check_contained(worker, "prefill")
            for request_id in sending:
                engine.sending[request_id] = engine.sending.get(request_id, 0) + 1
                if engine.sending[request_id] == engine.tp_size:  # vLLM: every rank is done with it
                    del engine.sending[request_id]
                    request = engine.requests.pop(request_id)
                    self._free(engine, request.blocks)

    def _free(self, engine: Engine, blocks: list[Block]) -> None:
        """Blocks vLLM gets back are scribbled over at once: whoever reuses them."""
        for block_id in engine.pool.give_back(blocks):
            for agent in engine.agents:
                self.fabric.write(agent, [block_id], ("reused", engine.engine_id))

    def on_d_step(self, _: str) -> None:
        engine = self.decode
        self._schedule_decode()
        meta = engine.scheduler.build_connector_meta()
        [worker] = engine.workers
        worker.start_load_kv(meta)
        _, recving, failed = worker.transfer_results()
        self._check_contained(worker, "decode")
        errors = worker.get_block_ids_with_load_errors()
        output = SimpleNamespace(
            kv_connector_worker_meta=worker.take_reports(), finished_recving=recving, failed_recving=failed
        )
        engine.scheduler.update_connector_output(output)
        worker.take_stats()
        for request_id in recving:
            request = engine.requests[request_id]
            if request_id in failed:
                if not {b.block_id for b in request.blocks} <= errors:
                    self.violations.append(f"internal: {request_id}'s failed blocks were not all reported")
                self._free(engine, request.blocks)  # vLLM: recomputed in blocks it takes again
                request.blocks = engine.pool.allocate(1) or []
                if not request.blocks:
                    self.violations.append(f"never-ends: no block left to recompute {request_id} in")
                    continue
                self._compute(request)
            else:
                request.phase = "served"
                self._check_served(request)
        self._schedule_decode()

    def _check_served(self, request: Request) -> None:
        for block in request.blocks:
            held = self.fabric.read(self.decode.agents[0], block.block_id)
            if held != request.stamp:
                self.violations.append(
                    f"served-wrong-kv: {request.request_id} served block {block.block_id} holding {held!r}, "
                    f"not its prompt's KV {request.stamp!r}"
                )

    def _check_contained(self, worker: PdserveWorker, role: str) -> None:
        stats = worker.take_stats()
        if stats is not None and stats.data["failures"].get("internal"):
            self.violations.append(f"internal: the {role} worker's connector raised (contained)")

    def on_finish(self, request_id: str) -> None:
        engine = self.decode
        request = engine.requests.pop(request_id)
        self._check_served(request)  # nothing landed in its blocks while it ran
        from vllm.v1.request import RequestStatus

        request.status = RequestStatus.FINISHED_STOPPED
        engine.scheduler.request_finished(request, [b.block_id for b in request.blocks])
        self._free(engine, request.blocks)

    def on_answer(self, index: str, lose: bool = False) -> None:
        call = self.calls.pop(int(index))
        try:
            call.future._result = call.fn(*call.args)
        except Exception as e:  # noqa: BLE001 - the production code's own failure, as the pool would keep it
            call.future._error = e
        if lose:
            call.future._result, call.future._error = None, TransportError("the answer was lost")
        call.future._done = True

    def on_handshakes(self, _: str) -> None:
        for i in reversed([i for i, call in enumerate(self.calls) if call.what == "handshake"]):
            self.on_answer(str(i))

    def on_lose(self, index: str) -> None:
        self.faults += 1
        self.on_answer(index, lose=True)

    def on_deliver(self, index: str) -> None:
        message = self.messages.pop(int(index))
        if not self.prefill.alive:
            return
        rank = self.prefill.rank_at(message.port)
        if message.what == "release":
            rank._holder.releases_in.put(message.body)
        else:
            rank._holder.add_notification(*message.body)

    def on_drop(self, index: str) -> None:
        self.faults += 1
        self.messages.pop(int(index))

    def on_land(self, index: str) -> None:
        xfer = self.fabric.in_flight[int(index)]
        reader = self.fabric.agents[xfer.reader]
        if reader.alive:  # a block is the READ's request's while it loads, or quarantined: nobody's
            engine = self.decode
            owners = {b.block_id: r for r in engine.requests.values() for b in r.blocks}
            for _, block in xfer.pairs:
                owner = owners.get(block)
                if block in engine.pool.free or (owner is not None and owner.phase != "loading"):
                    self.violations.append(f"landed-in-reused: a READ landed in decode block {block}, vLLM's now")
        self.fabric.land(xfer)

    def on_fail(self, index: str) -> None:
        self.faults += 1
        self.fabric.fail(self.fabric.in_flight[int(index)])

    def on_p_restart(self, _: str) -> None:
        self._restart("prefill")

    def on_d_restart(self, _: str) -> None:
        self._restart("decode")

    def _restart(self, role: str) -> None:
        """The engine's process is killed and Ray starts it again: same id and ports, a new start."""
        old = getattr(self, role)
        for agent in old.agents:
            self.fabric.die(agent)
        if role == "decode":  # what it asked may have reached the prefill engine: its answers reach nobody
            for call in self.calls:
                with contextlib.suppress(Exception):
                    call.fn(*call.args)
            self.calls = []
        self.restarts[role] += 1
        setattr(self, role, self._engine(role))
        if role == "decode":  # the proxy moves its requests: the prefill's KV released, the prompt computed anew
            for request in old.requests.values():
                if request.prompt not in self.proxy_released:
                    self.on_proxy_release(request.prompt)
                moved = Request(request.request_id, None, prompt=request.prompt)
                moved.stamp = request.stamp
                self.decode.requests[moved.request_id] = moved
            self._schedule_decode()

    # ------------------------------------------------------------ the end

    def quiescent_violations(self) -> list[str]:
        """Every message delivered, every call answered, every READ landed, time past every lease: what is open."""
        world = clone(self)
        world.violations = []
        for t in (self.t, self.t + TTL + MARGIN):  # now, then a lease and its margin later: everything has ended
            world.t = t
            for _ in range(4):
                for _ in world.calls[:]:
                    world.run("answer 0")
                for _ in world.messages[:]:
                    world.run("deliver 0")
                for _ in world.fabric.in_flight[:]:
                    world.run("land 0")
                for request in list(world.decode.requests.values()):
                    if request.phase == "served":
                        world.run(f"finish {request.request_id}")
                world.run("p-step")
                world.run("d-step")
        problems = list(world.violations)
        for role in ("prefill", "decode"):
            engine: Engine = getattr(world, role)
            for worker in engine.workers:
                if held_leases(worker._holder._leases):
                    problems.append(f"never-ends: {role} holds {held_leases(worker._holder._leases)} lease(s)")
                if worker._reader._records:
                    problems.append(f"never-ends: {role} keeps read records {sorted(worker._reader._records)}")
                if holder_tracked(worker._holder) or reader_tracked(worker._reader):
                    problems.append(f"never-ends: {role} keeps request ids (holder, reader)")
            if kept := scheduler_tracked(engine.scheduler):
                problems.append(f"never-ends: {role}'s scheduler side keeps {kept} record(s)")
            if engine.requests:
                problems.append(f"never-ends: {role} requests never served: {sorted(engine.requests)}")
            lost = len(engine.pool.blocks) - len(engine.pool.free) - engine.scheduler.quarantined_blocks
            if lost:
                problems.append(f"never-ends: {lost} block(s) of {role} neither free nor quarantined")
        return problems

    def settled(self) -> bool:
        """Nothing on its way: no call, message or READ in flight (the explorer delivers them in every order)."""
        return not (self.calls or self.messages or self.fabric.in_flight)

    def key(self) -> int:
        return hash(freeze(self))


# ---------------------------------------------------------------- states

_SKIP = frozenset({
    "started_at", "finished_at",
    "_stats", "_counted", "_counts", "_sequence", "_refusals", "_internal_errors", "_faults", "_vllm_config",
    "_kv_cache_config", "settings", "_auth", "_transport_factory", "_factory", "scope", "world", "_logger",
    "_releases", "_releases_out", "_side", "_handshake_pool", "_clock", "fn", "violations", "_limited", "_last",
    "_suppressed", "fabric_ref",
})  # fmt: skip
"""Fields that never tell two states apart: counters, configuration, the edges' plumbing."""


_FROZEN: dict[int, tuple[Any, Hashable]] = {}  # id -> (the immutable object, kept alive; its value)
_ATOMS = (type(None), bool, int, float, str, bytes)
_SEQUENCES = (list, tuple, collections.deque)
_OPAQUE_VALUES = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, Clock, logging.Logger)


def freeze(root: Any) -> Hashable:
    """A hashable value of everything reachable from ``root``: each object once (a second reference is its
    visiting number), dicts in their order, sets as frozensets, ``IMMUTABLE`` objects by their repr."""
    refs: dict[int, tuple[str, int]] = {}

    def walk(obj: Any) -> Hashable:
        if isinstance(obj, _ATOMS):
            return obj
        if isinstance(obj, IMMUTABLE):
            known = _FROZEN.get(id(obj))
            if known is None or known[0] is not obj:
                value = obj.shape if isinstance(obj, np.ndarray) else repr(obj)
                known = _FROZEN[id(obj)] = (obj, value)
            return known[1]
        if isinstance(obj, enum.Enum):
            return obj.name
        if isinstance(obj, _OPAQUE_VALUES):
            return getattr(obj, "__qualname__", type(obj).__name__)
        if isinstance(obj, torch.Tensor):
            return tuple(obj.shape)
        seen = refs.get(id(obj))
        if seen is not None:
            return seen
        refs[id(obj)] = ("ref", len(refs))
        if isinstance(obj, _SEQUENCES):
            return tuple(map(walk, obj))
        if isinstance(obj, dict):
            return tuple((walk(k), walk(v)) for k, v in obj.items())
        if isinstance(obj, (set, frozenset)):
            return frozenset(map(walk, obj))
        return (type(obj).__name__, *(walk(v) for n, v in _fields(obj) if n not in _SKIP))

    return walk(root)


# ---------------------------------------------------------------- the explorer


@dataclasses.dataclass
class Result:
    states: int
    transitions: int
    violations: dict[str, list[str]]  # kind -> the shortest trace found to it


def _immutable() -> tuple[type, ...]:
    from connectors.block_ranges import KVRegions, PlaneRanges
    from connectors.handshake import HandshakeResponse
    from connectors.metadata import ReceiveSpec
    from connectors.options import ConnectorSettings, FaultInjection
    from connectors.topology import KVTopology
    from contract.auth import KVAuth
    from contract.kv_report import KVReport
    from tests.fake_nixl import _Prepped

    return (KVRegions, PlaneRanges, HandshakeResponse, ReceiveSpec, KVTopology, KVReport, wire.KVTransferParams,
            ConnectorSettings, FaultInjection, KVAuth, np.ndarray, _Prepped, random.Random)  # fmt: skip


IMMUTABLE = _immutable()
"""Types no event changes once made (or, ``Random``, that the exploration never draws from): every copy of the
world shares them."""


@contextlib.contextmanager
def simulated_edges() -> Iterator[None]:
    """The clock, agent names, the side-channel server and the cluster secret, for the exploration's duration."""
    saved_time = [(module, module.time) for module in _CLOCKED]
    saved = (connectors.transport.nixl.uuid, connectors.worker.SideChannelServer, dict(os.environ))
    for module, _ in saved_time:
        module.time = CLOCK
    connectors.transport.nixl.uuid = Ids()
    connectors.worker.SideChannelServer = Server
    os.environ[SECRET_ENV] = SECRET
    os.environ.pop(SECRET_FILE_ENV, None)
    logging.disable(logging.CRITICAL)  # every refusal and expiry is logged: millions of lines here
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        _SHARED.clear()
        _FROZEN.clear()
        for module, original in saved_time:
            module.time = original
        connectors.transport.nixl.uuid, connectors.worker.SideChannelServer, environ = saved
        os.environ.clear()
        os.environ.update(environ)


_SHARED: dict[int, Any] = {}
"""What copies of a world share, by id: ``_BY_REFERENCE`` objects met while pickling, kept alive here."""


def sample(scope: Scope, walks: int, seed: int = 0, max_events: int = 80) -> Result:
    """``walks`` random runs of ``scope`` (seeded), each to the end of time and then settled: for scopes too large
    to explore whole. ``states`` counts the distinct states the runs passed through."""
    rng = random.Random(seed)
    seen: set[int] = set()
    transitions = 0
    violations: dict[str, list[str]] = {}
    with simulated_edges():
        for _ in range(walks):
            world, trace = World(scope), []
            while not world.violations and len(trace) < max_events:
                events = list(world.events())
                if not events:
                    break
                trace.append(rng.choice(events))
                world.run(trace[-1])
                transitions += 1
                seen.add(world.key())
            while not world.violations and world.t < scope.end:
                world.run("tick")
            found = world.violations or world.quiescent_violations()
            for violation in found:
                kind = violation.partition(":")[0]
                if kind not in violations or len(violations[kind]) > len(trace) + 1:
                    violations[kind] = [*trace, violation]
    return Result(len(seen), transitions, violations)


def _by_reference(obj: Any) -> tuple[Callable[[int], Any], tuple[int]]:
    _SHARED[id(obj)] = obj
    return _shared_object, (id(obj),)


def _shared_object(key: int) -> Any:
    return _SHARED[key]


_BY_REFERENCE = (*IMMUTABLE, Clock, types.FunctionType, SimpleNamespace, type(threading.Lock()))


class _Pickler(pickle.Pickler):
    """Pickles a world by value, except the ``_BY_REFERENCE`` objects every copy shares (a table the C pickler
    looks up by type)."""

    dispatch_table = {cls: _by_reference for cls in _BY_REFERENCE}


def clone(world: World) -> World:
    """A copy of ``world`` (pickled: several times faster than ``copy.deepcopy``)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(world)
    return pickle.loads(buffer.getbuffer())


def explore(scope: Scope, max_states: int = 500_000, stop_at: str | None = None) -> Result:
    """Every state reachable under ``scope``; the shortest trace found to each kind of violation (``stop_at``: end
    at the first of that kind, or of any with ``"any"``)."""
    with simulated_edges():
        start = World(scope)
        seen = {start.key()}
        stack: list[tuple[World, tuple[str, ...]]] = [(start, ())]
        transitions = 0
        violations: dict[str, list[str]] = {}
        while stack:
            world, trace = stack.pop()
            for event in list(world.events()):
                child = clone(world)
                child.run(event)
                transitions += 1
                key = child.key()
                found = child.violations
                if not found and key in seen:
                    continue
                if not found and child.t == scope.end and child.settled():
                    found = child.quiescent_violations()
                for violation in found:
                    kind = violation.partition(":")[0]
                    if kind not in violations or len(violations[kind]) > len(trace) + 2:
                        violations[kind] = [*trace, event, violation]
                    if stop_at in (kind, "any"):
                        return Result(len(seen), transitions, violations)
                if found:
                    continue
                seen.add(key)
                if len(seen) > max_states:
                    raise RuntimeError(f"more than {max_states} states")
                stack.append((child, (*trace, event)))
        return Result(len(seen), transitions, violations)
