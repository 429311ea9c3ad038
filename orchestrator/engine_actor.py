"""One vLLM engine inside a Ray actor, serving vLLM's OpenAI API on a port.

Life cycle: the controller creates the actor (``__init__`` only sets up the
environment and the log file), then calls ``start()``, which builds vLLM's
``AsyncLLM`` in this process and serves vLLM's own FastAPI app with uvicorn
on this actor's event loop. ``info()`` reports the state: ``idle`` (created
or restarted by Ray, not started), ``starting``, ``ready`` or ``failed``.

Failure handling:
- ``start()`` failing raises ``EngineStartError`` carrying vLLM's own error
  lines, taken from this engine's log file (vLLM's engine core runs in a
  child process and writes its traceback there, not into the exception).
- When vLLM's engine core dies later, a watchdog exits this process so that
  Ray restarts the actor; the controller sees ``idle`` and starts it again.
- The same when our connector's side channel stops answering (its ranks are
  pinged, sealed, every ``SIDE_CHANNEL_PROBE_S``): ``/health`` says 503 from
  the second missed probe, and the process exits at the
  ``SIDE_CHANNEL_DEAD_AFTER``-th (without it, every request to this engine
  would be recomputed while everything says "ok").

Its HTTP server answers only the cluster (``orchestrator.engine_guard``): the
engine key on every route but ``/health`` and ``/metrics``.

vLLM is imported only here and in ``orchestrator.engine_server``, inside the functions that need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

from connectors.identity import ENGINE_EPOCH_ENV
from connectors.tier import LAYOUT_ENV, REGION_ENV, region_file
from contract.auth import ENGINE_KEY_ENV, SECRET_ENV, ClusterSecret, engine_key
from contract.private_files import make_private_dirs
from orchestrator.engine_guard import guard
from orchestrator.engine_log import START_PHASES, error_excerpt, logged_at
from orchestrator.engine_processes import end_children, parse_cores, pin_process_tree
from orchestrator.engine_server import engine_in_placement_group, listen_socket, node_address, once_a_second
from orchestrator.errors import EngineStartError
from orchestrator.launch import EngineLaunch
from orchestrator.logs import redirect_output
from orchestrator.paths import compile_cache_dir, engine_temp_dir, fresh_temp_dir
from orchestrator.shm import ShmRecord, is_resource_tracker, stop_resource_tracker

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
WATCH_STEP_S = 1.0  # how often a watch (``EngineActor.watch``) looks at the state, inside the actor
PHASE_READ_S = 0.5  # how often a start reads vLLM's new log lines for its phases
SIDE_CHANNEL_PROBE_S = 5.0
SIDE_CHANNEL_PING_TIMEOUT_S = 5.0
SIDE_CHANNEL_UNHEALTHY_AFTER = 2
SIDE_CHANNEL_DEAD_AFTER = 4
"""Missed side-channel probes in a row after which /health says 503, and after which the engine restarts."""
# The Ray concurrency group ``stop`` runs in: an event loop of its own (``ENGINE_ACTOR_GROUPS``, given when the
# actor is created). vLLM's start-up blocks the actor's main loop while it waits for its engine core to load
# the model (``wait_for_engine_startup`` polls a socket), so a stop on that loop waited for the whole start.
CONTROL_GROUP = "control"
PROGRESS_GROUP = "progress"  # ``progress``: answered while vLLM's start holds the main loop
ENGINE_ACTOR_GROUPS = {CONTROL_GROUP: 1, PROGRESS_GROUP: 1}
STOP_KILL_AFTER_S = 10.0  # a start's processes that outlive SIGTERM this long are killed


class EngineActor:
    """Ray actor class (wrapped with ``ray.remote`` by the controller)."""

    def __init__(
        self, launch: EngineLaunch, log_path: str, interface: str | None = None, secret: ClusterSecret | None = None
    ) -> None:
        if launch.host is None or launch.bind:
            launch = launch.on_host(launch.host or node_address(interface), launch.bind)
        self.launch = launch
        self.log_path = Path(log_path)
        self.state = "idle"
        self.error: str | None = None
        self.load_s: float | None = None
        self.placed_at = time.time()
        self.phases: list[dict[str, Any]] = []  # this start's phases so far: {"phase", "t": when it ended}
        self._phase_lock = threading.Lock()  # the main loop's thread and progress()'s both read the log
        self._log_offset, self._log_tail = 0, b""
        self._stack: contextlib.AsyncExitStack | None = None
        self._server: Any = None
        self._tasks: list[asyncio.Task] = []
        self._starting: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's main loop, where vLLM runs
        self.url = launch.url
        os.environ.update(launch.env)
        # vLLM's engine core logs to its stdout, this actor's log file: unbuffered, each line arrives when it is
        # logged (a start's phases are read from them), not in 8 KiB bursts.
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        # What vLLM's processes leave in /dev/shm when they do not exit cleanly, noted while they run;
        # a record left by an earlier run of this engine (Ray restarted the actor after a crash) is
        # cleaned up now.
        self._shm = ShmRecord(self.log_path)
        self._remove_shm_leftovers()
        os.environ[REGION_ENV] = f"{launch.engine_id}-{secrets.token_hex(4)}"
        # This start of the engine, for its scheduler and every worker (KV parameters, handshakes, pins): a
        # decode engine never reads through a mapping of an earlier start of this engine id and port.
        os.environ[ENGINE_EPOCH_ENV] = secrets.token_hex(8)
        # where the engine core's tiers say how their entries are named, for the HTTP server's answers
        self._tier_layouts = self.log_path.with_name(self.log_path.name + ".tiers")
        os.environ[LAYOUT_ENV] = str(self._tier_layouts)
        self._side_channel_missed = 0
        if secret is None:  # an engine answers its cluster only: there is no cluster without a secret
            raise EngineStartError(launch.engine_id, "no cluster secret: the engine would answer anyone")
        # for the connector (side channel, transfer parameters) and vLLM's --api-key
        os.environ[SECRET_ENV] = secret.reveal()
        os.environ[ENGINE_KEY_ENV] = engine_key(secret)
        # vLLM's ZMQ sockets between its HTTP server and engine core, and its Gloo rendezvous file, go to the
        # temp dir and nothing removes them: each start left four or five in /tmp. They go to a private dir of
        # this engine's (``_fresh_temp_dir``; the same one after a crash, so its leftovers go too).
        self._temp_dir = engine_temp_dir(self.log_path)
        os.environ["TMPDIR"] = str(self._temp_dir)  # for vLLM's processes; this one's: tempfile.tempdir
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(make_private_dirs(compile_cache_dir()))  # not in TMPDIR
        redirect_output(self.log_path)

    async def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.launch.engine_id,
            "role": self.launch.role,
            "state": self.state,
            "url": self.url,
            "host": self.launch.host,
            "kv_endpoints": list(self.launch.kv_endpoints),
            "pid": os.getpid(),
            "cpu_bind": self.launch.cpu_bind,
            "load_s": self.load_s,
            "phases": list(self.phases),
            "error": self.error,
            "log_path": str(self.log_path),
        }

    async def watch(self, seen: str, timeout_s: float) -> dict[str, Any]:
        """``info()`` once the state is no longer ``seen``, or after ``timeout_s``: how the controller watches a
        running engine, one Ray call per ``timeout_s`` rather than a probe a second (each probe wakes Ray's
        threads in this process). A death of this process fails the call at once."""
        deadline = time.monotonic() + timeout_s
        while self.state == seen and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, WATCH_STEP_S))
        return await self.info()

    @ray.method(concurrency_group=PROGRESS_GROUP)
    async def progress(self, seen: int, timeout_s: float) -> dict[str, Any]:
        """``info()`` once the start has more than ``seen`` phases or has ended, or after ``timeout_s``: how
        ``pdserve up`` follows a start. It runs on a loop of its own (``PROGRESS_GROUP``): vLLM's start holds
        the main loop for seconds at a time (imports, the engine core's hand-shake)."""
        deadline = time.monotonic() + timeout_s
        while self.state == "starting" and len(self.phases) <= seen and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, PHASE_READ_S))
            self._read_phases()
        return await self.info()

    def _phase(self, name: str, t: float | None = None) -> None:
        if name not in {p["phase"] for p in self.phases}:
            self.phases.append({"phase": name, "t": time.time() if t is None else t})

    def _read_phases(self) -> None:
        """Note the phases vLLM's new log lines (this actor's output) say ended, at the time each line says."""
        with self._phase_lock, contextlib.suppress(OSError), open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            new = log.read()
            self._log_offset += len(new)
            lines = (self._log_tail + new).decode(errors="replace").splitlines(keepends=True)
            self._log_tail = lines.pop().encode() if lines and not lines[-1].endswith("\n") else b""
            for line in lines:
                for name, said in START_PHASES:
                    if said is not None and said in line:
                        self._phase(name, logged_at(line))

    async def start(self) -> dict[str, Any]:
        """Start vLLM (or wait for the start under way: a restarted controller asks again); its ``info()``."""
        if self.state == "ready":
            return await self.info()
        self._loop = asyncio.get_running_loop()
        if self.state != "starting" or self._starting is None:
            self.state, self.error = "starting", None
            self.phases, self._log_tail = [], b""
            self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._phase("actor placed", self.placed_at)
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return await self.info()

    async def _start(self) -> None:
        started = time.monotonic()
        logger.info("engine %s: starting vLLM (%s)", self.launch.engine_id, " ".join(self.launch.vllm_args))
        noting = asyncio.create_task(self._shm.note_while_starting())
        if self.launch.cpu_bind:  # its start too: vLLM's processes inherit this; unpinned, a start under load
            # (imports, weights, warm-up: a core for a minute) takes the other engines' cores, and a prefill
            # engine beside it computes at about 0.45x of its speed on a core of its own
            pin_process_tree(os.getpid(), parse_cores(self.launch.cpu_bind))
        try:
            await self._start_vllm()
        except BaseException as e:  # noqa: BLE001 - any failure, reported with vLLM's words
            noting.cancel()
            await self._close()
            self.state = "failed"
            sys.stderr.flush()
            self.error = error_excerpt(self.log_path.read_text(errors="replace"), e)
            logger.error("engine %s failed to start: %s", self.launch.engine_id, self.error)
            raise EngineStartError(self.launch.engine_id, self.error) from None
        noting.cancel()
        self._read_phases()
        if self.launch.cpu_bind:  # again: vLLM's NIXL connector moves a thread of its own (pin_process_tree)
            pinned = pin_process_tree(os.getpid(), parse_cores(self.launch.cpu_bind))
            logger.info("engine %s: %d threads pinned to cores %s", self.launch.engine_id, pinned, self.launch.cpu_bind)
        self.load_s = time.monotonic() - started
        self._remove_shm_leftovers(this_start_too=False)  # what a crashed start's children still held at first
        self._shm.note()
        self._phase("ready")
        self.state = "ready"
        logger.info("engine %s ready at %s in %.1fs", self.launch.engine_id, self.url, self.load_s)

    async def _start_vllm(self) -> None:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.launcher import NoSignalServer
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from connectors.kv_events import add_route as add_events_route
        from connectors.kv_events import events_config
        from connectors.tier.held import add_route as add_tier_route

        self._phase("vLLM imported")
        # vLLM's KV events on ipc sockets in this engine's private directory, relayed to the proxy over HTTP
        events = events_config(self._temp_dir)
        vllm_args = [*self.launch.vllm_args, "--kv-events-config", json.dumps(events)]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_args)
        validate_parsed_serve_args(args)
        shutil.rmtree(self._tier_layouts, ignore_errors=True)  # this start's tiers write theirs again
        fresh_temp_dir(self._temp_dir)
        # Bind before loading the model so that a taken port fails in a second, not a minute.
        sock = listen_socket(args.host, args.port)
        self._stack = contextlib.AsyncExitStack()
        self._stack.callback(sock.close)
        engine = engine_in_placement_group(args) if self.launch.placement.bundles else build_async_engine_client(args)
        engine_client = await self._stack.enter_async_context(engine)
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        await init_app_state(engine_client, app.state, args, supported_tasks)
        cache_config = engine_client.vllm_config.cache_config
        add_tier_route(app, self._tier_layouts, cache_config.prefix_caching_hash_algo, cache_config.block_size)
        add_events_route(app, events, cache_config.block_size)
        config = uvicorn.Config(
            guard(app, os.environ[ENGINE_KEY_ENV], lambda: self._healthy(engine_client)),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
        )
        self._server = once_a_second(NoSignalServer)(config)
        app.state.server = self._server
        serve = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if serve.done():
                serve.result()  # raises the server's error
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.05)
        self._tasks = [serve, asyncio.create_task(self._watchdog(engine_client))]
        if self.launch.serves_our_side_channel:
            self._tasks.append(asyncio.create_task(self._watch_side_channel()))

    async def _healthy(self, engine_client: Any) -> bool:
        """``GET /health``: vLLM's engine core alive, and our side channel answering."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            await engine_client.check_health()
        except EngineDeadError:
            return False
        return self._side_channel_missed < SIDE_CHANNEL_UNHEALTHY_AFTER

    async def _watch_side_channel(self) -> None:
        """Ping every TP rank's side channel; restart the engine (exit: Ray restarts the actor) when it has
        not answered ``SIDE_CHANNEL_DEAD_AFTER`` times in a row."""
        from connectors.side_client import SILENT, probe
        from contract.auth import KVAuth

        auth = KVAuth.from_env()
        endpoints = self.launch.kv_endpoints
        while True:
            await asyncio.sleep(SIDE_CHANNEL_PROBE_S)
            # A channel that closes our connection unanswered is flooded, not dead: only silence counts.
            answers = [await asyncio.to_thread(probe, e, auth, SIDE_CHANNEL_PING_TIMEOUT_S) for e in endpoints]
            silent = [e for e, answer in zip(endpoints, answers, strict=True) if answer == SILENT]
            self._side_channel_missed = self._side_channel_missed + 1 if silent else 0
            if silent:
                logger.error(
                    "engine %s: side channel %s did not answer (%d time(s) in a row)",
                    self.launch.engine_id,
                    ", ".join(silent),
                    self._side_channel_missed,
                )
            if self._side_channel_missed >= SIDE_CHANNEL_DEAD_AFTER:
                logger.error("engine %s: its side channel is gone; exiting so Ray restarts it", self.launch.engine_id)
                sys.stderr.flush()
                os._exit(1)

    async def _watchdog(self, engine_client: Any) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if engine_client.errored and not engine_client.is_running:
                logger.error(
                    "engine %s: vLLM engine core died (%s); exiting so Ray restarts this actor",
                    self.launch.engine_id,
                    engine_client.dead_error,
                )
                sys.stderr.flush()
                os._exit(1)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def stop(self) -> None:
        """Stop serving and shut the engine (and its engine-core process) down; a start under way ends: its
        processes are terminated (the engine core that loads the model, its workers), which fails vLLM's wait
        for them at once: a scale-down during a start stops the engine in seconds, not once it has loaded.
        Runs on the ``CONTROL_GROUP`` loop; what vLLM owns is closed on the main loop."""
        loop = self._loop
        if loop is None:  # never started
            self.state = "idle"
            return
        # Until the start is over: its processes end (those it spawns later too), so whatever it waits for
        # fails, and it cleans up after itself on the main loop as after any failed start.
        started = time.monotonic()
        while self.state == "starting" and time.monotonic() - started < 6 * STOP_KILL_AFTER_S:
            await asyncio.to_thread(end_children, time.monotonic() - started > STOP_KILL_AFTER_S)
            await asyncio.sleep(0.2)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(), loop))
        self.state = "idle"

    def _remove_shm_leftovers(self, this_start_too: bool = True) -> None:
        region = os.environ.get(REGION_ENV)  # unset before the first start
        self._shm.remove_leftovers(Path(region_file(region)) if region and this_start_too else None, this_start_too)

    async def _close(self) -> None:
        import psutil

        self._shm.note()
        if self._server is not None:
            self._server.exit()
        for task in self._tasks:
            if task is not self._tasks[0]:
                task.cancel()
        if self._tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._tasks[0], timeout=5)
        self._tasks, self._server = [], None
        # (not the resource tracker: it stays as long as this process)
        children = [p for p in psutil.Process(os.getpid()).children(recursive=True) if not is_resource_tracker(p)]
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(BaseException):
                await stack.aclose()
        await asyncio.to_thread(psutil.wait_procs, children, timeout=10)
        self._remove_shm_leftovers()
        shutil.rmtree(self._temp_dir, ignore_errors=True)
        tempfile.tempdir = None  # the system's again until the next start
        await asyncio.to_thread(stop_resource_tracker)
