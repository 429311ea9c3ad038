"""vLLM's HTTP server and engine as an engine actor runs them: the listening socket, a uvicorn server that wakes
once a second, vLLM's engine inside the actor's placement group (GPU engines), and the address the engine is
reached at."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from proxy.server import listen_socket as proxy_listen_socket

SERVER_TICK_S = 1.0


def once_a_second(server: type) -> type:
    """``server`` (a uvicorn ``Server`` class) waking once a second instead of ten times, and at once on ``exit()``.

    uvicorn's main loop wakes every 0.1 s to see whether it should exit and, every tenth time, to renew its
    ``Date`` header. In an idle engine each wake-up must take the GIL from Ray's main thread, which takes it
    a hundred times a second to check for signals (README, "Idle engines"). Here every tick is the header's
    tick; the only other check, exiting, is woken directly.
    """

    class OnceASecond(server):
        def exit(self) -> None:
            self.should_exit = True
            if (wake := getattr(self, "_wake", None)) is not None:
                wake.set()

        async def main_loop(self) -> None:
            self._wake = asyncio.Event()
            tick = 0
            while not await self.on_tick(tick * 10):  # uvicorn renews the header when ``counter % 10 == 0``
                tick += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), SERVER_TICK_S)

    return OnceASecond


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for vLLM's uvicorn, created with IPPROTO_TCP.

    asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    ``proto`` is IPPROTO_TCP; vLLM's helper makes them with proto 0, and on the
    default event loop every small response then waits ~40 ms for a delayed ACK.
    The proxy's sockets are made the same way (``proxy.server.listen_socket``).
    """
    sock = proxy_listen_socket(host, port)
    sock.listen(2048)
    return sock


@contextlib.asynccontextmanager
async def engine_in_placement_group(args: Any) -> Any:
    """vLLM's engine for a GPU engine actor: its TP workers go into this actor's placement group.

    vLLM's engine core runs in a child process, where Ray's "current placement group" is unknown;
    vLLM takes one from ``parallel_config.placement_group`` instead (as Ray Serve LLM hands it).
    Otherwise as vLLM's own ``build_async_engine_client``.
    """
    import ray
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    config.parallel_config.placement_group = ray.util.get_current_placement_group()
    engine = AsyncLLM.from_vllm_config(
        vllm_config=config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def node_address(interface: str | None) -> str:
    """The address other hosts reach this engine at (its Ray node IP, or ``interface``'s)."""
    import ray

    from orchestrator.address import advertised_address

    return advertised_address(interface, ray.util.get_node_ip_address())
