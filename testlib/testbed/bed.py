"""The bed's life: ``up`` (idempotent), ``down`` (always leaves nothing), a host lost (``kill_host``) and back
(``restart_host``), and what a user sees of it (``info``, ``status``)."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from testlib.testbed.config import (
    BRIDGE,
    BRIDGE_IP,
    DEFAULT_CPUS,
    DEFAULT_HOSTS,
    DEFAULT_OBJECT_STORE_MB,
    HEAD_PORT,
    START_TIMEOUT_S,
    STATE_DIR,
    STOP_GRACE_S,
    HostsError,
    host_specs,
)
from testlib.testbed.netns import bridge_exists, check_root, make_network, namespaces, remove_network
from testlib.testbed.procs import cmdline, netns_pids, stop_processes
from testlib.testbed.ray_nodes import nodes, processes_up, start_nodes, venv_bin, wait_nodes
from testlib.testbed.state import clean_state_dir, client_env, host_of, load_state, require_state, state_path


def up(
    hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS,
    *,
    cpus: int | dict[str, int] = DEFAULT_CPUS,
    labels: dict[str, dict[str, str]] | None = None,
    resources: dict[str, dict[str, float]] | None = None,
    gpus: dict[str, int] | None = None,
    object_store_mb: int = DEFAULT_OBJECT_STORE_MB,
    auth: str = "token",
    ray_env: dict[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
    fresh: bool = False,
) -> dict:
    """Make the bed (namespaces, bridge, one Ray node per host) and wait until every node is alive.

    Reuses a running bed of the same configuration unless ``fresh``; otherwise tears down whatever is
    there first. Returns ``info()`` of the bed (plus ``reused`` and ``up_s``). ``ray_env``: extra
    ``RAY_*`` variables for every Ray process (e.g. ``{"RAY_health_check_period_ms": "1000"}``).
    """
    started = time.monotonic()
    if auth not in ("token", "disabled"):
        raise HostsError(f"auth must be token or disabled, not {auth!r}")
    bad_env = [k for k in ray_env or {} if not k.startswith("RAY_")]
    if bad_env:
        raise HostsError(f"ray_env takes RAY_* variables only: {bad_env}")
    check_root()
    specs = host_specs(hosts, cpus=cpus, labels=labels, resources=resources, gpus=gpus)
    config = {
        "hosts": specs,
        "object_store_mb": int(object_store_mb),
        "auth": auth,
        "ray_env": dict(ray_env or {}),
    }
    old = load_state()
    if not fresh and old is not None and old.get("config") == config and processes_up(old):
        check = wait_nodes([h["ip"] for h in old["hosts"]], timeout_s=10, state=old)
        if check["ok"]:
            return info(old) | {"reused": True, "up_s": round(time.monotonic() - started, 2)}
    down()
    clean_state_dir()
    state = {
        "config": config,
        "ray_address": f"{specs[0]['ip']}:{HEAD_PORT}",
        "auth": auth,
        "token_path": str(STATE_DIR / "auth_token"),
        "object_store_mb": int(object_store_mb),
        "ray_env": dict(ray_env or {}),
        "venv_bin": str(venv_bin()),
        "hosts": [h | {"temp_dir": str(STATE_DIR / h["name"])} for h in specs],
    }
    if auth == "token":
        fd = os.open(state["token_path"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    try:
        make_network(specs)
        state_path().write_text(json.dumps(state, indent=2))
        deadline = time.monotonic() + timeout_s
        start_nodes(state, state["hosts"][:1], timeout_s)
        start_nodes(state, state["hosts"][1:], max(1.0, deadline - time.monotonic()))
        check = wait_nodes(
            [h["ip"] for h in state["hosts"]], timeout_s=max(1.0, deadline - time.monotonic()), state=state
        )
        if not check["ok"]:
            alive = sorted(n["ip"] for n in check["nodes"] if n["alive"])
            raise HostsError(
                f"not every node alive after {timeout_s:.0f} s: alive {alive}, "
                f"wanted {[h['ip'] for h in state['hosts']]} (error: {check['error']}); logs in {STATE_DIR}"
            )
    except BaseException:
        down()
        raise
    return info(state) | {"reused": False, "up_s": round(time.monotonic() - started, 2)}


def down() -> dict:
    """Kill every process in the ``pds-*`` namespaces, delete them, the veths and the bridge. Never fails
    when nothing is there. Returns ``{"namespaces": [...], "pids": [...], "down_s": ...}``."""
    started = time.monotonic()
    check_root()
    netns_list = namespaces()
    pids = stop_processes(netns_list, grace_s=STOP_GRACE_S) if netns_list else []
    remove_network(netns_list)
    state_path().unlink(missing_ok=True)
    return {"namespaces": netns_list, "pids": pids, "down_s": round(time.monotonic() - started, 2)}


def kill_host(name: str, *, wait_dead: bool = False, timeout_s: float = 60.0) -> dict:
    """A host lost: SIGKILL every process in its namespace (raylet, workers, anything run there).

    The namespace and its address stay (``restart_host`` brings Ray back). With ``wait_dead``, wait
    until the GCS has no alive node at the host's IP (the head's health checks notice, ~``health_check_*``).
    Killing the head kills the GCS: the other nodes die with it, and only ``down``/``up`` repairs that.
    """
    state = require_state()
    host = host_of(state, name)
    pids = stop_processes([host["netns"]], grace_s=0)
    result = {"host": name, "ip": host["ip"], "pids": pids}
    if wait_dead and not host["head"]:
        check = wait_nodes(dead=[host["ip"]], timeout_s=timeout_s, state=state)
        if not check["ok"]:
            raise HostsError(f"the GCS still shows a node alive at {host['ip']} after {timeout_s:.0f} s")
        result["nodes"] = check["nodes"]
    return result


def restart_host(name: str, *, timeout_s: float = START_TIMEOUT_S) -> dict:
    """Start ``name``'s Ray worker node again (same IP, labels, resources, CPUs) after ``kill_host``, and
    wait until the GCS shows a new alive node at its IP. Whatever still runs in the namespace is killed
    first. Returns ``{"host", "ip", "node_id", "restart_s"}``."""
    started = time.monotonic()
    state = require_state()
    host = host_of(state, name)
    if host["head"]:
        raise HostsError("the head holds the GCS: a lost head means a new cluster (down, then up)")
    stop_processes([host["netns"]], grace_s=0)
    before = {n["node_id"] for n in nodes(state) if n["ip"] == host["ip"]}
    start_nodes(state, [host], timeout_s)
    check = wait_nodes([host["ip"]], exclude=sorted(before), timeout_s=timeout_s, state=state)
    if not check["ok"]:
        raise HostsError(f"no new alive node at {host['ip']} after {timeout_s:.0f} s (error: {check['error']})")
    node = next(n for n in check["nodes"] if n["ip"] == host["ip"] and n["alive"] and n["node_id"] not in before)
    return {
        "host": name,
        "ip": host["ip"],
        "node_id": node["node_id"],
        "restart_s": round(time.monotonic() - started, 2),
    }


def info(state: dict | None = None) -> dict:
    """What a user of the bed needs: the Ray address, the client env, each host's IP and exec prefix."""
    state = state or require_state()
    return {
        "ray_address": state["ray_address"],
        "env": client_env(state),
        "bridge": BRIDGE,
        "bridge_ip": BRIDGE_IP,
        "state_dir": str(STATE_DIR),
        "hosts": {
            h["name"]: {
                "ip": h["ip"],
                "netns": h["netns"],
                "head": h["head"],
                "num_cpus": h["num_cpus"],
                "labels": h["labels"],
                "resources": h["resources"],
                "exec": f"ip netns exec {h['netns']}",
                "logs": str(Path(h["temp_dir"]) / "session_latest" / "logs"),
            }
            for h in state["hosts"]
        },
    }


def status() -> dict:
    """The bed as it is: per host, whether its namespace exists, how many processes run there, and
    whether its raylet (and the head's GCS) runs; plus the GCS node table when the head answers."""
    state = load_state()
    existing = namespaces()
    link = bridge_exists()
    result: dict = {"up": state is not None, "bridge": link, "namespaces": existing, "hosts": {}}
    if state is None:
        return result
    result |= {"ray_address": state["ray_address"], "env": client_env(state)}
    for host in state["hosts"]:
        pids = netns_pids(host["netns"]) if host["netns"] in existing else []
        cmdlines = [cmdline(p) for p in pids]
        result["hosts"][host["name"]] = {
            "ip": host["ip"],
            "netns": host["netns"] in existing,
            "processes": len(pids),
            "raylet": any("/raylet " in c for c in cmdlines),
            **({"gcs_server": any("gcs_server" in c for c in cmdlines)} if host["head"] else {}),
        }
    if result["hosts"][state["hosts"][0]["name"]].get("gcs_server"):
        result["nodes"] = wait_nodes(timeout_s=0, state=state)["nodes"]
    return result
