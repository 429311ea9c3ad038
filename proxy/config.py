"""The proxy's settings, defined once.

``ProxySettings`` is what a user sets: a cluster spec's ``proxy`` section (which
adds only where the proxy runs) and ``pdserve proxy``'s ``--config FILE`` and
flags, which are generated from these fields. ``ProxyConfig`` is what one
proxy app is built from: the settings and what its cluster decides (the
model's name, the engines' context length, whether engines take the cluster's
key). Both are frozen pydantic models that Ray can pickle.

Keys appear here only as the names of the environment variables, or the
file, that hold them (``proxy.auth`` reads them when the app is built).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from proxy.auth import ENV_NAME
from proxy.engine_client import CONNECT_TIMEOUT_S
from proxy.policies import REGISTRY, describe

__all__ = ["DEFAULT_MAX_BODY_BYTES", "POLICIES", "ProxyConfig", "ProxySettings", "RoutingConfig"]

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
POLICIES = tuple(REGISTRY)
Policy = Literal[POLICIES]  # type: ignore[valid-type]


def _env_name(value: str) -> str:
    """A variable's name; what is not one may be a key pasted by mistake, so the error does not repeat it."""
    if not ENV_NAME.fullmatch(value):
        raise PydanticCustomError(
            "env_name", "not the name of an environment variable (name the variable; never write a key here)",
            {"hide_input": True},
        )  # fmt: skip
    return value


EnvName = Annotated[str, AfterValidator(_env_name)]


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoutingConfig(_Settings):
    """The routing policy of each pool, and the prefix-aware policy's settings (``proxy.routing``)."""

    prefill: Policy = Field(
        default="round_robin",
        description=f"Policy choosing prefill engines: {describe()}.",
    )
    decode: Policy = Field(default="round_robin", description="Policy choosing decode engines (the same).")
    prefix_block_chars: int = Field(
        default=256, ge=1, description="Characters per hashed prefix block (token-id prompts: a quarter as many)."
    )
    prefix_max_blocks: int = Field(
        default=32, ge=1, description="Only the prompt's first blocks are hashed (8 KiB of text by default)."
    )
    prefix_cache_size: int = Field(default=100_000, ge=1, description="Prefix hashes remembered per pool (LRU).")
    prefix_overload_factor: float = Field(
        default=2.0,
        ge=1,
        description="prefix_aware skips the engine holding the prefix when (its load + 1) exceeds this "
        "times (the least load + 1).",
    )
    kv_events: bool = Field(
        default=True,
        description="Follow each engine's KV events (vLLM's, relayed by pdserve's engines): prefix_aware and "
        "decode_only_if_cached then read which prompt blocks each engine's prefix cache holds, instead of the "
        "prefixes the proxy sent it (still their fallback for engines whose events do not come).",
    )

    @property
    def needs_load(self) -> bool:
        """Whether a policy reads the engines' reported load (so ``/metrics`` is worth polling)."""
        return any(REGISTRY[p].needs_load for p in (self.prefill, self.decode))


class ProxySettings(_Settings):
    """What a user sets of the proxy: the cluster spec's ``proxy`` section, ``pdserve proxy --config``/flags."""

    host: str = Field(default="127.0.0.1", description="Address the OpenAI-compatible proxy binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port of the proxy (pdserve proxy: 0 picks one).")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Bound on a prefill call, and on silence in a decode stream."
    )
    connect_timeout_s: float = Field(
        default=CONNECT_TIMEOUT_S, gt=0, description="Upper bound on opening a connection to an engine."
    )
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="The routing policy of each pool.")
    decode_only_below_tokens: int = Field(
        default=0,
        ge=0,
        description="Prompts shorter than this (estimated: token ids counted, text at 4 characters a token) "
        "go to a decode engine alone, with no prefill leg. 0: always disaggregate.",
    )
    decode_only_if_cached: bool = Field(
        default=False,
        description="Serve decode-only a prompt whose prefix the chosen decode engine was recently sent, or, with "
        "a shared kv_tier, whose prompt the tier holds (asked of a tier engine before routing).",
    )
    decode_only_cached_fraction: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="With decode_only_if_cached: the share of the prompt's prefix blocks that must have been sent "
        "(or of its tokens the shared KV tier must hold).",
    )
    tier_lookup_timeout_s: float = Field(
        default=0.5,
        gt=0,
        description="With a shared kv_tier and a routing choice it changes (decode_only_if_cached, prefix_aware): "
        "how long routing waits for a tier engine to say what the tier holds of a prompt; without an answer the "
        "request is routed as without a tier.",
    )
    prefill_retries: int = Field(
        default=1,
        ge=0,
        description="A prefill that fails (connection, timeout, 5xx; not a 4xx) is tried on up to this many other "
        "prefill engines.",
    )
    decode_retries: int = Field(
        default=2,
        ge=0,
        description="A decode engine that cannot be reached, or whose connection breaks before a non-streamed "
        "answer came (it died under the request: nothing has reached the client), hands the request to another "
        "ready decode engine (with degrade and none left, a prefill engine), which computes the prompt itself: up "
        "to this many times (X-PDServe-Migrated names the engines left). A greedy stream that has begun is "
        "continued there from the tokens already sent; other streams end with an error event that says why. Not "
        "after a timeout or a 5xx (it may still be working). 0: off (502, or the error event).",
    )
    decode_retry_s: float = Field(
        default=60.0,
        gt=0,
        description="A decode leg is moved to another engine (decode_retries) only within this long after its "
        "first engine failed.",
    )
    degrade: bool = Field(
        default=True,
        description="When no prefill engine can take a request (none ready: empty, ejected or draining), or its "
        "prefill failed on every engine tried, serve it decode-only; when no decode engine can, on a prefill engine "
        "alone. 503 only when no engine can.",
    )
    health_interval_s: float = Field(
        default=2.0,
        ge=0,
        description="Seconds between GET /health probes of every engine; 0 turns health checks and ejection off.",
    )
    health_timeout_s: float = Field(default=1.0, gt=0, description="A probe (or /metrics poll) slower than this fails.")
    unhealthy_after: int = Field(
        default=3,
        ge=1,
        description="Consecutive failures (probes, unreachable requests) that eject an engine from routing.",
    )
    healthy_after: int = Field(default=2, ge=1, description="Consecutive good probes that readmit an ejected engine.")
    metrics_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="Seconds between polls of the engines' /metrics (load-aware policies only); 0: never.",
    )
    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES, ge=1024, description="Longest request body the proxy reads; longer is 413."
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request body not all received this long after its headers is refused (408; the "
        "connection is closed).",
    )
    body_idle_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request body of which nothing more came for this long is refused (408), before "
        "body_timeout_s passed.",
    )
    stream_write_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A streamed answer whose client takes nothing more for this long while the proxy has more to "
        "send (the client stopped reading; its connection's buffers are full) is cut: its connection is closed, "
        "the decode engine's request cancelled and its admission slot given back.",
    )
    max_concurrent_requests: int | None = Field(
        default=None,
        ge=1,
        description="Requests under way at once (completions, /tokenize, /detokenize), per proxy process. Default: "
        "requests_per_engine for every ready engine (healthy, not draining) of both pools, at least one engine's "
        "worth, recomputed whenever an engine joins, leaves, drains, moves or is ejected.",
    )
    requests_per_engine: int | None = Field(
        default=None,
        ge=1,
        description="What one engine runs at once (its vLLM --max-num-seqs), for the default "
        "max_concurrent_requests. Default: in a cluster, engine.extra_args.max_num_seqs, else vLLM's CPU default "
        "(128 per TP rank) on CPU; otherwise 1024, the most vLLM's default is (GPUs of 70 GiB or more).",
    )
    max_queued_requests: int = Field(
        default=1024,
        ge=0,
        description="How many more requests wait for a slot once max_concurrent_requests run; past that, 429 "
        "with Retry-After.",
    )
    api_key_env: tuple[EnvName, ...] = Field(
        default=(),
        description="Names of environment variables (in the proxy's process) holding the API keys clients must "
        "send as 'Authorization: Bearer <key>'. Never the keys themselves. Empty (and no file): no key needed.",
    )
    api_key_file: str | None = Field(
        default=None, description="A file on the proxy's node with one API key per line ('#' comments)."
    )
    admin_key_env: tuple[EnvName, ...] = Field(
        default=(),
        description="Names of environment variables holding the admin keys of the /admin routes "
        "(none, and no file: the /admin routes do not exist).",
    )
    admin_key_file: str | None = Field(default=None, description="A file of admin keys, one per line.")
    admin_engine_networks: tuple[str, ...] = Field(
        default=(),
        description="Networks (CIDRs) where the admin routes may add engines, besides the hosts of the engines "
        "the proxy was given (an added engine is sent users' requests and the engine key).",
    )
    fast_path: bool = Field(
        default=True,
        description="Serve with the routes and uvicorn protocol that lean on FastAPI/uvicorn internals (faster); "
        "false: stock FastAPI routing and uvicorn's httptools protocol (the same answers).",
    )
    forward_authorization: bool = Field(
        default=False,
        description="Send the client's Authorization header on to the engines: for engines someone else started "
        "with --api-key, never a pdserve cluster's (they accept only the cluster's engine key, which the proxy "
        "sends).",
    )


class ProxyConfig(ProxySettings):
    """What one proxy app is built from: the user's settings and what its cluster (or command line) decides."""

    model_name: str = Field(description="The model's name clients use in 'model'.")
    adapters: tuple[str, ...] = Field(
        default=(), description="The LoRA adapters the engines load: a request may name one as its model."
    )
    max_loras: int = Field(
        default=1,
        ge=1,
        description="Adapters an engine applies at once: with fewer than adapters, each adapter's "
        "requests stay on the same engines of a pool (``proxy.routing``).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="The engines' context length: requests that plainly exceed it are refused here (400).",
    )
    engine_auth: bool = Field(
        default=False,
        description="Send the engines the cluster's engine key, instead of any client's: PDSERVE_ENGINE_KEY, a "
        "file of it (PDSERVE_ENGINE_KEY_FILE), or derived from the cluster secret (contract.auth.load_engine_key).",
    )
    bind_reader: bool = Field(
        default=False,
        description="Tell the prefill engine which decode engine will read (pdserve_reader): the engines' connector "
        "ids are the pool's engine ids (a pdserve cluster's pdserve connector).",
    )
    tier_pools: tuple[Literal["prefill", "decode"], ...] = Field(
        default=(),
        description="Pools whose engines share a KV tier: any of them loads what it holds, so "
        "decode_only_if_cached and prefix_aware ask it (TierHeld) before routing.",
    )

    @classmethod
    def of(cls, settings: ProxySettings, **decided: object) -> ProxyConfig:
        """``settings`` (or a subclass's, whose further fields are left out) with what the caller decides."""
        return cls.model_validate({**settings.model_dump(include=set(ProxySettings.model_fields)), **decided})
