"""A multi-host test bed on one machine: N "hosts" as Linux network namespaces on a bridge, one Ray node each.

Every host is a network namespace ``pds-<name>`` with one veth into the bridge ``pdsbr0`` of the root
namespace; the bridge has 198.18.0.1/24 and host i has 198.18.0.(10+i)/24 (198.18.0.0/15 is the
benchmarking range: no real network uses it). There is no default route, no NAT and no change to
``ip_forward``: nothing the hosts send can leave the machine. The first host runs the Ray head
(GCS on 198.18.0.10:6379), the others Ray worker nodes, each with its own node IP, labels, custom
resource and CPU count. The root namespace reaches every host at its address through the bridge.

    python scripts/hosts.py up [--hosts head,prefill,decode] [--cpus 2 | --cpus prefill=4]
                               [--labels HOST=KEY=VALUE ...] [--resources HOST=NAME=AMOUNT ...]
                               [--object-store-mb 200] [--auth token|disabled] [--ray-env KEY=VALUE ...]
                               [--timeout 120] [--fresh] [--json [PATH]]
    python scripts/hosts.py status [--json]
    python scripts/hosts.py exec HOST [--no-env] -- CMD...
    python scripts/hosts.py kill HOST [--wait]        # SIGKILL everything on HOST (a host loss)
    python scripts/hosts.py restart HOST              # its Ray node again, same IP, labels, resources
    python scripts/hosts.py down

Defaults: hosts head, prefill, decode; 2 CPUs each; labels ``pdserve.io/host=<name>`` on every node, and
``pdserve.io/pool=prefill|decode`` on hosts named prefill/decode (also prefill2, decode-b, decode_1, ...); a custom
resource ``host:<name>: 1000`` per node. ``--labels HOST=KEY=`` (empty value) drops a default label.

``up`` is idempotent: when a bed with the same configuration is running and every node is alive in
the GCS it is reused as it is (``"reused": true``); anything else (another configuration, a dead node,
leftovers of a crashed run) is torn down and made again; ``--fresh`` always makes it again.
``down`` kills every process in the ``pds-*`` namespaces (SIGTERM, then SIGKILL), deletes them, the
veths and the bridge; it never fails when nothing is there. Ray logs stay in ``/tmp/pds-hosts/<host>``
until the next ``up`` (``PDS_HOSTS_DIR`` moves that directory).

Ray runs with token auth by default (as Ray 2.60 and pdserve's own head do): a client needs
``RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/pds-hosts/auth_token`` besides ``RAY_ADDRESS``;
``exec``/``exec_argv`` set all three. Run drivers (``ray.init``) inside a host namespace. Every host
shares the machine's PID namespace and /tmp, so a driver sees every raylet and, given no IP, attaches
to the head's: on another host say ``ray.init(_node_ip_address="198.18.0.11")``. From the root
namespace, plain TCP reaches the hosts, and Ray Client (``ray://198.18.0.10:10001``) works.
The GCS marks a killed host's node dead after Ray's health checks (3 s x 5 by default, ~12 s here);
``--ray-env RAY_health_check_period_ms=1000 --ray-env RAY_health_check_failure_threshold=3`` cuts that
to ~3 s. ``up`` and ``down`` run in the root namespace (the bridge is there); the rest anywhere.

Importable (tests load it with importlib from its path): ``up``, ``down``, ``status``, ``nodes``,
``exec_argv``, ``client_env``, ``kill_host``, ``restart_host``, ``wait_nodes``, ``HOST_PREFIX``.
Needs root, iproute2 and Ray in the project's virtualenv; stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
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
REPO = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,19}")  # short: Ray's AF_UNIX socket paths live under STATE_DIR/<name>
STOP_GRACE_S = 3.0
KILL_WAIT_S = 30.0  # a killed engine frees GiBs of memory: on a loaded 2-core machine that took over 10 s
START_TIMEOUT_S = 120.0


class HostsError(RuntimeError):
    """The bed could not be brought to the asked state; the message says why."""


# --- configuration ----------------------------------------------------------------------------


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


def _state_path() -> Path:
    return STATE_DIR / "state.json"


def load_state() -> dict | None:
    try:
        return json.loads(_state_path().read_text())
    except (OSError, ValueError):
        return None


def _host(state: dict, name: str) -> dict:
    for host in state["hosts"]:
        if host["name"] == name:
            return host
    raise HostsError(f"no host {name!r} in the bed (hosts: {[h['name'] for h in state['hosts']]})")


def _require_state() -> dict:
    state = load_state()
    if state is None:
        raise HostsError(f"no bed is up (no {_state_path()}): run `python {__file__} up` first")
    return state


# --- processes and commands -------------------------------------------------------------------


def _venv_bin() -> Path:
    """The bin directory of a Python that has Ray: ours when it has one, else the project's .venv."""
    for candidate in (Path(sys.executable).parent, REPO / ".venv" / "bin"):
        if (candidate / "ray").exists() and (candidate / "python").exists():
            return candidate
    found = shutil.which("ray")
    if found:
        return Path(found).parent
    raise HostsError("no `ray` found (neither beside this Python nor in the project's .venv)")


def _run(argv: list[str], *, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    if check and result.returncode != 0:
        raise HostsError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")
    return result


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def client_env(state: dict | None = None) -> dict[str, str]:
    """The variables a Ray client of the bed needs: RAY_ADDRESS and the auth mode (and token path)."""
    state = state or _require_state()
    env = {"RAY_ADDRESS": state["ray_address"], "RAY_AUTH_MODE": state["auth"]}
    if state["auth"] == "token":
        env["RAY_AUTH_TOKEN_PATH"] = state["token_path"]
    return env


def exec_argv(host: str, argv: list[str], *, env: bool = True) -> list[str]:
    """``argv`` run inside ``host``'s namespace: ``ip netns exec pds-<host> [env RAY_...=...] argv...``.

    With ``env`` (and a bed up) the Ray client variables of ``client_env`` are set for the command.
    """
    prefix = ["ip", "netns", "exec", HOST_PREFIX + host]
    state = load_state() if env else None
    if state is not None:
        prefix += ["env", *(f"{k}={v}" for k, v in client_env(state).items())]
    return [*prefix, *argv]


def namespaces() -> list[str]:
    """The bed's namespaces that exist now (``pds-*``)."""
    result = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(HOST_PREFIX) and NAME_RE.fullmatch(n[len(HOST_PREFIX) :])]


def netns_pids(netns: str) -> list[int]:
    result = _ip("netns", "pids", netns, check=False)
    own = _own_lineage()
    # Not the `ip` that listed them (it is in the namespace too when this runs inside a host: gone now).
    return [int(p) for p in result.stdout.split() if p.isdigit() and int(p) not in own and _exists(int(p))]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_lineage() -> set[int]:
    """This process and its ancestors: never signalled, even when run inside a host."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _is_gcs(pid: int) -> bool:
    return "gcs_server" in _cmdline(pid).split(" ", 1)[0]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def _terminate(find, *, grace_s: float, signalled: set[int]) -> None:
    """Signal what ``find()`` returns until it returns nothing: SIGTERM (once per pid), SIGKILL after
    ``grace_s`` (at once when 0). A raylet may start a worker while the rest stops: the loop finds it."""
    deadline = time.monotonic() + grace_s
    give_up = deadline + KILL_WAIT_S
    while True:
        pids = [p for p in find() if not _zombie(p)]  # killed, waiting for a parent to reap it: gone
        if not pids:
            return
        now = time.monotonic()
        if now >= give_up:
            raise HostsError(f"processes still there {KILL_WAIT_S:g} s after SIGKILL: {pids}")
        if now >= deadline:
            _signal_all(pids, signal.SIGKILL)
        else:
            _signal_all([p for p in pids if p not in signalled], signal.SIGTERM)
        signalled.update(pids)
        time.sleep(0.05)


def _stop_processes(netns_list: list[str], *, grace_s: float) -> list[int]:
    """Stop every process in the namespaces; return the pids signalled.

    With a grace period, in Ray's order: the worker nodes first (their raylets unregister from the
    GCS), then the head's processes but the GCS, then the GCS. All at once, a SIGTERM'd raylet hangs
    on the GCS that stops beside it, and every stop waited out the grace (5 s instead of < 1 s).
    """
    signalled: set[int] = set()

    def in_ns(names: list[str]) -> list[int]:
        return [p for ns in names for p in netns_pids(ns)]

    if grace_s > 0:
        head_ns = [ns for ns in netns_list if any(_is_gcs(p) for p in netns_pids(ns))]
        others = [ns for ns in netns_list if ns not in head_ns]
        _terminate(lambda: in_ns(others), grace_s=grace_s, signalled=signalled)
        _terminate(lambda: [p for p in in_ns(head_ns) if not _is_gcs(p)], grace_s=grace_s, signalled=signalled)
    _terminate(lambda: in_ns(netns_list), grace_s=grace_s, signalled=signalled)
    # Ray's daemons are children of init, which reaps them a moment later: wait for that, so that no
    # <defunct> raylet is left for a `pgrep raylet` right after.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in signalled):
        time.sleep(0.05)
    return sorted(signalled)


# --- the network ------------------------------------------------------------------------------


def _make_network(specs: list[dict]) -> None:
    _ip("link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0")
    _ip("addr", "add", f"{BRIDGE_IP}/{PREFIX_LEN}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for host in specs:
        ns = host["netns"]
        _ip("netns", "add", ns)
        _ip("link", "add", host["veth"], "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", host["veth"], "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{host['ip']}/{PREFIX_LEN}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _remove_network(netns_list: list[str]) -> None:
    for ns in netns_list:
        _ip("netns", "del", ns, check=False)
    links = _ip("-o", "link", "show", check=False).stdout
    for name in re.findall(rf"^\d+: ({VETH_PREFIX}\d+)[@:]", links, flags=re.M):
        _ip("link", "del", name, check=False)
    if re.search(rf"^\d+: {BRIDGE}[@:]", links, flags=re.M):
        _ip("link", "del", BRIDGE, check=False)


# --- Ray --------------------------------------------------------------------------------------


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


def _start_nodes(state: dict, hosts: list[dict], timeout_s: float) -> None:
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
    state = state or _require_state()
    want = {"address": state["ray_address"], "alive": list(alive), "dead": list(dead), "exclude": list(exclude)}
    want["timeout"] = timeout_s
    argv = exec_argv(state["hosts"][0]["name"], [str(Path(state["venv_bin"]) / "python"), "-c", _NODES_SNIPPET])
    try:
        result = _run([*argv, json.dumps(want)], check=False, timeout=timeout_s + 60, env=_ray_env(state))
    except subprocess.TimeoutExpired:
        raise HostsError(f"the GCS at {state['ray_address']} did not answer in {timeout_s + 60:.0f} s") from None
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostsError(f"cannot read the GCS node table ({result.returncode}): {result.stderr[-2000:]}") from None


def nodes(state: dict | None = None) -> list[dict]:
    """Every node the GCS knows (alive and dead), as ``wait_nodes`` gives them."""
    return wait_nodes(timeout_s=0, state=state)["nodes"]


def _processes_up(state: dict) -> bool:
    for host in state["hosts"]:
        cmdlines = [_cmdline(p) for p in netns_pids(host["netns"])]
        if not any("/raylet " in c or c.startswith("raylet ") for c in cmdlines):
            return False
        if host["head"] and not any("gcs_server" in c for c in cmdlines):
            return False
    return True


# --- the bed ----------------------------------------------------------------------------------


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
    _check_root()
    specs = host_specs(hosts, cpus=cpus, labels=labels, resources=resources, gpus=gpus)
    config = {
        "hosts": specs,
        "object_store_mb": int(object_store_mb),
        "auth": auth,
        "ray_env": dict(ray_env or {}),
    }
    old = load_state()
    if not fresh and old is not None and old.get("config") == config and _processes_up(old):
        check = wait_nodes([h["ip"] for h in old["hosts"]], timeout_s=10, state=old)
        if check["ok"]:
            return info(old) | {"reused": True, "up_s": round(time.monotonic() - started, 2)}
    down()
    _clean_state_dir()
    state = {
        "config": config,
        "ray_address": f"{specs[0]['ip']}:{HEAD_PORT}",
        "auth": auth,
        "token_path": str(STATE_DIR / "auth_token"),
        "object_store_mb": int(object_store_mb),
        "ray_env": dict(ray_env or {}),
        "venv_bin": str(_venv_bin()),
        "hosts": [h | {"temp_dir": str(STATE_DIR / h["name"])} for h in specs],
    }
    if auth == "token":
        fd = os.open(state["token_path"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    try:
        _make_network(specs)
        _state_path().write_text(json.dumps(state, indent=2))
        deadline = time.monotonic() + timeout_s
        _start_nodes(state, state["hosts"][:1], timeout_s)
        _start_nodes(state, state["hosts"][1:], max(1.0, deadline - time.monotonic()))
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


def _clean_state_dir() -> None:
    """Remove what the last bed left in STATE_DIR (its token, its Ray temp dirs and logs), nothing else."""
    STATE_DIR.mkdir(parents=True, mode=0o700, exist_ok=True)
    for entry in STATE_DIR.iterdir():
        if entry.name in ("state.json", "auth_token") or entry.name.endswith(".start.log"):
            entry.unlink()
        elif entry.is_dir() and ((entry / "session_latest").is_symlink() or (entry / "ray_current_cluster").exists()):
            shutil.rmtree(entry)


def down() -> dict:
    """Kill every process in the ``pds-*`` namespaces, delete them, the veths and the bridge. Never fails
    when nothing is there. Returns ``{"namespaces": [...], "pids": [...], "down_s": ...}``."""
    started = time.monotonic()
    _check_root()
    netns_list = namespaces()
    pids = _stop_processes(netns_list, grace_s=STOP_GRACE_S) if netns_list else []
    _remove_network(netns_list)
    _state_path().unlink(missing_ok=True)
    return {"namespaces": netns_list, "pids": pids, "down_s": round(time.monotonic() - started, 2)}


def kill_host(name: str, *, wait_dead: bool = False, timeout_s: float = 60.0) -> dict:
    """A host lost: SIGKILL every process in its namespace (raylet, workers, anything run there).

    The namespace and its address stay (``restart_host`` brings Ray back). With ``wait_dead``, wait
    until the GCS has no alive node at the host's IP (the head's health checks notice, ~``health_check_*``).
    Killing the head kills the GCS: the other nodes die with it, and only ``down``/``up`` repairs that.
    """
    state = _require_state()
    host = _host(state, name)
    pids = _stop_processes([host["netns"]], grace_s=0)
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
    state = _require_state()
    host = _host(state, name)
    if host["head"]:
        raise HostsError("the head holds the GCS: a lost head means a new cluster (down, then up)")
    _stop_processes([host["netns"]], grace_s=0)
    before = {n["node_id"] for n in nodes(state) if n["ip"] == host["ip"]}
    _start_nodes(state, [host], timeout_s)
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
    state = state or _require_state()
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
    link = _ip("link", "show", BRIDGE, check=False).returncode == 0
    result: dict = {"up": state is not None, "bridge": link, "namespaces": existing, "hosts": {}}
    if state is None:
        return result
    result |= {"ray_address": state["ray_address"], "env": client_env(state)}
    for host in state["hosts"]:
        pids = netns_pids(host["netns"]) if host["netns"] in existing else []
        cmdlines = [_cmdline(p) for p in pids]
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


def _check_root() -> None:
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


# --- CLI --------------------------------------------------------------------------------------


def _pairs(values: list[str], what: str, parts: int) -> list[list[str]]:
    out = []
    for value in values:
        items = value.split("=", parts - 1)
        if len(items) != parts or not items[0]:
            raise HostsError(f"bad {what} {value!r}")
        out.append(items)
    return out


def _print_info(data: dict) -> None:
    env = " ".join(f"{k}={v}" for k, v in data["env"].items())
    print(f"RAY_ADDRESS={data['ray_address']}")
    print(f"client env: {env}")
    for name, host in data["hosts"].items():
        labels = ",".join(f"{k}={v}" for k, v in host["labels"].items())
        role = "head" if host["head"] else "worker"
        print(f"  {name:<10} {host['ip']:<14} {role:<6} cpus={host['num_cpus']} labels={labels}")
    head = next(iter(data["hosts"].values()))
    print(f"run inside a host: {head['exec']} env {env} CMD...   (or: python {sys.argv[0]} exec HOST -- CMD...)")
    print(f"the root namespace reaches the hosts through {data['bridge']} ({data['bridge_ip']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="make the bed (reused when the same one runs)")
    p_up.add_argument("--hosts", default=",".join(DEFAULT_HOSTS), help="comma-separated; the first is the head")
    p_up.add_argument("--cpus", action="append", default=[], help="N for every host, or HOST=N (repeatable)")
    p_up.add_argument("--labels", "--label", action="append", default=[], metavar="HOST=KEY=VALUE")
    p_up.add_argument("--resources", "--resource", action="append", default=[], metavar="HOST=NAME=AMOUNT")
    p_up.add_argument("--gpus", action="append", default=[], metavar="HOST=N", help="logical GPUs of a host")
    p_up.add_argument("--object-store-mb", type=int, default=DEFAULT_OBJECT_STORE_MB)
    p_up.add_argument("--auth", choices=("token", "disabled"), default="token")
    p_up.add_argument("--ray-env", action="append", default=[], metavar="RAY_X=VALUE")
    p_up.add_argument("--timeout", type=float, default=START_TIMEOUT_S)
    p_up.add_argument("--fresh", action="store_true", help="tear down and make again even when reusable")
    p_up.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the info as JSON (- : stdout)")
    sub.add_parser("down", help="stop everything, delete namespaces, veths, bridge")
    p_status = sub.add_parser("status", help="namespaces, processes and GCS nodes of the bed")
    p_status.add_argument("--json", action="store_true")
    p_exec = sub.add_parser("exec", help="run a command in a host: exec HOST -- CMD...")
    p_exec.add_argument("host")
    p_exec.add_argument("--no-env", action="store_true", help="without RAY_ADDRESS/RAY_AUTH_* of the bed")
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER)
    p_kill = sub.add_parser("kill", help="SIGKILL every process of a host")
    p_kill.add_argument("host")
    p_kill.add_argument("--wait", action="store_true", help="until the GCS shows its node dead")
    p_restart = sub.add_parser("restart", help="start a killed host's Ray node again")
    p_restart.add_argument("host")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
            default_cpus, per_host = DEFAULT_CPUS, {}
            for value in args.cpus:
                if "=" in value:
                    host, count = _pairs([value], "--cpus", 2)[0]
                    per_host[host] = int(count)
                else:
                    default_cpus = int(value)
            cpus = (dict.fromkeys(hosts, default_cpus) | per_host) if per_host else default_cpus
            labels: dict[str, dict[str, str]] = {}
            for host, key, value in _pairs(args.labels, "--labels", 3):
                labels.setdefault(host, {})[key] = value
            resources: dict[str, dict[str, float]] = {}
            for host, key, value in _pairs(args.resources, "--resources", 3):
                resources.setdefault(host, {})[key] = float(value)
            ray_env = {k: v for k, v in _pairs(args.ray_env, "--ray-env", 2)}
            gpus = {host: int(count) for host, count in _pairs(args.gpus, "--gpus", 2)}
            data = up(
                hosts,
                cpus=cpus,
                gpus=gpus,
                labels=labels,
                resources=resources,
                object_store_mb=args.object_store_mb,
                auth=args.auth,
                ray_env=ray_env,
                timeout_s=args.timeout,
                fresh=args.fresh,
            )
            if args.json == "-":
                print(json.dumps(data, indent=2))
            else:
                if args.json:
                    Path(args.json).write_text(json.dumps(data, indent=2))
                print(f"bed {'reused' if data['reused'] else 'up'} in {data['up_s']} s")
                _print_info(data)
        elif args.command == "down":
            result = down()
            print(
                f"down in {result['down_s']} s: {len(result['namespaces'])} namespaces, {len(result['pids'])} processes"
            )
        elif args.command == "status":
            result = status()
            if args.json:
                print(json.dumps(result, indent=2))
            elif not result["up"]:
                print(f"no bed (namespaces: {result['namespaces'] or 'none'}, bridge: {result['bridge']})")
            else:
                print(f"RAY_ADDRESS={result['ray_address']}  bridge {BRIDGE}: {result['bridge']}")
                for name, host in result["hosts"].items():
                    print(
                        f"  {name:<10} {host['ip']:<14} " + " ".join(f"{k}={v}" for k, v in host.items() if k != "ip")
                    )
                for node in result.get("nodes", []):
                    state = "alive" if node["alive"] else f"dead ({node['death']})"
                    print(f"  node {node['node_id'][:12]} {node['ip']:<14} {state}")
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("exec HOST -- CMD...")
            argv_ = exec_argv(args.host, cmd, env=not args.no_env)
            os.execvp(argv_[0], argv_)
        elif args.command == "kill":
            result = kill_host(args.host, wait_dead=args.wait)
            print(f"killed {len(result['pids'])} processes on {args.host} ({result['ip']})")
        elif args.command == "restart":
            result = restart_host(args.host)
            print(f"{args.host} ({result['ip']}) back as node {result['node_id']} in {result['restart_s']} s")
    except HostsError as e:
        print(f"hosts.py: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `hosts.py up | head -1`: the work is done, the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
