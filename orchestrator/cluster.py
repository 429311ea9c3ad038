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
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from contract.auth import (
    write_secret,
)
from contract.private_files import make_private_dirs, open_private
from contract.wire import http_url
from orchestrator import shm
from orchestrator.control import ControlError, new_token, token_digest
from orchestrator.errors import ClusterNotRunning, PdserveError
from orchestrator.paths import engine_temp_dir
from orchestrator.ray_head import (
    process_trees,
    ray_connection,
    start_ray_head,
    stop_ray_head,
    terminate_trees,
    use_ray_auth,
)
from orchestrator.state import ClusterState, secret_for_up, secret_path, state_dir

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

logger = logging.getLogger(__name__)

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
    profile = autoscaling_profiles(spec, config)  # read and checked before anything starts
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
    profile: dict[str, dict[str, Any]],
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


def autoscaling_profiles(spec: ClusterSpec, config: str) -> dict[str, dict[str, Any]]:
    """Each model's ``autoscaling.profile`` that is set (``autoscaling_profile``), by its served name."""
    profiles = {view.model_name: autoscaling_profile(view, config) for view in spec.views()}
    return {name: profile for name, profile in profiles.items() if profile is not None}


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
    profile: dict[str, dict[str, Any]],
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> dict:
    """Create the controller (the one Ray call), record its API and token, then follow it over HTTP."""
    use_ray_auth(state)
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
    targets: dict[str, int],
    on_event: Callable[[dict[str, Any]], None],
    wait: bool = True,
    timeout_s: float = 1800,
    model: str | None = None,
) -> dict[str, Any]:
    """Ask the controller to resize pools (of ``model``: its served name or key; None: the only one); with
    ``wait``, follow its events until every pool in ``targets`` has that many ready engines and none draining.
    Return the last status."""
    return _change(lambda client: client.scale(targets, model=model), "scale", targets, on_event, wait, timeout_s,
                   model=model)  # fmt: skip


def move(
    source: str,
    destination: str,
    count: int,
    on_event: Callable[[dict[str, Any]], None],
    wait: bool = True,
    timeout_s: float = 1800,
    model: str | None = None,
) -> dict[str, Any]:
    """Ask the controller to move ``count`` ready engines (of ``model``) from pool ``source`` to ``destination``;
    with ``wait``, follow its events until both pools have their new sizes ready. Return the last status."""
    answer: dict[str, Any] = {}
    before: list[dict[str, Any]] = []

    def call(client: Any) -> None:
        before.extend(client.status().get("moves", []))
        answer.update(client.move(source, destination, count, model=model))

    def arrived(status: dict[str, Any]) -> bool:  # each moved engine serves in its new pool (its move is done)
        moved = {m["engine_id"] for m in status.get("moves", []) if m not in before}
        return moved >= set(answer.get("plan", {}).get("move", {}).get(f"{source}->{destination}", []))

    status = _change(call, "move engines", None, on_event, wait, timeout_s, arrived, model)
    return status | {"plan": answer.get("plan", {})}


def _change(
    call: Callable[[Any], Any],
    what: str,
    targets: dict[str, int] | None,
    on_event: Callable[[dict[str, Any]], None],
    wait: bool,
    timeout_s: float,
    done_when: Callable[[dict[str, Any]], bool] = lambda status: True,
    model: str | None = None,
) -> dict[str, Any]:
    """Make a change of the pools (``call``) and follow its events until the pools in ``targets`` (None: the
    controller's targets of both) of ``model`` have that many ready engines, none draining or moving, and
    ``done_when``."""
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
        pools = model_pools(status, model)
        wanted = targets or {role: pool["target"] for role, pool in pools.items()}
        done = done_when(status) and all(
            pools[r]["ready"] == n and not pools[r]["draining"] and not pools[r].get("moving")
            for r, n in wanted.items()
        )
        failed = [
            e["engine_id"]
            for e in status["engines"]
            if e["state"] == "failed" and e["role"] in wanted and model in (None, e["model"], _key(status, e))
        ]
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


def model_pools(status: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The pools of ``model`` (its served name or key) in ``pdserve status``; None: of every model."""
    if model is None:
        return status["pools"]
    return next(m["pools"] for m in status.get("models", []) if model in (m["name"], m["key"]))


def _key(status: dict[str, Any], engine: dict[str, Any]) -> str | None:
    return next((m["key"] for m in status.get("models", []) if m["name"] == engine.get("model")), None)


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
    terminate_trees(engine_procs)
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


def install_stop_signals() -> None:
    """Make SIGINT (Ctrl-C) and SIGTERM stop a foreground ``pdserve up``.

    SIGINT too, not only Python's default: a process started in the background
    by a non-interactive shell (``cmd &``, as CI scripts do) inherits SIGINT
    ignored, and Python then leaves it ignored, so ``up`` would be deaf to the
    SIGINT meant to stop it, and its cluster would leak.
    """

    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, _raise)
    signal.signal(signal.SIGTERM, _raise)
