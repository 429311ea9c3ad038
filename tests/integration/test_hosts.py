"""The multi-host test bed (``testlib/testbed``, CLI ``scripts/hosts.py``): three network namespaces on a bridge, one
Ray node each.

On the suite's shared bed (fixture ``three_hosts``: ``up(fresh=True)`` replaces a bed left running), checks from a
driver in the head's namespace that every node has its own IP and labels and that actors placed by
``label_selector`` run on the right host (in its namespace), then loses a host (``kill_host``) and
brings it back (``restart_host``): the old node dead, a new one alive at the same IP with the same
labels, and serving. And a bed of its own, taken down: nothing of it may be left.

Needs root and iproute2 (network namespaces); ~35 s on a 2-core machine, most of it Ray starting.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from testlib import testbed as hosts
from tests.integration.conftest import FAST_HEALTH_CHECKS, THREE_HOSTS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.after_cluster,  # a Ray cluster of its own: not while the shared one holds the cores
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="the multi-host bed makes network namespaces: needs root and iproute2 (`ip`)",
    ),
]

HOST_NAMES = THREE_HOSTS
IPS = {"head": "198.18.0.10", "prefill": "198.18.0.11", "decode": "198.18.0.12"}

# A driver in a host: where actors placed by label / host resource run (IP, node, network namespace).
PROBE = """
import json, os, sys
import ray

ray.init(log_to_driver=False, logging_level="ERROR")

@ray.remote(num_cpus=0)
class Where:
    def where(self):
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "netns": os.readlink("/proc/self/ns/net"),
        }

placements = json.loads(sys.argv[1])
actors = {name: Where.options(**options).remote() for name, options in placements.items()}
print(json.dumps({
    "driver_ip": ray.util.get_node_ip_address(),
    "actors": {name: ray.get(actor.where.remote(), timeout=120) for name, actor in actors.items()},
}))
"""

BY_POOL = {pool: {"label_selector": {"pdserve.io/pool": pool}} for pool in ("prefill", "decode")}
BY_HOST_RESOURCE = {"head": {"resources": {"host:head": 1}}}


def run_in(host: str, argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """``argv`` inside ``host``'s namespace with the bed's client env (none of this process's RAY_*)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        hosts.exec_argv(host, argv), capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def probe(placements: dict[str, dict], host: str = "head") -> dict:
    result = run_in(host, [sys.executable, "-c", PROBE, json.dumps(placements)])
    assert result.returncode == 0, f"probe failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def netns_inode(host: str) -> str:
    result = run_in(host, ["readlink", "/proc/self/ns/net"], timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def bed_left() -> dict:
    """What of the bed is still there: its namespaces, its bridge, Ray processes under its state dir."""
    rays = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile, or not a process
            continue
        if str(hosts.STATE_DIR) in cmdline:
            rays.append(cmdline.replace("\0", " ")[:120])
    bridge = subprocess.run(["ip", "link", "show", hosts.BRIDGE], capture_output=True).returncode == 0
    return {"namespaces": hosts.namespaces(), "bridge": bridge, "ray_processes": rays}


@pytest.fixture(scope="module")
def bed(three_hosts: dict) -> dict:
    return three_hosts


def test_down_leaves_nothing_of_a_bed() -> None:
    made = hosts.up(("solo",), fresh=True, timeout_s=120)
    assert made["hosts"]["solo"]["ip"] == "198.18.0.10"
    hosts.down()
    assert bed_left() == {"namespaces": [], "bridge": False, "ray_processes": []}


def test_nodes_have_their_own_ip_labels_and_namespace(bed: dict) -> None:
    assert bed["ray_address"] == "198.18.0.10:6379"
    assert {name: host["ip"] for name, host in bed["hosts"].items()} == IPS
    # The root namespace reaches the hosts through the bridge (here: the GCS port).
    with socket.create_connection(("198.18.0.10", 6379), timeout=5):
        pass

    alive = [n for n in hosts.nodes() if n["alive"]]
    by_ip = {n["ip"]: n for n in alive}
    assert sorted(by_ip) == sorted(IPS.values()) and len(alive) == 3
    for name, ip in IPS.items():
        labels, resources = by_ip[ip]["labels"], by_ip[ip]["resources"]
        assert labels["pdserve.io/host"] == name
        assert labels.get("pdserve.io/pool") == (name if name != "head" else None)
        assert resources["CPU"] == 2 and resources[f"host:{name}"] == 1000

    seen = probe(BY_POOL | BY_HOST_RESOURCE)
    assert seen["driver_ip"] == IPS["head"]
    for name in HOST_NAMES:
        actor = seen["actors"][name]
        assert actor["ip"] == IPS[name] and actor["node_id"] == by_ip[IPS[name]]["node_id"]
        assert actor["netns"] == netns_inode(name), f"the actor placed on {name} runs outside its namespace"


def test_up_reuses_a_running_bed(bed: dict) -> None:
    again = hosts.up(HOST_NAMES, ray_env=FAST_HEALTH_CHECKS, timeout_s=60)
    assert again["reused"] is True and again["hosts"] == bed["hosts"]


def test_kill_host_and_restart_host(bed: dict) -> None:
    ip = IPS["prefill"]
    old = next(n for n in hosts.nodes() if n["alive"] and n["ip"] == ip)

    killed = hosts.kill_host("prefill", wait_dead=True, timeout_s=60)
    assert killed["pids"] and hosts.netns_pids("pds-prefill") == []
    after_kill = {n["node_id"]: n for n in killed["nodes"]}
    assert after_kill[old["node_id"]]["alive"] is False
    assert {n["ip"] for n in killed["nodes"] if n["alive"]} == {IPS["head"], IPS["decode"]}

    restarted = hosts.restart_host("prefill", timeout_s=120)
    assert restarted["ip"] == ip and restarted["node_id"] != old["node_id"]
    now = {n["node_id"]: n for n in hosts.nodes()}
    assert now[old["node_id"]]["alive"] is False
    new = now[restarted["node_id"]]
    assert new["alive"] and new["ip"] == ip
    assert {k: v for k, v in new["labels"].items() if k.startswith("pdserve.io/")} == {
        "pdserve.io/host": "prefill",
        "pdserve.io/pool": "prefill",
    }
    assert new["resources"]["CPU"] == 2 and new["resources"]["host:prefill"] == 1000

    # The new node takes work again, and a driver on that host attaches to it when told its IP
    # (Ray's default for a driver that sees several raylets on one machine is the head's).
    seen = probe(BY_POOL)
    assert seen["actors"]["prefill"]["node_id"] == restarted["node_id"]
    assert seen["actors"]["decode"]["ip"] == IPS["decode"]
    local = run_in(
        "prefill",
        [sys.executable, "-c", f"import ray; ray.init(_node_ip_address='{ip}'); print(ray.util.get_node_ip_address())"],
    )
    assert local.returncode == 0, local.stderr[-4000:]
    assert local.stdout.strip().splitlines()[-1] == ip
