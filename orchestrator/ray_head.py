"""The local Ray head ``pdserve up`` starts when no Ray cluster is named, its token, stopping it and process
trees, and this process as a Ray driver."""

from __future__ import annotations

import contextlib
import hashlib
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from contract.private_files import make_private_dirs
from orchestrator import placement, shm
from orchestrator.errors import PdserveError
from orchestrator.state import ClusterState, state_dir

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

STOP_GRACE_S = 10.0
STOP_SCANS = 3


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
        terminate_trees(roots, stage=_ray_stop_stage)
    # its sockets, its session's logs: nothing runs there now (the engines' and pdserve's logs are in the state dir)
    home = Path(temp_dir).parent
    shutil.rmtree(home if home.name.startswith(RAY_HOME_PREFIX) else temp_dir, ignore_errors=True)


def _ray_stop_stage(proc: psutil.Process) -> int:
    """The GCS goes last, as ``ray stop`` does it. Stopped together with the rest, the GCS and the autoscaler's
    monitor wait on each other until the 10-s grace runs out (``pdserve down`` then takes 15 s on an idle
    cluster); stopped last, the GCS goes 2 s after the others."""
    with contextlib.suppress(psutil.Error):
        return 1 if proc.name() == "gcs_server" else 0
    return 0


def terminate_trees(roots: list[psutil.Process], stage: Callable[[psutil.Process], int] | None = None) -> None:
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
    use_ray_auth(state)
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


def use_ray_auth(state: ClusterState) -> None:
    """Our own head runs with token auth (Ray's default for new clusters); a
    client joining an existing cluster must ask for it explicitly, and before
    Ray is first imported: its C++ config reads the variable once."""
    if state.started_ray:
        if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != "token":
            raise RuntimeError("ray was imported before its auth mode was set")  # a bug of ours, not the user's
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(ray_token_path())


def process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants, as they are now."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
    return procs
