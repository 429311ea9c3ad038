"""The proxy's settings (``ProxyConfig``), a plain dataclass that the orchestrator's spec builds and Ray can pickle.

Keys appear here only as the names of the environment variables, or the
file, that hold them (``proxy.auth`` reads them when the app is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.engine_client import CONNECT_TIMEOUT_S
from proxy.routing import RoutingSettings

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ProxyConfig"]

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    model_name: str
    request_timeout_s: float = 600.0
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    """Routing policies, decode-only path, retries and health checks."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """A longer request body is refused (413)."""
    max_concurrent_requests: int | None = None
    """Completion requests under way at once in this process (None: no limit)."""
    max_queued_requests: int = 1024
    """With ``max_concurrent_requests``: how many more may wait for a slot before 429s."""
    max_model_len: int | None = None
    """The engines' context length: requests that plainly exceed it are refused here (400)."""
    api_key_env: tuple[str, ...] = ()
    """Environment variables holding the API keys clients must present (none: no key needed)."""
    api_key_file: str | None = None
    """A file of API keys, one per line (``#`` comments)."""
    admin_key_env: tuple[str, ...] = ()
    """Environment variables holding the admin keys (none, and no file: no admin routes)."""
    admin_key_file: str | None = None
    admin_engine_networks: tuple[str, ...] = ()
    """Networks (CIDRs) where the admin routes may add engines, besides the hosts of the engines the proxy
    was given (``proxy.admin``: an added engine is sent users' requests and the engine key)."""
    forward_authorization: bool = False
    """Send the client's ``Authorization`` header on to the engines (for engines started with --api-key)."""
    fast_path: bool = True
    """Serve with the routes and uvicorn protocol that rely on FastAPI/uvicorn internals (``proxy.app``);
    false: stock FastAPI routing and uvicorn's protocol."""
    engine_auth: bool = False
    """Send the engines the cluster's engine key, instead of any client's: ``PDSERVE_ENGINE_KEY`` (what the
    cluster's proxy is given), a file of it (``PDSERVE_ENGINE_KEY_FILE``), or derived from the cluster secret
    (``PDSERVE_CLUSTER_SECRET`` or ``PDSERVE_CLUSTER_SECRET_FILE``); ``connectors.auth.load_engine_key``."""
    bind_reader: bool = False
    """Tell the prefill engine which decode engine will read (``pdserve_reader``): the engines' connector ids
    are the pool's engine ids (a pdserve cluster's ``pdserve`` connector)."""
