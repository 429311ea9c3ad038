"""The Ray nodes of the bed: ``ray start`` in each host's namespace, and the GCS's node table as the bed sees it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from testlib.testbed.config import HEAD_PORT, REPO, STATE_DIR, HostsError
from testlib.testbed.netns import run
from testlib.testbed.procs import cmdline, netns_pids
from testlib.testbed.state import exec_argv, require_state


def venv_bin() -> Path:
    """The bin directory of a Python that has Ray: ours when it has one, else the project's .venv."""
    for candidate in (Path(sys.executable).parent, REPO / ".venv" / "bin"):
        if (candidate / "ray").exists() and (candidate / "python").exists():
            return candidate
    found = shutil.which("ray")
    if found:
        return Path(found).parent
    raise HostsError("no `ray` found (neither beside this Python nor in the project's .venv)")


def _ray_env(state: dict) -> dict[str, str]:
    # Nothing of the caller's Ray (RAY_ADDRESS of another cluster, its token) reaches the bed.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": state["auth"]}
    if state["auth"] == "token":
        env["RAY_AUTH_TOKEN_PATH"] = state["token_path"]
    return env | state["ray_env"]


def _ray_start_argv(state: dict, host: dict) -> list[str]:
    argv = [
        str(Path(state["venv_bin"]) / "ray"), "start",
        f"--node-ip-address={host['ip']}",
        f"--num-cpus={host['num_cpus']}", f"--num-gpus={host.get('num_gpus', 0)}",
        f"--resources={json.dumps(host['resources'], separators=(',', ':'))}",
        f"--object-store-memory={state['object_store_mb'] * 1024 * 1024}",
        f"--temp-dir={host['temp_dir']}",
        "--disable-usage-stats", "--log-style=record", "--log-color=false",
    ]  # fmt: skip
    if host["labels"]:
        argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in host["labels"].items()))
    if host["head"]:
        argv += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"]
    else:
        argv.append(f"--address={state['ray_address']}")
    return ["ip", "netns", "exec", host["netns"], *argv]


def start_nodes(state: dict, hosts: list[dict], timeout_s: float) -> None:
    """``ray start`` on each host, all at once; raise with the output of those that failed."""
    env = _ray_env(state)
    procs = []
    for host in hosts:
        Path(host["temp_dir"]).mkdir(parents=True, exist_ok=True)
        log = STATE_DIR / f"{host['name']}.start.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                _ray_start_argv(state, host),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the daemons it leaves must not share our session (Ctrl-C)
            )
        procs.append((host, proc, log))
    deadline = time.monotonic() + timeout_s
    failed = []
    for host, proc, log in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            failed.append(f"--- ray start on {host['name']} ({host['ip']}): {rc}\n{tail}")
    if failed:
        raise HostsError("ray start failed:\n" + "\n".join(failed))


_NODES_SNIPPET = r"""
import json, sys, time
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions

want = json.loads(sys.argv[1])
state = GlobalState()
state._initialize_global_state(
    GcsClientOptions.create(want["address"], None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
)
deadline = time.monotonic() + want["timeout"]
while True:
    error = None
    try:
        table = state.node_table()
    except Exception as e:  # the GCS not (yet) answering
        table, error = [], repr(e)
    nodes = [
        {
            "node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
            "labels": n.get("Labels") or {}, "resources": n.get("Resources") or {},
            "death": (n.get("DeathReasonMessage") or "") if not n["Alive"] else "",
        }
        for n in table
    ]
    alive = {n["ip"] for n in nodes if n["alive"] and n["node_id"] not in want["exclude"]}
    any_alive = {n["ip"] for n in nodes if n["alive"]}
    ok = error is None and set(want["alive"]) <= alive and not (set(want["dead"]) & any_alive)
    if ok or time.monotonic() >= deadline:
        print(json.dumps({"ok": ok, "nodes": nodes, "error": error}))
        break
    time.sleep(0.2)
"""


def wait_nodes(
    alive: list[str] = (),
    *,
    dead: list[str] = (),
    exclude: list[str] = (),
    timeout_s: float = 60.0,
    state: dict | None = None,
) -> dict:
    """Poll the GCS until each IP in ``alive`` has an alive node (whose id is not in ``exclude``) and no IP in
    ``dead`` has one; return ``{"ok": bool, "nodes": [...], "error": ...}`` (``ok`` False on timeout).

    Each node: ``{"node_id", "ip", "alive", "labels", "resources", "death"}``. Asked from the head's
    namespace with the bed's Python (a GCS client, no driver: ~1 s).
    """
    state = state or require_state()
    want = {"address": state["ray_address"], "alive": list(alive), "dead": list(dead), "exclude": list(exclude)}
    want["timeout"] = timeout_s
    argv = exec_argv(state["hosts"][0]["name"], [str(Path(state["venv_bin"]) / "python"), "-c", _NODES_SNIPPET])
    try:
        result = run([*argv, json.dumps(want)], check=False, timeout=timeout_s + 60, env=_ray_env(state))
    except subprocess.TimeoutExpired:
        raise HostsError(f"the GCS at {state['ray_address']} did not answer in {timeout_s + 60:.0f} s") from None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostsError(f"cannot read the GCS node table ({result.returncode}): {result.stderr[-2000:]}") from None


def nodes(state: dict | None = None) -> list[dict]:
    """Every node the GCS knows (alive and dead), as ``wait_nodes`` gives them."""
    return wait_nodes(timeout_s=0, state=state)["nodes"]


def processes_up(state: dict) -> bool:
    for host in state["hosts"]:
        cmdlines = [cmdline(p) for p in netns_pids(host["netns"])]
        if not any("/raylet " in c or c.startswith("raylet ") for c in cmdlines):
            return False
        if host["head"] and not any("gcs_server" in c for c in cmdlines):
            return False
    return True
