"""The address other hosts reach this process at, resolved on the node it runs on.

Default: the Ray node IP (what Ray itself tells other nodes). With
``network.interface`` in the spec: that interface's IPv4 address (a cluster
whose Ray traffic runs on another network than the KV plane). Never a
listen-everywhere address: a peer cannot connect to 0.0.0.0.
"""

from __future__ import annotations

import socket

from contract.wire import LISTEN_ALL


class AddressError(RuntimeError):
    pass


def interface_address(interface: str) -> str:
    """The first IPv4 address of ``interface``; ``AddressError`` naming the interfaces there are."""
    import psutil

    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        raise AddressError(
            f"network.interface: this host has no interface {interface!r} (it has {', '.join(sorted(addresses))})"
        )
    for address in addresses[interface]:
        if address.family == socket.AF_INET:
            return address.address
    raise AddressError(f"network.interface: interface {interface!r} has no IPv4 address")


def advertised_address(interface: str | None, node_ip: str) -> str:
    """Where peers reach an engine on this node: ``interface``'s address, else the Ray node IP."""
    address = interface_address(interface) if interface else node_ip
    if address in LISTEN_ALL or not address:
        raise AddressError(f"{address!r} is not an address another host can reach")
    return address
