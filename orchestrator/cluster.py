"""Client-side cluster operations behind ``pdserve up``, ``status`` and ``down``.

``up`` validates the spec, joins the Ray cluster the spec (or ``RAY_ADDRESS``)
names or starts a local Ray head of its own, creates the detached
``ClusterController`` actor and follows its events until the cluster is
ready or has failed. What it started is recorded in a state file
(``$PDSERVE_STATE_DIR/cluster.json``, default ``~/.cache/pdserve/run``, mode
0600): with the controller's API endpoint and the cluster's token, so
``status``, ``scale`` and ``down`` in another shell are one HTTP call each
(``orchestrator.control``), without a Ray driver. ``down`` removes exactly
what ``up`` made: the actors, every engine process, and the local Ray head if
``up`` started it (a joined Ray cluster is left running). Only ``up``, and
``down`` when the controller does not answer, connect to Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from contract.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    ClusterSecret,
    load_secret,
    new_secret,
    read_secret_file,
    write_secret,
)
from contract.private_files import make_private_dirs, open_private, write_private
from contract.wire import http_url
from orchestrator import placement, shm
from orchestrator.control import ControlClient, ControlError, new_token, token_digest
from orchestrator.errors import ClusterNotRunning, PdserveError
from orchestrator.paths import engine_temp_dir, pdserve_dir

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

logger = logging.getLogger(__name__)

CONTROLLER_SUFFIX = "-controller"
STOP_GRACE_S = 10.0
STOP_SCANS = 3


def state_dir() -> Path:
    return pdserve_dir("run", "PDSERVE_STATE_DIR")


@dataclass(slots=True)
class ClusterState:
    name: str
    namespace: str
    config: str
    ray_address: str
    started_ray: bool
    ray_temp_dir: str | None
    log_dir: str
    proxy_url: str
    api_url: str = ""  # the controller's HTTP API, once it serves
    api_token: str = ""  # the cluster's token for it: never printed or logged

    @property
    def controller_name(self) -> str:
        return self.name + CONTROLLER_SUFFIX

    def client(self, timeout_s: float = 30.0) -> ControlClient:
        if not self.api_url:
            raise ClusterNotRunning(f"cluster {self.name!r} has no controller API recorded in {self.path()}")
        return ControlClient(self.api_url, self.api_token, timeout_s)

    @staticmethod
    def path() -> Path:
        return state_dir() / "cluster.json"

    def save(self) -> None:
        make_private_dirs(self.path().parent)
        write_private(self.path(), json.dumps(asdict(self), indent=2))  # 0600: it holds the cluster's token

    @classmethod
    def load(cls) -> ClusterState:
        try:
            return cls(**json.loads(cls.path().read_text()))
        except FileNotFoundError:
            raise ClusterNotRunning(f"no pdserve cluster is running (no {cls.path()})") from None

    @classmethod
    def clear(cls) -> None:
        cls.path().unlink(missing_ok=True)
        secret_path().unlink(missing_ok=True)


def secret_path() -> Path:
    """The running cluster's secret (mode 0600): for ``pdserve proxy --cluster-secret-file`` and tools
    that call its engines (``load_cluster_secret``)."""
    return state_dir() / "cluster-secret"


def secret_for_up(environ: Mapping[str, str] | None = None) -> ClusterSecret:
    """The secret of the cluster ``up`` starts: the one the caller's environment gives
    (``PDSERVE_CLUSTER_SECRET``, or the file ``PDSERVE_CLUSTER_SECRET_FILE`` names), else a new one.

    The KV tier does not depend on it: its entries are MAC'd under the tier's own key, kept in its
    directory (``connectors.tier.key``), so a cluster started with a new secret loads what an earlier
    one stored.
    """
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_ENV, "").strip() or environ.get(SECRET_FILE_ENV, "").strip():
        return load_secret(environ)
    return new_secret()


def load_cluster_secret() -> ClusterSecret:
    """The running cluster's secret, from the state directory."""
    if not secret_path().exists():
        raise ClusterNotRunning(f"no pdserve cluster is running (no {secret_path()})")
    return read_secret_file(secret_path())


# --- the local Ray head ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RAY_HOME_PREFIX = "pdserve-ray-"


def _ray_temp_dir() -> str:
    """Where the local Ray head keeps its sockets and logs: ``r`` in a private dir of this cluster's. Ray makes
    its temp dir world-writable; the dir above it is ours alone. Socket paths must stay short (AF_UNIX), hence
    the system's temp dir and a hash of the state dir."""
    digest = hashlib.sha1(str(state_dir().resolve()).encode()).hexdigest()[:8]
    return str(Path(tempfile.gettempdir()) / f"{RAY_HOME_PREFIX}{os.getuid()}-{digest}" / "r")


def _private_home(temp_dir: str) -> Path:
    """The private dir above a Ray temp dir of ``_ray_temp_dir``'s, made and checked to be this user's alone."""
    home = Path(temp_dir).parent
    make_private_dirs(home)
    if (made := os.lstat(home)).st_uid != os.getuid() or not stat.S_ISDIR(made.st_mode):
        raise PdserveError(f"{home} (where this cluster's Ray head keeps its files) is not a directory of yours")
    os.chmod(home, 0o700)
    return home


def ray_token_path() -> Path:
    """The token of the Ray head pdserve starts: ours, beside the cluster's state, never ``~/.ray``.

    Token auth is on for our head; Ray then needs a token that every process of
    the cluster reads (``RAY_AUTH_TOKEN_PATH``). A fresh machine has none, and
    a user's own ``~/.ray/auth_token`` belongs to their other clusters.
    """
    path = state_dir() / "ray_auth_token"
    if not path.exists():
        make_private_dirs(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def start_ray_head(spec: ClusterSpec) -> tuple[str, str]:
    """Start a Ray head for this cluster alone; return (address, temp_dir)."""
    port, temp_dir = _free_port(), _ray_temp_dir()
    _private_home(temp_dir)  # ``stop_ray_head`` removes it
    cpus = placement.cpu_cores_available(spec)
    if spec.device == "cpu" and spec.resources.share_cores:  # Ray must still place every engine actor
        cpus = max(cpus, placement.cpu_cores_needed(spec))
    ray_bin = Path(sys.executable).parent / "ray"
    command = [
        str(ray_bin) if ray_bin.exists() else "ray", "start", "--head",
        f"--port={port}", f"--num-cpus={cpus}", f"--num-gpus={spec.resources.gpus}",
        f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
    ]  # fmt: skip
    token = str(ray_token_path())
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token)
    # A session of its own: Ctrl-C on a foreground `pdserve up` must reach pdserve
    # (which then stops the cluster in order), not kill Ray under it.
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, start_new_session=True)
    if result.returncode != 0:
        raise PdserveError(f"could not start a local Ray head:\n{result.stdout}\n{result.stderr}")
    return f"127.0.0.1:{port}", temp_dir


def stop_ray_head(temp_dir: str, address: str) -> None:
    """Stop the Ray head that ``start_ray_head`` made, and every process under it.

    Ray's own processes name either the head's temp dir or its GCS port
    (e.g. the client server: ``--address=NODE_IP:PORT``) on their command lines.
    """
    gcs_port = re.compile(rf"[:=][0-9.]+:{address.rsplit(':', 1)[1]}\b")
    # A raylet may start a worker while we stop the rest; such a straggler is
    # found by the next scan (on a loaded machine this happens).
    for _ in range(STOP_SCANS):
        roots = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                cmdline = " ".join(proc.info["cmdline"] or [])
                if temp_dir in cmdline or ("ray" in cmdline and gcs_port.search(cmdline)):
                    roots.append(proc)
        if not roots:
            break
        terminateprocess_trees(roots, stage=_ray_stop_stage)
    # its sockets, its session's logs: nothing runs there now (the engines' and pdserve's logs are in the state dir)
    home = Path(temp_dir).parent
    shutil.rmtree(home if home.name.startswith(RAY_HOME_PREFIX) else temp_dir, ignore_errors=True)


def _ray_stop_stage(proc: psutil.Process) -> int:
    """The GCS goes last, as ``ray stop`` does it. Stopped together with the rest, the GCS and the autoscaler's
    monitor waited on each other until the 10-s grace ran out: ``pdserve down`` took 15 s on an idle cluster.
    Stopped last, the GCS goes 2 s after the others."""
    with contextlib.suppress(psutil.Error):
        return 1 if proc.name() == "gcs_server" else 0
    return 0


def terminateprocess_trees(roots: list[psutil.Process], stage: Callable[[psutil.Process], int] | None = None) -> None:
    """Stop ``roots`` and their descendants: SIGTERM, then SIGKILL for what outlives ``STOP_GRACE_S``; a stage
    at a time in ``stage``'s order, if given."""
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        with contextlib.suppress(psutil.Error):
            for proc in [root, *root.children(recursive=True)]:
                procs[proc.pid] = proc
    # Python's resource trackers ignore SIGTERM; once the processes they serve are gone they remove the
    # semaphores and shared memory those left registered (/dev/shm/sem.mp-*, psm_*) and exit. Killed
    # with the rest, they left them behind: they go last, and are killed only if they stay.
    trackers = [p for p in procs.values() if shm.is_resource_tracker(p)]
    stages: dict[int, list[psutil.Process]] = {}
    for proc in procs.values():
        if proc not in trackers:
            stages.setdefault(stage(proc) if stage else 0, []).append(proc)
    for _, others in sorted(stages.items()):
        for proc in others:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(others, timeout=STOP_GRACE_S)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
    _, alive = psutil.wait_procs(trackers, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


@contextlib.contextmanager
def ray_connection(state: ClusterState) -> Iterator[Any]:
    """Connect this process to the cluster's Ray as a driver, for the ``with`` block."""
    _use_ray_auth(state)
    with _ray_driver(state.ray_address, state.namespace) as ray:
        yield ray


@contextlib.contextmanager
def _ray_driver(address: str, namespace: str | None = None) -> Iterator[Any]:
    """This process as a Ray driver of the cluster at ``address``, for the ``with`` block."""
    import ray

    # Ray's driver may set its own signal handlers: once it is shut down, put back what this process had
    # (a foreground ``up`` follows the cluster after the driver is gone, and must still stop on Ctrl-C).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as e:
        raise PdserveError(f"cannot connect to the Ray cluster at {address}: {e}") from e
    try:
        yield ray
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def cluster_nodes(address: str) -> list[Any]:
    """The nodes of the Ray cluster at ``address`` (``placement.Node``), for ``pdserve validate``."""
    from orchestrator.placement import Node

    with _ray_driver(address) as ray:
        return [Node.from_ray(node) for node in ray.nodes()]


def _use_ray_auth(state: ClusterState) -> None:
    """Our own head runs with token auth (Ray's default for new clusters); a
    client joining an existing cluster must ask for it explicitly, and before
    Ray is first imported: its C++ config reads the variable once."""
    if state.started_ray:
        if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != "token":
            raise RuntimeError("ray was imported before its auth mode was set")  # a bug of ours, not the user's
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(ray_token_path())


# --- up / status / down -----------------------------------------------------------------------


def _cluster_alive(state: ClusterState) -> bool:
    try:
        state.client(timeout_s=10).status()
        return True
    except PdserveError:  # nothing answers there: not alive
        return False


def up(
    config: str,
    on_event: Callable[[dict[str, Any]], None],
    follow: Callable[[Callable[[], dict[str, Any]]], None] | None = None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Bring the cluster up; return its status once ready. Raises PdserveError on failure.

    ``on_event`` is called with each of the controller's events, ``on_status`` (if given) with its status
    each time it is read while the cluster comes up (every half second). With ``follow`` (a foreground
    ``up``), call it with a status getter once the cluster is ready, and stop the cluster when it returns
    or raises (Ctrl-C).
    """
    from orchestrator.spec import ClusterSpec

    spec = ClusterSpec.from_file(config)
    profile = autoscaling_profile(spec, config)  # read and checked before anything starts
    with _starting_lock():
        state, status = _start(spec, config, on_event, profile, on_status)
    if follow is not None:
        try:
            follow(state.client().status)
        finally:
            down()
    return status


@contextlib.contextmanager
def _starting_lock() -> Iterator[None]:
    """Held while ``up`` brings a cluster up: a second ``up`` from the same state directory meanwhile
    would find nothing running yet, take the first one's records for leftovers and remove them."""
    import fcntl

    make_private_dirs(state_dir())
    with os.fdopen(open_private(state_dir() / "up.lock", os.O_RDWR | os.O_APPEND), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise PdserveError(
                f"another `pdserve up` ({holder}) is starting a cluster from {state_dir()}: "
                "wait until it is ready (then `pdserve down` stops it)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        yield


def _start(
    spec: ClusterSpec,
    config: str,
    on_event: Callable[[dict[str, Any]], None],
    profile: dict | None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[ClusterState, dict[str, Any]]:
    with contextlib.suppress(ClusterNotRunning):
        previous = ClusterState.load()
        if _cluster_alive(previous):
            raise PdserveError(
                f"cluster {previous.name!r} is already running (from {previous.config}); run `pdserve down` first"
            )
        logger.info("removing what a previous cluster left behind")
        down()
    address = spec.ray.address or os.environ.get("RAY_ADDRESS")
    started_ray, temp_dir = False, None
    if address is None:
        on_event({"t": time.time(), "message": "starting a local Ray head"})
        address, temp_dir = start_ray_head(spec)
        started_ray = True
    make_private_dirs(state_dir() / "logs")  # and each cluster's a private mkdtemp in it
    log_dir = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=state_dir() / "logs"))
    state = ClusterState(
        name=spec.name,
        namespace=spec.ray.namespace,
        config=str(Path(config).resolve()),
        ray_address=address,
        started_ray=started_ray,
        ray_temp_dir=temp_dir,
        log_dir=str(log_dir),
        proxy_url=http_url(spec.proxy.host, spec.proxy.port),
    )
    state.save()  # from here on, `pdserve down` can clean up whatever happens
    try:
        return state, _bring_up(state, spec, on_event, profile, on_status)
    except BaseException:
        down()
        raise


def autoscaling_profile(spec: ClusterSpec, config: str) -> dict[str, Any] | None:
    """The spec's ``autoscaling.profile``, loaded and checked (as a dict, for the controller actor); None if unset."""
    from orchestrator.autoscale.profile import ProfileError, load_profile

    path = spec.profile_path(config)
    if path is None:
        return None
    try:
        return load_profile(path).to_dict()
    except ProfileError as e:
        raise PdserveError(f"{config}: autoscaling.profile: {e}") from e


def _bring_up(
    state: ClusterState,
    spec: ClusterSpec,
    on_event: Callable[[dict[str, Any]], None],
    profile: dict | None,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> dict:
    """Create the controller (the one Ray call), record its API and token, then follow it over HTTP."""
    _use_ray_auth(state)
    from orchestrator.controller import ClusterController
    from orchestrator.placement import Node, assign, control_placement

    # A local cluster serves on loopback; on a joined one each engine resolves its node's address.
    host = "127.0.0.1" if state.started_ray else None
    token = new_token()
    secret = secret_for_up()
    write_secret(secret_path(), secret)
    with ray_connection(state) as ray:
        _, problems = assign(spec, [Node.from_ray(node) for node in ray.nodes()])
        if problems:  # Ray would wait for ever for a node that can take them
            raise PdserveError(
                f"{state.config}: the Ray cluster at {state.ray_address} cannot hold this spec:\n  "
                + "\n  ".join(problems)
            )
        controller = (
            ray.remote(ClusterController)
            .options(
                name=state.controller_name,
                lifetime="detached",
                max_restarts=-1,
                **control_placement(spec).actor_options(),
            )
            .remote(spec.model_dump(mode="json"), state.log_dir, host, profile, token_digest(token), None, secret)
        )
        state.api_url = ray.get(controller.start.remote(), timeout=120)
    state.api_token = token
    state.save()
    client = state.client()
    seen = 0
    while True:
        status = client.status()
        for event in status["events"][seen:]:
            on_event(event)
        seen = len(status["events"])
        if on_status is not None:
            on_status(status)
        if status["phase"] == "ready":
            return status
        if status["phase"] == "failed":
            raise PdserveError(status["error"])
        time.sleep(0.5)


def status() -> dict[str, Any]:
    state = ClusterState.load()
    try:
        return state.client().status()
    except ClusterNotRunning as e:
        raise ClusterNotRunning(
            f"cluster {state.name!r} is recorded in {ClusterState.path()} but is not running ({e}); "
            "`pdserve down` cleans up"
        ) from e


def scale(
    targets: dict[str, int], on_event: Callable[[dict[str, Any]], None], wait: bool = True, timeout_s: float = 1800
) -> dict[str, Any]:
    """Ask the controller to resize pools; with ``wait``, follow its events until every pool in
    ``targets`` has that many ready engines and none draining. Return the last status."""
    return _change(lambda client: client.scale(targets), "scale", targets, on_event, wait, timeout_s)


def move(
    source: str,
    destination: str,
    count: int,
    on_event: Callable[[dict[str, Any]], None],
    wait: bool = True,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Ask the controller to move ``count`` ready engines from pool ``source`` to ``destination``; with
    ``wait``, follow its events until both pools have their new sizes ready. Return the last status."""
    answer: dict[str, Any] = {}
    before: list[dict[str, Any]] = []

    def call(client: Any) -> None:
        before.extend(client.status().get("moves", []))
        answer.update(client.move(source, destination, count))

    def arrived(status: dict[str, Any]) -> bool:  # each moved engine serves in its new pool (its move is done)
        moved = {m["engine_id"] for m in status.get("moves", []) if m not in before}
        return moved >= set(answer.get("plan", {}).get("move", {}).get(f"{source}->{destination}", []))

    status = _change(call, "move engines", None, on_event, wait, timeout_s, arrived)
    return status | {"plan": answer.get("plan", {})}


def _change(
    call: Callable[[Any], Any],
    what: str,
    targets: dict[str, int] | None,
    on_event: Callable[[dict[str, Any]], None],
    wait: bool,
    timeout_s: float,
    done_when: Callable[[dict[str, Any]], bool] = lambda status: True,
) -> dict[str, Any]:
    """Make a change of the pools (``call``) and follow its events until the pools in ``targets`` (None: the
    controller's targets of both) have that many ready engines, none draining or moving, and ``done_when``."""
    client = ClusterState.load().client()
    seen = len(client.status()["events"])
    try:
        call(client)
    except ControlError as e:
        raise PdserveError(f"cannot {what}: {e}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status()
        for event in status["events"][seen:]:
            on_event(event)
        seen = len(status["events"])
        pools = status["pools"]
        wanted = targets or {role: pool["target"] for role, pool in pools.items()}
        done = done_when(status) and all(
            pools[r]["ready"] == n and not pools[r]["draining"] and not pools[r].get("moving")
            for r, n in wanted.items()
        )
        failed = [e["engine_id"] for e in status["engines"] if e["state"] == "failed" and e["role"] in wanted]
        if not wait or done:
            return status
        if failed:
            raise PdserveError(
                f"engine(s) {', '.join(failed)} failed to start; `pdserve status` shows why (the controller "
                "starts a failed engine again after a back-off, from 10 s to 5 min, while its pool is below "
                "its target)"
            )
        if time.monotonic() > deadline:
            raise PdserveError(f"pools did not reach {wanted} within {timeout_s:g}s")
        time.sleep(0.5)


def down() -> list[str]:
    """Stop the recorded cluster; return what was done, for the CLI to print."""
    state = ClusterState.load()
    done: list[str] = []
    engine_procs: list[psutil.Process] = []
    shm_files: set[Path] = set()
    try:
        client = state.client()
        current = client.status()
        # Whole trees, taken now: once the controller has stopped an engine
        # actor, its EngineCore and workers are no longer its children.
        engine_procs = process_trees([e["pid"] for e in current["engines"] if e.get("pid")])
        shm_files = shm.mapped(p.pid for p in engine_procs)
        client.shutdown()
        done.append(f"stopped cluster {state.name!r} ({len(current['engines'])} engines and the proxy)")
    except PdserveError as e:  # the controller is gone: clean up what it left
        done.append(f"controller not reachable ({type(e).__name__}); cleaning up")
        if not state.started_ray:  # a joined Ray cluster outlives us: its detached actors must go
            done += _kill_actors(state)
    # and what engines stopped or killed before this (mid-start, by a scale-down) noted in their records
    with contextlib.suppress(OSError):
        shm_files |= shm.recorded_in(Path(state.log_dir))
    if state.started_ray and state.ray_temp_dir:
        stop_ray_head(state.ray_temp_dir, state.ray_address)
        done.append("stopped the local Ray head")
    terminateprocess_trees(engine_procs)
    # what engines that did not exit cleanly left in /dev/shm (each stopping engine removes its own too)
    if removed := shm.remove_unheld(shm_files):
        done.append(f"removed {len(removed)} shared-memory file(s) the engines left in /dev/shm")
    remove_engine_temp_dirs(Path(state.log_dir))
    ClusterState.clear()
    return done


def remove_engine_temp_dirs(log_dir: Path) -> None:
    """The temp dirs of the engines that logged to ``log_dir``, which a stopping engine removes itself: those
    of engines that died and were not started again."""
    for log in log_dir.glob("*.log"):
        shutil.rmtree(engine_temp_dir(log), ignore_errors=True)


def _kill_actors(state: ClusterState) -> list[str]:
    """Kill the cluster's named actors (controller first, so it cannot restart the rest) through a Ray driver."""
    try:
        with ray_connection(state) as ray:
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == state.namespace and a["name"].startswith(state.name + "-")
            ]
            names.sort(key=lambda name: name != state.controller_name)
            for name in names:
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name), no_restart=True)
            return [f"killed {len(names)} actor(s) of {state.name!r} on the Ray cluster"]
    except Exception as e:  # noqa: BLE001 - Ray itself is gone: nothing of ours is left on it
        return [f"Ray at {state.ray_address} not reachable ({type(e).__name__})"]


def process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants, as they are now."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
    return procs


def install_stop_signals() -> None:
    """Make SIGINT (Ctrl-C) and SIGTERM stop a foreground ``pdserve up``.

    SIGINT too, not only Python's default: a process started in the background
    by a non-interactive shell (``cmd &``, as CI scripts do) inherits SIGINT
    ignored, and Python then leaves it ignored, so ``up`` would be deaf to the
    SIGINT meant to stop it (seen: a leaked cluster in a backgrounded suite run).
    """

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, _raise)
    signal.signal(signal.SIGTERM, _raise)
