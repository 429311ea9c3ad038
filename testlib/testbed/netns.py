"""The network: one namespace per host, a veth each into the bridge of the root namespace, their addresses.

Every function here runs ``ip`` (iproute2); making and removing the network needs root in the root namespace.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess

from testlib.testbed.config import BRIDGE, BRIDGE_IP, HOST_PREFIX, NAME_RE, PREFIX_LEN, VETH_PREFIX, HostsError


def run(argv: list[str], *, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    if check and result.returncode != 0:
        raise HostsError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")
    return result


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check)


def namespaces() -> list[str]:
    """The bed's namespaces that exist now (``pds-*``)."""
    result = ip("netns", "list", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(HOST_PREFIX) and NAME_RE.fullmatch(n[len(HOST_PREFIX) :])]


def bridge_exists() -> bool:
    return ip("link", "show", BRIDGE, check=False).returncode == 0


def make_network(specs: list[dict]) -> None:
    ip("link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0")
    ip("addr", "add", f"{BRIDGE_IP}/{PREFIX_LEN}", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    for host in specs:
        ns = host["netns"]
        ip("netns", "add", ns)
        ip("link", "add", host["veth"], "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", host["veth"], "master", BRIDGE, "up")
        ip("-n", ns, "addr", "add", f"{host['ip']}/{PREFIX_LEN}", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")


def remove_network(netns_list: list[str]) -> None:
    for ns in netns_list:
        ip("netns", "del", ns, check=False)
    links = ip("-o", "link", "show", check=False).stdout
    for name in re.findall(rf"^\d+: ({VETH_PREFIX}\d+)[@:]", links, flags=re.M):
        ip("link", "del", name, check=False)
    if re.search(rf"^\d+: {BRIDGE}[@:]", links, flags=re.M):
        ip("link", "del", BRIDGE, check=False)


def check_root() -> None:
    """Root, ``ip``, and not inside a host: the bridge and the veths are in the root namespace."""
    if os.geteuid() != 0:
        raise HostsError("network namespaces need root")
    if shutil.which("ip") is None:
        raise HostsError("`ip` (iproute2) not found")
    here = os.stat("/proc/self/ns/net")
    for ns in namespaces():
        with contextlib.suppress(OSError):
            there = os.stat(f"/run/netns/{ns}")
            if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino):
                raise HostsError(f"this runs inside host {ns}: run up/down from the root namespace")
