"""The bed's fixed names and addresses, and each host's configuration (``host_specs``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

HOST_PREFIX = "pds-"  # network namespace of host NAME: pds-NAME
BRIDGE = "pdsbr0"
VETH_PREFIX = "pdsv"  # root end of host i's veth: pdsv<i>; the namespace end is eth0
NET = "198.18.0"  # a /24 of 198.18.0.0/15, the benchmarking range
BRIDGE_IP = f"{NET}.1"
FIRST_HOST_OCTET = 10
PREFIX_LEN = 24
HEAD_PORT = 6379
DEFAULT_HOSTS = ("head", "prefill", "decode")
DEFAULT_CPUS = 2
DEFAULT_OBJECT_STORE_MB = 200
HOST_RESOURCE = 1000  # {"host:<name>": 1000}: room for many small pins
LABEL_HOST = "pdserve.io/host"
LABEL_POOL = "pdserve.io/pool"
POOLS = ("prefill", "decode")
STATE_DIR = Path(os.environ.get("PDS_HOSTS_DIR", "/tmp/pds-hosts"))
REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "scripts" / "hosts.py"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,19}")  # short: Ray's AF_UNIX socket paths live under STATE_DIR/<name>
STOP_GRACE_S = 3.0
KILL_WAIT_S = 30.0  # a killed engine frees GiBs of memory: on a loaded 2-core machine that took over 10 s
START_TIMEOUT_S = 120.0


class HostsError(RuntimeError):
    """The bed could not be brought to the asked state; the message says why."""


def default_labels(name: str) -> dict[str, str]:
    labels = {LABEL_HOST: name}
    pool = re.match(rf"({'|'.join(POOLS)})(?:[0-9]+|[-_][0-9a-z]+)?$", name)
    if pool:
        labels[LABEL_POOL] = pool.group(1)
    return labels


def host_specs(
    hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS,
    *,
    cpus: int | dict[str, int] = DEFAULT_CPUS,
    labels: dict[str, dict[str, str]] | None = None,
    resources: dict[str, dict[str, float]] | None = None,
    gpus: dict[str, int] | None = None,
) -> list[dict]:
    """Each host's name, namespace, veth, IP, CPUs, logical GPUs, labels and resources; the first one is
    the head. ``gpus``: Ray's ``--num-gpus`` per host (logical: for placing GPU specs, nothing runs on them).

    ``labels``/``resources`` are merged over the defaults per host; a label given as "" is dropped.
    """
    hosts = list(hosts)
    if not hosts:
        raise HostsError("no hosts")
    if len(set(hosts)) != len(hosts):
        raise HostsError(f"duplicate host names: {hosts}")
    if len(hosts) > 254 - FIRST_HOST_OCTET:
        raise HostsError(f"at most {254 - FIRST_HOST_OCTET} hosts")
    for name in hosts:
        if not NAME_RE.fullmatch(name):
            raise HostsError(f"bad host name {name!r}: lower-case letters, digits, - and _, 20 at most")
    labels, resources, gpus = labels or {}, resources or {}, gpus or {}
    cpus_of = cpus if isinstance(cpus, dict) else {}
    for what, given in (("labels", labels), ("resources", resources), ("cpus", cpus_of), ("gpus", gpus)):
        unknown = set(given) - set(hosts)
        if unknown:
            raise HostsError(f"{what} for unknown hosts {sorted(unknown)} (hosts: {hosts})")
    specs = []
    for i, name in enumerate(hosts):
        host_labels = {k: v for k, v in (default_labels(name) | labels.get(name, {})).items() if v != ""}
        specs.append(
            {
                "name": name,
                "index": i,
                "head": i == 0,
                "netns": HOST_PREFIX + name,
                "veth": f"{VETH_PREFIX}{i}",
                "ip": f"{NET}.{FIRST_HOST_OCTET + i}",
                "num_cpus": int(cpus_of.get(name, DEFAULT_CPUS) if isinstance(cpus, dict) else cpus),
                "num_gpus": int(gpus.get(name, 0)),
                "labels": host_labels,
                "resources": {f"host:{name}": HOST_RESOURCE} | resources.get(name, {}),
            }
        )
    return specs
