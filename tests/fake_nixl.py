"""A stand-in for NIXL's Python API (``nixl._api``): the process edge under ``NixlKVTransport``, for tests that
drive the real transport, reader and holder without NIXL's native library.

A ``Fabric`` joins the agents of one test (one per engine rank) and keeps what every block of every agent's
registered memory holds, as a *stamp* (any value: whose KV it is). A READ the transport posts stays in
flight (``PROC``) until the test decides its fate: ``land`` copies the stamps of its source blocks, as they are
at that moment, into its destination blocks and hands its notification to the source agent; ``fail`` ends it
with an error and moves nothing. Releasing the handle of a READ in flight is refused, as NIXL refuses one it
cannot cancel (the READ may still land), unless the fabric ``cancels``. An agent that ``dies`` (its process
killed) sends and receives nothing any more. Addresses are never dereferenced: a descriptor's address names a
block by its offset in the registered region it falls in (every region holds ``num_blocks`` blocks), so a copied
fabric (``copy.deepcopy``) works alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["Fabric", "FakeAgent", "FakeNixlApi", "NixlError", "Xfer"]


class NixlError(Exception):
    """What the bindings raise (``nixlBind.nixl*Error``)."""


@dataclasses.dataclass(eq=False)
class Xfer:
    """One posted READ: from ``source``'s blocks into ``reader``'s, block by block."""

    reader: str
    source: str
    pairs: tuple[tuple[int, int], ...]  # (source block, reader block)
    notify: bytes
    status: str = "NEW"  # PROC, DONE, ERR; CANCELLED once a release of it in flight was accepted
    released: bool = False


@dataclasses.dataclass(eq=False)
class _Prepped:
    agent: str
    blocks: np.ndarray  # the block each descriptor falls in

    def release(self) -> None:
        pass


class Fabric:
    """The agents of one test, the READs between them, and what each of their blocks holds."""

    def __init__(self, num_blocks: int, *, cancels: bool = False) -> None:
        self.num_blocks = num_blocks
        self.cancels = cancels
        self.agents: dict[str, FakeAgent] = {}
        self.memory: dict[tuple[str, int], Hashable] = {}
        self.in_flight: list[Xfer] = []

    def api(self) -> FakeNixlApi:
        return FakeNixlApi(self)

    def write(self, agent: str, blocks: Sequence[int], stamp: Hashable) -> None:
        for block in blocks:
            self.memory[(agent, block)] = stamp

    def read(self, agent: str, block: int) -> Hashable:
        return self.memory.get((agent, block))

    def land(self, xfer: Xfer) -> None:
        """The READ moves its bytes now (what the source blocks hold now) and is DONE."""
        self.in_flight.remove(xfer)
        source = self.agents.get(xfer.source)
        reader = self.agents.get(xfer.reader)
        alive = source is not None and source.alive
        if reader is not None and reader.alive:
            for from_block, to_block in xfer.pairs:
                self.memory[(xfer.reader, to_block)] = self.read(xfer.source, from_block) if alive else "garbage"
        if xfer.status == "PROC":
            xfer.status = "DONE" if alive else "ERR"
        if alive and xfer.notify and xfer.status == "DONE":
            source.notifications.setdefault(xfer.reader, []).append(xfer.notify)

    def fail(self, xfer: Xfer) -> None:
        """The READ ends with an error; nothing of it lands."""
        self.in_flight.remove(xfer)
        if xfer.status == "PROC":
            xfer.status = "ERR"

    def die(self, agent: str) -> None:
        """The agent's process is gone: its memory with it, and READs into it land nowhere."""
        self.agents[agent].alive = False
        for key in [key for key in self.memory if key[0] == agent]:
            del self.memory[key]


class FakeAgent:
    """``nixl_agent`` on a ``Fabric``: the calls ``NixlKVTransport`` makes."""

    backends = ("UCX",)
    plugin_list = ("UCX",)

    def __init__(self, fabric: Fabric, name: str) -> None:
        self.fabric = fabric
        self.name = name
        self.alive = True
        self.regions: list[tuple[int, int]] = []  # (address, size) of each registered region
        self.remotes: set[str] = set()
        self.notifications: dict[str, list[bytes]] = {}
        fabric.agents[name] = self

    def register_memory(self, descs: list[tuple[int, int, int, str]], mem_type: str, backends: Any = None) -> Any:
        self.regions += [(address, size) for address, size, *_ in descs]
        return tuple(self.regions)

    def deregister_memory(self, handle: Any, backends: Any = None) -> None:
        self.regions = []

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise NixlError(f"no agent {name}")
        self.remotes.add(name)
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.remotes.discard(name)

    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str, backends: Any = None) -> _Prepped:
        owner = self.name if agent == "NIXL_INIT_AGENT" else agent
        regions = self.fabric.agents[owner].regions
        blocks = []
        for address, *_ in np.asarray(descs).reshape(-1, 3).tolist():
            base, size = next((base, size) for base, size in regions if base <= address < base + size)
            blocks.append((address - base) // (size // self.fabric.num_blocks))
        return _Prepped(owner, np.asarray(blocks, dtype=np.int64))

    def make_prepped_xfer(
        self, op: str, local: _Prepped, local_idx: Any, remote: _Prepped, remote_idx: Any, notif_msg: bytes = b""
    ) -> Xfer:
        if op != "READ":
            raise NixlError(f"only READs here, got {op}")
        sources = remote.blocks[np.asarray(remote_idx)].tolist()
        pairs = zip(sources, local.blocks[np.asarray(local_idx)].tolist(), strict=True)
        return Xfer(self.name, remote.agent, tuple(sorted(set(pairs))), notif_msg)

    def transfer(self, xfer: Xfer) -> str:
        if xfer.source not in self.remotes:
            raise NixlError(f"{xfer.source} is not a remote agent of {self.name}")
        xfer.status = "PROC"
        self.fabric.in_flight.append(xfer)
        return "PROC"

    def check_xfer_state(self, xfer: Xfer) -> str:
        if xfer.released:
            raise NixlError("the handle was released")
        return xfer.status

    def release_xfer_handle(self, xfer: Xfer) -> None:
        if xfer.status == "PROC":
            if not self.fabric.cancels:
                raise NixlError("NIXL_ERR_REPOST_ACTIVE: the READ is in flight")
            xfer.status = "CANCELLED"
            self.fabric.in_flight.remove(xfer)
        xfer.released = True

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifications, self.notifications = self.notifications, {}
        return notifications


class FakeNixlApi:
    """The module ``NixlKVTransport`` builds its agent from (``nixl_api=``)."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.nixlBind = SimpleNamespace(nixlBackendError=NixlError)  # noqa: N815 - the binding's name

    @staticmethod
    def nixl_agent_config(**options: Any) -> SimpleNamespace:
        return SimpleNamespace(**options)

    def nixl_agent(self, name: str, config: Any) -> FakeAgent:
        return FakeAgent(self.fabric, name)
