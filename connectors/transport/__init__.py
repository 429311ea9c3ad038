"""KV transports behind one protocol, and the choice of one per peer pair.

``base.KVTransport`` is what every transport implements (register caches, an
opaque handshake payload, read block runs, notifications, abort, close);
``nixl.NixlKVTransport`` moves blocks over NIXL/UCX (RDMA between hosts,
shared memory or TCP on one host; CPU or GPU memory), ``cuda_ipc.CudaIpcTransport``
gathers them device to device from the caches of another process whose GPU
this one sees (engines on the GPUs of one node), ``fake.InMemoryTransport``
copies them between tensors of one process (unit tests of the code above the
seam). ``make_transport`` builds one by name (``FACTORIES``); a worker holds
its transports in a ``group.WorkerTransports``.

``choose_transport`` picks, for one pair of peers, the first transport both
offer in the order that suits where they are (``Where``): the same node, or
different nodes. Each side offers what it can run
(``WorkerTransports``: what its settings name and it can build); the prefill side's
offer travels in its handshake answer, and the decode side says which it
chose in every request's report (``transport=...`` in ``X-PDServe-KV``).
When the first common transport cannot reach the peer after all (its GPU is
not visible here, a mapping fails), the reader tries the next one
(``common_transports``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING

from connectors.errors import TransportError

if TYPE_CHECKING:
    from connectors.transport.base import KVTransport

__all__ = [
    "CONFIGURABLE",
    "CUDA_IPC",
    "DEFAULT_TRANSPORTS",
    "FACTORIES",
    "IN_MEMORY",
    "NIXL",
    "PREFERENCE",
    "TRANSPORTS",
    "Where",
    "common_transports",
    "make_transport",
    "node_identity",
    "where",
]

NIXL, CUDA_IPC, IN_MEMORY = "nixl", "cuda-ipc", "in-memory"
TRANSPORTS = (NIXL, CUDA_IPC, IN_MEMORY)
CONFIGURABLE = (CUDA_IPC, NIXL)
"""What ``connector.transports`` may name (the in-memory transport is for unit tests only)."""
# What a worker builds unless its settings say otherwise: CUDA IPC where its caches are on a GPU (it
# stands aside on CPU caches), NIXL everywhere.
DEFAULT_TRANSPORTS = (CUDA_IPC, NIXL)


class Where(enum.StrEnum):
    """Where two peers are, seen from the reader."""

    SAME_NODE = "same-node"
    OTHER_NODE = "other-node"


PREFERENCE: dict[Where, tuple[str, ...]] = {
    # GPUs of one node: a device-to-device copy beats any network path.
    Where.SAME_NODE: (CUDA_IPC, NIXL, IN_MEMORY),
    # Across nodes: NIXL (RDMA where UCX finds it).
    Where.OTHER_NODE: (NIXL,),
}


def where(local_node: str, remote_node: str) -> Where:
    """Where a peer on ``remote_node`` is from ``local_node`` (node ids as the handshake carries them)."""
    return Where.SAME_NODE if local_node and local_node == remote_node else Where.OTHER_NODE


def common_transports(ours: Sequence[str], theirs: Sequence[str], place: Where) -> tuple[str, ...]:
    """The transports of ``PREFERENCE[place]`` both sides offer, best first."""
    return tuple(name for name in PREFERENCE[place] if name in ours and name in theirs)


@cache
def node_identity() -> str:
    """This machine's boot id and network namespace: two processes with the same identity share a node's
    memory and devices (network namespaces count apart, as the multi-host test bed's hosts do)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def _nixl(engine_id: str, transfer_timeout_s: float) -> KVTransport:
    from connectors.transport.nixl import NixlKVTransport

    return NixlKVTransport(engine_id, transfer_timeout_s=transfer_timeout_s)


def _cuda_ipc(engine_id: str, transfer_timeout_s: float) -> KVTransport:
    from connectors.transport.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport(engine_id, transfer_timeout_s=transfer_timeout_s)


def _in_memory(engine_id: str, transfer_timeout_s: float) -> KVTransport:
    from connectors.transport.fake import InMemoryTransport

    return InMemoryTransport(engine_id)


# name -> factory(engine_id, transfer_timeout_s); each imports its backend only when called.
FACTORIES: dict[str, Callable[[str, float], KVTransport]] = {
    NIXL: _nixl,
    CUDA_IPC: _cuda_ipc,
    IN_MEMORY: _in_memory,
}


def make_transport(name: str, engine_id: str, transfer_timeout_s: float = 30.0) -> KVTransport:
    """A new transport ``name`` for ``engine_id``; ``TransportError`` for a name with no backend here."""
    factory = FACTORIES.get(name)
    if factory is None:
        raise TransportError(f"no KV transport named {name!r}; known: {', '.join(FACTORIES)}")
    return factory(engine_id, transfer_timeout_s)
