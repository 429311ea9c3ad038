"""The process edges of the KV ownership exploration (``tests/kv_ownership_sim.py``): the one clock of every
module it drives, deterministic agent names, the reader's handshake pool and side-channel client, releases in
flight, the side-channel server's stand-in, and locks and queues that copy with a world (its one thread is the
explorer).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import connectors.holder
import connectors.reader
import connectors.transport.base
import connectors.transport.nixl
import contract.auth
from connectors.handshake import decode_response
from connectors.leases import PinAnswer
from contract.wire import parse_tcp_endpoint

if TYPE_CHECKING:
    from tests.kv_ownership_sim import World


class Clock:
    """The one clock of every module the exploration drives (``time.time``, ``time.monotonic``); never copied."""

    t = 0.0

    def time(self) -> float:
        return Clock.t

    monotonic = perf_counter = time

    def sleep(self, seconds: float) -> None:
        pass

    def __deepcopy__(self, memo: dict) -> Clock:
        return self


CLOCK = Clock()
_CLOCKED = (connectors.transport.base, connectors.transport.nixl, connectors.reader, connectors.holder, contract.auth)


class Ids:
    """``uuid.uuid4`` for the NIXL transport's agent names: the engine and its start, never random."""

    next = "0"

    def uuid4(self) -> SimpleNamespace:
        return SimpleNamespace(hex=Ids.next.ljust(8, "0"))


class Future:
    """A side-channel call's answer: set when the explorer answers (or loses) the call."""

    def __init__(self) -> None:
        self._done, self._result, self._error = False, None, None

    def done(self) -> bool:
        return self._done

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        return self._error


@dataclasses.dataclass(eq=False)
class Call:
    """A handshake or pin the reader submitted, not answered yet."""

    what: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future


class Executor:
    """The reader's handshake pool: calls wait in the world until the explorer answers them."""

    def __init__(self, world: World) -> None:
        self.world = world

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future = Future()
        what = "pin" if getattr(fn, "__name__", "") == "pin" else "handshake"
        self.world.calls.append(Call(what, fn, args, future))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


@dataclasses.dataclass(eq=False)
class Message:
    """A release or READ notification on its way to a prefill rank's side channel."""

    port: int
    what: str  # "release" or "read"
    body: Any


class Releases:
    """``ReleaseSender`` of a side that sends into the world: the messages wait until delivered or lost."""

    def __init__(self, world: World) -> None:
        self.world = world

    def release(self, endpoint: str, request_id: str, by: str | None = None) -> None:
        body = f"{request_id} {by}" if by else request_id
        self.world.messages.append(Message(parse_tcp_endpoint(endpoint)[1], "release", body))

    def read_done(self, endpoint: str, reader: str, notification: bytes) -> None:
        self.world.messages.append(Message(parse_tcp_endpoint(endpoint)[1], "read", (reader, notification)))

    def close(self) -> None:
        pass


class Peers:
    """The decode reader's side-channel client: the prefill rank behind a port answers, as its server would."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.releases = Releases(world)

    def handshake(self, topology: Any, endpoint: str, timeout_s: float) -> Any:
        rank = self.world.prefill.rank_at(parse_tcp_endpoint(endpoint)[1])
        return decode_response(rank._server.response, topology)

    def pin(self, endpoint: str, reader: str, request_id: str, epoch: str, timeout_s: float) -> PinAnswer:
        rank = self.world.prefill.rank_at(parse_tcp_endpoint(endpoint)[1])
        return PinAnswer(rank._holder.pin(f"{reader} {request_id} {epoch}").decode())

    def close(self) -> None:
        pass


class Server:
    """``SideChannelServer`` of a worker: keeps the handshake answer it was given (the explorer delivers)."""

    def __init__(self, engine_id: str, host: str, port: int, topology: Any, response: bytes, *args: Any, **kw: Any):
        self.endpoint, self.response = f"tcp://{host}:{port}", response
        self.refused = SimpleNamespace(take=dict)

    def close(self) -> None:
        pass


class NoLock:
    """A lock the exploration's one thread never waits on (and that can be copied with the world)."""

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    acquire = release = lambda self, *args, **kwargs: True  # noqa: E731


_LOCKS = (type(threading.Lock()), type(threading.RLock()))


class Queue:
    """The holder's ``queue.SimpleQueue``s, copyable: the side channel's thread is the explorer here."""

    def __init__(self) -> None:
        self.queue: collections.deque[Any] = collections.deque()

    def put(self, item: Any) -> None:
        self.queue.append(item)

    def get_nowait(self) -> Any:
        if not self.queue:
            raise queue.Empty
        return self.queue.popleft()


_OPAQUE = (str, bytes, int, float, type, types.ModuleType, np.ndarray, torch.Tensor, logging.Logger, logging.Handler)


def unlock(root: Any) -> None:
    """Replace every lock reachable from ``root`` with a ``NoLock``."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        items = _fields(obj)
        for name, value in items:
            if isinstance(value, _LOCKS):
                setattr(obj, name, NoLock())
            elif isinstance(value, queue.SimpleQueue):
                setattr(obj, name, Queue())
            else:
                stack.append(value)
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)


_SLOTS: dict[type, tuple[str, ...]] = {}


def _fields(obj: Any) -> list[tuple[str, Any]]:
    cls = type(obj)
    slots = _SLOTS.get(cls)
    if slots is None:
        slots = _SLOTS[cls] = tuple(
            n for c in cls.__mro__ for n in getattr(c, "__slots__", ()) if n not in ("__dict__", "__weakref__")
        )
    out = list(getattr(obj, "__dict__", {}).items())
    for name in slots:
        with contextlib.suppress(AttributeError):
            out.append((name, getattr(obj, name)))
    return out
