"""KV transports behind one protocol, and the choice of one per peer pair.

``base.KVTransport`` is what every transport implements (register caches, an
opaque handshake payload, read block runs, notifications, abort, close);
``nixl.NixlKVTransport`` moves blocks over NIXL/UCX (RDMA between hosts,
shared memory or TCP on one host; CPU or GPU memory), ``fake.InMemoryTransport``
copies them between tensors of one process (unit tests of the code above the
seam). CUDA IPC and NCCL are GPU-only and not here yet (issue 14).

``choose_transport`` picks, for one pair of peers, the first transport both
offer in the order that suits where they are (``Where``): the same process
group, the same node, or different nodes. Each side offers what it can run
(``OFFERED``: what is importable and fits its memory); the prefill side's
offer travels in its handshake answer, and the decode side says which it
chose in every request's report (``transport=...`` in ``X-PDServe-KV``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from functools import cache

from connectors.errors import TransportError

__all__ = ["NIXL", "PREFERENCE", "TRANSPORTS", "Where", "choose_transport", "node_identity", "where"]

NIXL, CUDA_IPC, NCCL = "nixl", "cuda-ipc", "nccl"
TRANSPORTS = (NIXL, CUDA_IPC, NCCL)


class Where(enum.StrEnum):
    """Where two peers are, seen from the reader."""

    SAME_PROCESS_GROUP = "same-process-group"
    SAME_NODE = "same-node"
    OTHER_NODE = "other-node"


PREFERENCE: dict[Where, tuple[str, ...]] = {
    # GPUs of one node: a device-to-device copy beats any network path.
    Where.SAME_PROCESS_GROUP: (CUDA_IPC, NCCL, NIXL),
    Where.SAME_NODE: (CUDA_IPC, NIXL),
    # Across nodes: NIXL (RDMA where UCX finds it), NCCL where there is no RDMA.
    Where.OTHER_NODE: (NIXL, NCCL),
}


def where(local_node: str, remote_node: str, same_process_group: bool = False) -> Where:
    """Where a peer on ``remote_node`` is from ``local_node`` (node ids as the handshake carries them)."""
    if same_process_group:
        return Where.SAME_PROCESS_GROUP
    return Where.SAME_NODE if local_node and local_node == remote_node else Where.OTHER_NODE


def choose_transport(ours: Sequence[str], theirs: Sequence[str], place: Where) -> str:
    """The first transport of ``PREFERENCE[place]`` both sides offer; ``TransportError`` if none."""
    for name in PREFERENCE[place]:
        if name in ours and name in theirs:
            return name
    raise TransportError(
        f"no common KV transport for a peer ({place}): we offer {', '.join(ours) or 'none'}, "
        f"it offers {', '.join(theirs) or 'none'}"
    )


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
