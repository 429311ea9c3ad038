"""The proxy (``proxy.app``) served by uvicorn inside a Ray actor.

The controller creates it, calls ``start()``, and pushes the pool's ready
engines with ``set_endpoints()`` whenever an engine becomes ready, dies or
comes back; the app reads the same ``EnginePool`` object for every request.
That is why it serves one worker, in the actor's own process: worker processes
would each hold their own pool, which ``set_endpoints`` here could not reach
(see ``proxy.server``).

Least privilege: the actor is handed the engine key alone (``EngineKey``, derived
by the controller), which it puts in its process's environment as
``PDSERVE_ENGINE_KEY`` for ``proxy.auth``. It never holds the cluster secret: the
proxy forwards the sealed release and report messages of ``proxy.release`` and
``proxy.kv_report`` unopened, so it needs no KV key, and a process that holds the
secret could derive every key (and the KV tier's). A secret this worker process
inherited from Ray's environment is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Generator

import uvicorn

from contract.auth import PROXY_ENGINE_KEY_ENV, SECRET_ENV, SECRET_FILE_ENV, EngineKey
from contract.wire import LISTEN_ALL, http_url
from orchestrator.logs import redirect_output
from proxy.app import ProxyConfig, create_app
from proxy.pool import Endpoint, EnginePool, PoolSet
from proxy.server import listen_socket, tune_gc, uvicorn_config

logger = logging.getLogger(__name__)


class _ThreadServer(uvicorn.Server):
    """uvicorn without signal handlers: Ray owns this process's signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class ProxyActor:
    def __init__(
        self,
        config: ProxyConfig | list[ProxyConfig],
        host: str,
        port: int,
        log_path: str,
        engine_key: EngineKey | None = None,
    ) -> None:
        """``config``: the proxy's of each model it serves (``ClusterSpec.proxy_configs``), or of its one."""
        for name in (SECRET_ENV, SECRET_FILE_ENV):
            os.environ.pop(name, None)
        if engine_key is not None:  # what the proxy sends engines (``ProxyConfig.engine_auth``)
            os.environ[PROXY_ENGINE_KEY_ENV] = engine_key.reveal()
        redirect_output(log_path)
        self.configs = [config] if isinstance(config, ProxyConfig) else list(config)
        self.host, self.port = host, port
        self.pools = PoolSet({c.model_name: EnginePool() for c in self.configs})
        self.state = "idle"
        self._server: _ThreadServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> dict:
        if self.state == "ready":
            return await self.info()
        # Bound here, not by uvicorn: on a taken port uvicorn calls sys.exit, which would
        # leave this actor's event loop rather than fail this call.
        try:
            sock = listen_socket(self.host, self.port)
        except OSError as e:
            self.state = "failed"
            raise RuntimeError(f"proxy could not listen on {self.host}:{self.port} (is the port taken?): {e}") from e
        app = create_app(self.configs, self.pools.by_model)
        self._server = _ThreadServer(uvicorn_config(app, host=self.host, port=self.port))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self.state = "failed"
                raise RuntimeError(f"proxy on {self.host}:{self.port} stopped during start-up")
            await asyncio.sleep(0.05)
        tune_gc()  # this process serves only the proxy
        self.state = "ready"
        logger.info("proxy listening on http://%s:%d", self.host, self.port)
        return await self.info()

    async def set_endpoints(
        self,
        role: str,
        endpoints: list[tuple[str, str]] | list[tuple[str, str, tuple[str, ...]]],
        draining: tuple[str, ...] | list[str] = (),
        target: int | None = None,
        model: str | None = None,
    ) -> None:
        """Make ``endpoints`` the role's engines of ``model`` (None: the one model; ``(engine_id, url)``, or with
        the engine's KV side-channel endpoints third); those in ``draining`` stay (their requests are counted)
        but get no new ones, and one that was draining and is not any more (the controller took it back) gets
        them again. ``target``: the pool's size as the controller wants it (``/metrics``:
        ``pdserve_proxy_pool_target``)."""
        pool = self.pools.of(model)
        if target is not None:
            pool.targets[role] = target
        pool.set_endpoints(role, [Endpoint(*endpoint) for endpoint in endpoints])
        for endpoint in endpoints:
            if endpoint[0] in draining:
                pool.drain(endpoint[0])
            elif pool.engine(endpoint[0]).draining:
                pool.add(role, Endpoint(*endpoint))
        serving = [e[0] for e in endpoints if e[0] not in draining]
        of = f" of {model}" if len(self.configs) > 1 else ""
        logger.info("proxy: %s pool%s is now %s (draining: %s)", role, of, serving or "empty", list(draining) or "none")

    async def info(self) -> dict:
        return {
            "state": self.state,
            "url": http_url(self._reachable_host(), self.port),
            "pid": os.getpid(),
            "pool": self.pools.snapshot(),
        }

    def _reachable_host(self) -> str:
        """Where clients reach the proxy: its bind address, or this node's IP when it listens everywhere."""
        if self.host not in LISTEN_ALL:
            return self.host
        import ray

        return ray.util.get_node_ip_address()

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, timeout=10)
        self.state = "idle"
