"""The cluster spec: one YAML file that describes a pdserve cluster.

``ClusterSpec.from_file(path)`` reads and validates the YAML. Every problem is
reported at load time as a ``SpecError`` that names the file, the field (as a
dotted path, e.g. ``prefill.replicas``) and the reason; nothing half-valid
reaches the orchestrator.

Example (``configs/local-cpu.yaml``)::

    name: local-cpu
    model: smollm2-135m-instruct
    device: cpu
    connector: pdserve
    proxy: {port: 8000, routing: {prefill: prefix_aware, decode: least_loaded}}
    prefill: {replicas: 1, port: 8100, kv_port: 5600}
    decode: {replicas: 1, port: 8200, kv_port: 5700}
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from connectors.options import ConnectorOptions
from connectors.wire import ROLES
from orchestrator.errors import SpecError
from orchestrator.models import KNOWN_MODELS, model_cache_dir, resolve_model
from orchestrator.paths import pdserve_dir
from proxy.auth import ENV_NAME
from proxy.config import DEFAULT_MAX_BODY_BYTES, ProxyConfig
from proxy.engine_client import CONNECT_TIMEOUT_S
from proxy.routing import POLICIES, RoutingSettings

# Connector names a spec may use, mapped to the vLLM kv_transfer_config they need.
CONNECTORS = ("vllm-nixl", "pdserve")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RaySpec(_Strict):
    address: str | None = Field(
        default=None,
        description="Ray cluster to join (e.g. 'auto' or 'HOST:6379'). "
        "RAY_ADDRESS overrides; when neither is set pdserve starts a local Ray head.",
    )
    namespace: str = Field(default="pdserve", description="Ray namespace of the cluster's actors.")


_DNS = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LABEL_KEY = rf"^({_DNS}(\.{_DNS})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
"""A Kubernetes-style label key, as Ray node labels take them (``pdserve.io/pool``)."""
LabelKey = Annotated[str, Field(pattern=LABEL_KEY)]
LabelValue = Annotated[str, Field(pattern=r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")]
"""A Kubernetes-style label value: at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends, or empty."""
PG_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


class NodeSelectorSpec(_Strict):
    """Which Ray nodes may run a part of the cluster: all labels and resources must match."""

    node_labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        description="Ray node labels the host must carry (`ray start --labels k=v`; KubeRay: the group's labels).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources asked for (per engine TP rank for pools; `ray start --resources`).",
    )

    @property
    def key(self) -> tuple:
        """Parts with the same key may land on the same hosts."""
        return (tuple(sorted(self.node_labels.items())), tuple(sorted(self.resources.items())))

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.node_labels.items())]
        parts += [f"{k}:{v:g}" for k, v in sorted(self.resources.items())]
        return ", ".join(parts) or "any node"


class PlacementSpec(NodeSelectorSpec):
    """Where a pool's engines run."""

    strategy: Literal[PG_STRATEGIES] = Field(  # type: ignore[valid-type]
        default="STRICT_PACK",
        description="GPU engines: the Ray placement group strategy of an engine's TP-rank bundles.",
    )
    first_core: int = Field(
        default=0,
        ge=0,
        description="CPU engines: the first core of this pool's core plan on its host (hosts that share a "
        "machine, as the namespace test bed does, give each pool its own cores).",
    )


class NetworkSpec(_Strict):
    interface: str | None = Field(
        default=None,
        description="Engines advertise this network interface's IPv4 address to their peers (default: their "
        "Ray node IP).",
    )
    listen_all: bool = Field(
        default=False,
        description="Engines' HTTP servers bind 0.0.0.0 instead of the address they advertise.",
    )


_ROUTING = RoutingSettings()  # the defaults, said once (proxy.routing)
Policy = Literal[POLICIES]  # type: ignore[valid-type]


class RoutingSpec(_Strict):
    """The routing policy of each pool, and the prefix-aware policy's settings."""

    prefill: Policy = Field(
        default=_ROUTING.prefill_policy,
        description="Policy choosing prefill engines: round_robin, least_loaded (fewest of the proxy's requests "
        "plus the engine's queue and KV use from /metrics) or prefix_aware (the engine sent the longest "
        "prefix of the prompt, unless overloaded).",
    )
    decode: Policy = Field(default=_ROUTING.decode_policy, description="Policy choosing decode engines (the same).")
    prefix_block_chars: int = Field(
        default=_ROUTING.prefix_block_chars, ge=1, description="Characters per hashed prefix block."
    )
    prefix_max_blocks: int = Field(
        default=_ROUTING.prefix_max_blocks, ge=1, description="Only the prompt's first blocks are hashed."
    )
    prefix_cache_size: int = Field(
        default=_ROUTING.prefix_cache_size, ge=1, description="Prefix hashes remembered per pool (LRU)."
    )
    prefix_overload_factor: float = Field(
        default=_ROUTING.prefix_overload_factor,
        ge=1,
        description="prefix_aware skips the engine holding the prefix when (its load + 1) exceeds this "
        "times (the least load + 1).",
    )


EnvName = Annotated[str, Field(pattern=ENV_NAME.pattern, description="An environment variable's name.")]


class ProxySpec(_Strict):
    host: str = Field(default="127.0.0.1", description="Address the OpenAI-compatible proxy binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port of the proxy.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Upper bound on one upstream call to an engine.")
    connect_timeout_s: float = Field(
        default=CONNECT_TIMEOUT_S, gt=0, description="Upper bound on opening a connection to an engine."
    )
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    placement: NodeSelectorSpec | None = Field(
        default=None,
        description="Where the proxy and the controller run (default: the Ray head node).",
    )
    decode_only_below_tokens: int = Field(
        default=_ROUTING.decode_only_below_tokens,
        ge=0,
        description="Prompts shorter than this (estimated: token ids counted, text at 4 characters a token) "
        "go to a decode engine alone, with no prefill leg. 0: always disaggregate.",
    )
    decode_only_if_cached: bool = Field(
        default=_ROUTING.decode_only_if_cached,
        description="Serve decode-only a prompt whose prefix the chosen decode engine was recently sent, or, with "
        "a shared kv_tier, whose prompt the tier holds (asked of a tier engine before routing).",
    )
    decode_only_cached_fraction: float = Field(
        default=_ROUTING.decode_only_cached_fraction,
        gt=0,
        le=1,
        description="With decode_only_if_cached: the share of the prompt's prefix blocks that must have been sent "
        "(or of its tokens the shared KV tier must hold).",
    )
    tier_lookup_timeout_s: float = Field(
        default=_ROUTING.tier_lookup_timeout_s,
        gt=0,
        description="With a shared kv_tier and a routing choice it changes (decode_only_if_cached, prefix_aware): "
        "how long routing waits for a tier engine to say what the tier holds of a prompt; without an answer the "
        "request is routed as without a tier.",
    )
    prefill_retries: int = Field(
        default=_ROUTING.prefill_retries,
        ge=0,
        description="A prefill that fails (connection, timeout, 5xx) is tried on up to this many other engines.",
    )
    decode_retries: int = Field(
        default=_ROUTING.decode_retries,
        ge=0,
        description="A decode engine that cannot be reached is replaced by up to this many other decode engines "
        "(not after a timeout or a 5xx: it may have begun).",
    )
    degrade: bool = Field(
        default=_ROUTING.degrade,
        description="When no prefill engine can take a request (none ready: empty, ejected or draining), or its "
        "prefill failed on every engine tried, serve it decode-only; when no decode engine can, on a prefill engine "
        "alone. 503 only when no engine can.",
    )
    health_interval_s: float = Field(
        default=_ROUTING.health_interval_s,
        ge=0,
        description="Seconds between GET /health probes of every engine; 0 turns health checks and ejection off.",
    )
    health_timeout_s: float = Field(
        default=_ROUTING.health_timeout_s, gt=0, description="A probe (or /metrics poll) slower than this fails."
    )
    unhealthy_after: int = Field(
        default=_ROUTING.unhealthy_after,
        ge=1,
        description="Consecutive failures (probes, unreachable requests) that eject an engine from routing.",
    )
    healthy_after: int = Field(
        default=_ROUTING.healthy_after, ge=1, description="Consecutive good probes that readmit an ejected engine."
    )
    metrics_interval_s: float = Field(
        default=_ROUTING.metrics_interval_s,
        ge=0,
        description="Seconds between polls of the engines' /metrics (load-aware policies only); 0: never.",
    )

    def routing_settings(self) -> RoutingSettings:
        """The proxy's ``RoutingSettings`` (``ProxyConfig.routing``)."""
        return RoutingSettings(
            prefill_policy=self.routing.prefill,
            decode_policy=self.routing.decode,
            prefix_block_chars=self.routing.prefix_block_chars,
            prefix_max_blocks=self.routing.prefix_max_blocks,
            prefix_cache_size=self.routing.prefix_cache_size,
            prefix_overload_factor=self.routing.prefix_overload_factor,
            decode_only_below_tokens=self.decode_only_below_tokens,
            decode_only_if_cached=self.decode_only_if_cached,
            decode_only_cached_fraction=self.decode_only_cached_fraction,
            tier_lookup_timeout_s=self.tier_lookup_timeout_s,
            prefill_retries=self.prefill_retries,
            decode_retries=self.decode_retries,
            degrade=self.degrade,
            health_interval_s=self.health_interval_s,
            health_timeout_s=self.health_timeout_s,
            unhealthy_after=self.unhealthy_after,
            healthy_after=self.healthy_after,
            metrics_interval_s=self.metrics_interval_s,
        )

    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES, ge=1024, description="Longest request body the proxy reads; longer is 413."
    )
    max_concurrent_requests: int | None = Field(
        default=None, ge=1, description="Completion requests under way at once (default: no limit)."
    )
    max_queued_requests: int = Field(
        default=1024,
        ge=0,
        description="With max_concurrent_requests: how many more wait for a slot; past that, 429 with Retry-After.",
    )
    api_key_env: list[EnvName] = Field(
        default_factory=list,
        description="Names of environment variables (in the proxy's process) holding the API keys clients must "
        "send as 'Authorization: Bearer <key>'. Never the keys themselves. Empty (and no file): no key needed.",
    )
    api_key_file: str | None = Field(
        default=None, description="A file on the proxy's node with one API key per line ('#' comments)."
    )
    admin_key_env: list[EnvName] = Field(
        default_factory=list,
        description="Names of environment variables holding the admin keys of the /admin routes "
        "(none, and no file: the /admin routes do not exist).",
    )
    admin_key_file: str | None = Field(default=None, description="A file of admin keys, one per line.")
    fast_path: bool = Field(
        default=True,
        description="Serve with the routes and uvicorn protocol that lean on FastAPI/uvicorn internals (faster); "
        "false: stock FastAPI routing and uvicorn's httptools protocol (the same answers).",
    )
    forward_authorization: bool = Field(
        default=False,
        description="Not for a pdserve cluster: its engines accept only the cluster's engine key, which the "
        "proxy sends (`pdserve proxy --forward-authorization` is for engines someone else started).",
    )

    @field_validator("forward_authorization")
    @classmethod
    def _no_forwarding(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "a pdserve cluster's engines accept only the cluster's engine key, which the proxy sends; "
                "clients' keys stay at the proxy (remove this field)"
            )
        return value


class PoolSpec(_Strict):
    replicas: int = Field(default=1, ge=1, description="Number of engines in this pool.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="TP size of each engine.")
    cpu_cores: int = Field(default=1, ge=1, description="CPU cores pinned to each engine (per TP rank) on CPU.")
    port: int = Field(ge=1, le=65535, description="HTTP port of replica 0; replica i uses port+i.")
    kv_port: int = Field(ge=1, le=65535, description="KV side-channel port of replica 0; replica i uses kv_port+i.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Where this pool's engines run.")

    def ports(self, count: int | None = None) -> list[int]:
        """HTTP ports of the first ``count`` replicas (default: ``replicas``)."""
        return [self.port + i for i in range(self.replicas if count is None else count)]

    def kv_ports(self, count: int | None = None) -> list[int]:
        return [self.kv_port + i * self.tensor_parallel_size for i in range(self.replicas if count is None else count)]


class EngineSpec(_Strict):
    max_model_len: int = Field(default=4096, ge=16, description="Context length of each engine.")
    kv_cache_gib: int = Field(
        default=1, ge=1, description="KV cache size per engine in GiB on CPU (VLLM_CPU_KVCACHE_SPACE)."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="GPU engines only.")
    enforce_eager: bool = Field(default=True, description="Skip graph capture (faster start).")
    dtype: str = Field(default="auto", description="vLLM --dtype.")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="Give up on an engine after this.")
    drain_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="An engine being scaled away gets this long to finish its requests (and, prefill, to have "
        "its KV read) before it is stopped anyway.",
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM server flags, e.g. {max_num_seqs: 64} -> --max-num-seqs 64.",
    )
    env: dict[EnvName, str] = Field(
        default_factory=dict,
        description="Environment of every engine process, e.g. {UCX_TLS: tcp} or {UCX_NET_DEVICES: mlx5_0:1}.",
    )


class ResourcesSpec(_Strict):
    cpus: int | None = Field(
        default=None, ge=1, description="CPU cores pdserve may pin engines to (default: all of this machine's)."
    )
    gpus: int = Field(default=0, ge=0, description="GPUs available to engines (device: cuda).")
    share_cores: bool = Field(
        default=False,
        description="CPU engines that need more cores than resources.cpus share them, assigned in turn, "
        "instead of being refused. Slow (engines spin on their cores): for tests on small machines.",
    )


class ScalingRangeSpec(_Strict):
    min: int = Field(default=1, ge=1, description="Fewest engines the autoscaler keeps in this pool.")
    max: int = Field(ge=1, description="Most engines the autoscaler may run in this pool.")


class SloTargetsSpec(_Strict):
    ttft_p90_s: float = Field(gt=0, description="Target p90 time to first token, in seconds.")
    itl_p90_s: float = Field(gt=0, description="Target p90 inter-token latency (a request's mean gap), in seconds.")


class AutoscalingSpec(_Strict):
    """Sizes of both pools chosen from load (orchestrator.autoscale.policy); absent: fixed replicas."""

    prefill: ScalingRangeSpec = Field(description="Replica range of the prefill pool.")
    decode: ScalingRangeSpec = Field(description="Replica range of the decode pool.")
    max_engines: int = Field(ge=2, description="Engines both pools may have together (the budget).")
    targets: SloTargetsSpec = Field(description="Latency targets the autoscaler sizes the pools for.")
    profile: str | None = Field(
        default=None,
        description="Performance profile file of the engines (orchestrator.autoscale.profile); "
        "a relative path is relative to the spec file.",
    )
    interval_s: float = Field(default=30.0, gt=0, description="Seconds between two scaling decisions.")
    scale_up_cooldown_s: float = Field(
        default=0.0,
        ge=0,
        description="A pool grows again only this long after its last change (0: at the next decision; "
        "engines still starting count as provisioned, so growing again asks only for what is missing).",
    )
    scale_down_cooldown_s: float = Field(
        default=300.0,
        ge=0,
        description="A pool shrinks only this long after its last change, and never below its largest "
        "wish over this window.",
    )
    hysteresis: float = Field(
        default=0.1, ge=0, lt=1, description="A pool shrinks only to free more than this fraction of it."
    )
    burst_guard: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="A pool shrinks only to its demand plus this share of the largest rise of demand within "
        "burst_memory_s (the next burst finds that much already serving; 0: off).",
    )
    burst_memory_s: float = Field(
        default=1800.0, ge=0, description="How long a rise of demand is remembered by burst_guard."
    )
    target_utilization: float = Field(
        default=0.8, gt=0, le=1, description="Fraction of the largest ITL-safe decode batch each engine is given."
    )
    keep_warm_s: float = Field(
        default=0.0,
        ge=0,
        description="An engine the autoscaler retired stays up this long once drained, idle and out of the "
        "proxy's pool: a scale-up meanwhile takes it back at once instead of starting one (0: stopped once "
        "drained). It counts against max_engines: a scale-up that needs its room stops it.",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> AutoscalingSpec:
        for role in ROLES:
            limits = getattr(self, role)
            if limits.min > limits.max:
                raise _FieldError(f"autoscaling.{role}.min", f"min {limits.min} is above max {limits.max}")
        mins = self.prefill.min + self.decode.min
        if self.max_engines < mins:
            raise _FieldError(
                "autoscaling.max_engines",
                f"budget {self.max_engines} is below the pools' minimums together "
                f"({self.prefill.min} + {self.decode.min} = {mins})",
            )
        return self


class KvTierSpec(_Strict):
    """Prompt KV kept outside the engines' caches (``connectors.tier``): stored after prefill, looked up
    before it, reused across requests, engines and restarts. Absent: no tier."""

    pools: list[Literal["prefill", "decode"]] = Field(
        default_factory=lambda: ["prefill", "decode"],
        min_length=1,
        description="Pools whose engines store to and load from the tier.",
    )
    host_gib: float = Field(
        default=1.0, gt=0, description="Each engine's host-memory tier (the first looked up; LRU), in GiB."
    )
    node_gib: float = Field(
        default=0.0,
        ge=0,
        description="A tier in the node's shared memory (/dev/shm/pdserve-kv/<name>), shared by the node's "
        "engines, in GiB; 0: none.",
    )
    shared_gib: float = Field(
        default=8.0, ge=0, description="The tier on shared_path, shared by all engines of the cluster, in GiB; 0: none."
    )
    shared_path: str | None = Field(
        default=None,
        description="Directory every engine of the cluster reaches (a shared volume on a cluster of hosts); "
        "absolute or starting with ~. Default: ~/.cache/pdserve/kv-tier/<name> ($PDSERVE_KV_TIER_DIR/<name>).",
    )
    fsync: bool = Field(
        default=True, description="Flush each entry (and its directory) to the disk before it becomes visible."
    )
    async_lookup: bool = Field(
        default=False,
        description="Look entries up on a thread (vLLM's batched lookup; the request waits an engine step) "
        "instead of at once: for a shared_path on a network filesystem where a stat takes milliseconds.",
    )

    @field_validator("shared_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("/", "~")):
            raise ValueError(
                f"{value!r} is relative: engines start in other directories (and on other hosts), so give an "
                "absolute path or one starting with ~"
            )
        return value


class ClusterSpec(_Strict):
    name: str = Field(default="pdserve", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: str = Field(description="Known model name, a model directory, or a Hugging Face id.")
    served_model_name: str | None = Field(
        default=None, description="Name clients use in 'model' (default: the spec's model)."
    )
    device: Literal["cpu", "cuda"] = "cpu"
    connector: Literal["vllm-nixl", "pdserve"] = Field(
        default="pdserve",
        description="KV connector between prefill and decode engines: our own pull-mode connector "
        "('pdserve', connectors.vllm_connector; the default) or vLLM's NixlConnector ('vllm-nixl').",
    )
    connector_options: ConnectorOptions | None = Field(
        default=None, description="Settings of connector 'pdserve' (lease TTL, timeouts, fault injection)."
    )
    ray: RaySpec = Field(default_factory=RaySpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    prefill: PoolSpec
    decode: PoolSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Grow and shrink the pools from load; the pools' replicas are then the starting sizes.",
    )
    kv_tier: KvTierSpec | None = Field(
        default=None, description="A KV tier shared by the cluster's engines (connector 'pdserve'); absent: none."
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    def max_replicas(self, role: str) -> int:
        """The most engines pool ``role`` may grow to (``pdserve scale``, the autoscaler): ports, cores
        and GPUs are planned and checked for this many. ``autoscaling.<role>.max``, else ``replicas``."""
        if self.autoscaling is not None:
            return getattr(self.autoscaling, role).max
        return self.pool(role).replicas

    def min_replicas(self, role: str) -> int:
        """The fewest engines pool ``role`` may shrink to: ``autoscaling.<role>.min``, else 1."""
        return getattr(self.autoscaling, role).min if self.autoscaling is not None else 1

    def proxy_config(self) -> ProxyConfig:
        """The settings of the cluster's proxy; it refuses what cannot fit ``engine.max_model_len``."""
        proxy = self.proxy
        return ProxyConfig(
            model_name=self.model_name,
            request_timeout_s=proxy.request_timeout_s,
            connect_timeout_s=proxy.connect_timeout_s,
            routing=dataclasses.replace(proxy.routing_settings(), tier_pools=self.shared_tier_pools),
            max_body_bytes=proxy.max_body_bytes,
            max_concurrent_requests=proxy.max_concurrent_requests,
            max_queued_requests=proxy.max_queued_requests,
            max_model_len=self.engine.max_model_len,
            api_key_env=tuple(proxy.api_key_env),
            api_key_file=proxy.api_key_file,
            admin_key_env=tuple(proxy.admin_key_env),
            admin_key_file=proxy.admin_key_file,
            engine_auth=True,
            bind_reader=self.connector == "pdserve",
            fast_path=proxy.fast_path,
        )

    @model_validator(mode="after")
    def _check_model(self) -> ClusterSpec:
        looks_like_path = self.model.startswith((".", "/", "~"))
        if looks_like_path and not Path(self.model).expanduser().is_dir():
            raise _FieldError("model", f"model directory {self.model!r} does not exist")
        if self.model in KNOWN_MODELS and not Path(resolve_model(self.model)).is_dir():
            raise _FieldError(
                "model",
                f"{self.model!r} is not prepared in {model_cache_dir()}; run `make setup` "
                "(or `python scripts/prepare_model.py`)",
            )
        return self

    @property
    def pdserve_connector(self) -> ConnectorOptions:
        return self.connector_options or ConnectorOptions()

    @model_validator(mode="after")
    def _check_connector_options(self) -> ClusterSpec:
        if self.connector_options is not None and self.connector != "pdserve":
            raise _FieldError(
                "connector_options", f"these settings are for connector 'pdserve', not {self.connector!r}"
            )
        return self

    @model_validator(mode="after")
    def _check_kv_tier(self) -> ClusterSpec:
        if self.kv_tier is not None and self.connector != "pdserve":
            raise _FieldError("kv_tier", f"the KV tier runs beside connector 'pdserve', not {self.connector!r}")
        return self

    @property
    def shared_tier_pools(self) -> tuple[str, ...]:
        """The pools whose engines share a KV tier directory (the proxy's routing counts on it), or ()."""
        tier = self.kv_tier
        return tuple(tier.pools) if tier is not None and tier.shared_gib > 0 else ()

    def kv_tier_paths(self) -> tuple[Path | None, Path | None]:
        """(the node tier's directory, the shared tier's directory); None for a tier that is off."""
        tier = self.kv_tier
        if tier is None:
            return None, None
        node = Path("/dev/shm/pdserve-kv") / self.name if tier.node_gib > 0 else None
        shared = None
        if tier.shared_gib > 0:
            default = pdserve_dir("kv-tier", "PDSERVE_KV_TIER_DIR") / self.name
            shared = Path(tier.shared_path).expanduser() if tier.shared_path else default
        return node, shared

    @model_validator(mode="after")
    def _check_ports(self) -> ClusterSpec:
        owners: dict[int, str] = {self.proxy.port: "proxy.port"}
        for role in ROLES:
            pool = self.pool(role)
            count = self.max_replicas(role)
            kv_span = [p + r for p in pool.kv_ports(count) for r in range(pool.tensor_parallel_size)]
            for field, ports in ((f"{role}.port", pool.ports(count)), (f"{role}.kv_port", kv_span)):
                for port in ports:
                    if port > 65535:
                        raise _FieldError(field, f"port {port} of its replicas is above 65535")
                    if port in owners:
                        raise _FieldError(field, f"port {port} is also used by {owners[port]}")
                    owners[port] = field
        return self

    @property
    def cpu_cores_available(self) -> int:
        """Cores CPU engines may be pinned to: ``resources.cpus``, else all of this machine's."""
        return self.resources.cpus or os.cpu_count() or 1

    @property
    def cpu_cores_needed(self) -> int:
        """Cores the CPU engines are pinned to at most on one host: replicas x TP x cores per rank of the pools
        that may share hosts, after their ``first_core`` (with autoscaling, of the largest split its ranges
        and budget allow)."""
        needed = 0
        for roles in self.placement_domains().values():
            per_engine = {
                r: self.pool(r).tensor_parallel_size * self.pool(r).cpu_cores if r in roles else 0 for r in ROLES
            }
            first = min(self.pool(r).placement.first_core for r in roles)
            needed = max(needed, first + self.most_at_once(per_engine))
        return needed

    def placement_domains(self) -> dict[tuple, tuple[str, ...]]:
        """Pools grouped by where they may run: pools of one group may share hosts (and a core plan)."""
        domains: dict[tuple, tuple[str, ...]] = {}
        for role in ROLES:
            key = self.pool(role).placement.key
            domains[key] = (*domains.get(key, ()), role)
        return domains

    def most_at_once(self, per_engine: dict[str, int]) -> int:
        """The most of a resource (``per_engine[role]`` each) the engines can hold at once."""
        if self.autoscaling is None:
            return sum(self.pool(r).replicas * per_engine[r] for r in ROLES)
        scaling = self.autoscaling
        return max(
            p * per_engine["prefill"] + min(scaling.decode.max, scaling.max_engines - p) * per_engine["decode"]
            for p in range(scaling.prefill.min, min(scaling.prefill.max, scaling.max_engines - scaling.decode.min) + 1)
        )

    @model_validator(mode="after")
    def _check_resources(self) -> ClusterSpec:
        if self.device == "cpu":
            available = self.cpu_cores_available
            needed = self.cpu_cores_needed
            if needed > available and not self.resources.share_cores:
                raise _FieldError(
                    "resources.cpus",
                    f"engines need {needed} CPU cores on one host (first_core + replicas x tensor_parallel_size x "
                    f"cpu_cores of the pools that share hosts) but only {available} are available (resources.cpus; "
                    "resources.share_cores lets them share)",
                )
        else:
            for role in ROLES:
                tp = self.pool(role).tensor_parallel_size
                if tp > self.resources.gpus:
                    raise _FieldError(
                        f"{role}.tensor_parallel_size",
                        f"TP size {tp} needs {tp} GPUs per engine but resources.gpus is {self.resources.gpus}",
                    )
            # Each engine asks Ray for tensor_parallel_size whole GPUs, and the Ray head is
            # started with resources.gpus of them: engines beyond that would wait forever.
            needed = self.most_at_once({r: self.pool(r).tensor_parallel_size for r in ROLES})
            if needed > self.resources.gpus and self.autoscaling is not None:
                raise _FieldError(
                    "autoscaling.max_engines",
                    f"the autoscaler may run engines that need {needed} GPUs but resources.gpus is "
                    f"{self.resources.gpus}",
                )
            if needed > self.resources.gpus:
                raise _FieldError(
                    "resources.gpus",
                    f"engines need {needed} GPUs (replicas x tensor_parallel_size, both pools) "
                    f"but resources.gpus is {self.resources.gpus}",
                )
        return self

    @model_validator(mode="after")
    def _check_autoscaling(self) -> ClusterSpec:
        scaling = self.autoscaling
        if scaling is None:
            return self
        for role in ROLES:
            limits, replicas = getattr(scaling, role), self.pool(role).replicas
            if not limits.min <= replicas <= limits.max:
                raise _FieldError(
                    f"{role}.replicas",
                    f"{replicas} is outside autoscaling.{role}'s range {limits.min}..{limits.max}",
                )
        if self.prefill.replicas + self.decode.replicas > scaling.max_engines:
            raise _FieldError(
                "autoscaling.max_engines",
                f"the starting replicas ({self.prefill.replicas} + {self.decode.replicas}) exceed the budget "
                f"{scaling.max_engines}",
            )
        return self

    def profile_path(self, spec_file: str | os.PathLike[str] | None = None) -> Path | None:
        """The autoscaling profile's path; a relative one is taken from ``spec_file``'s directory."""
        if self.autoscaling is None or self.autoscaling.profile is None:
            return None
        path = Path(self.autoscaling.profile).expanduser()
        if not path.is_absolute() and spec_file is not None:
            path = Path(spec_file).parent / path
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise SpecError(str(path), "", f"cannot read file: {e.strerror}") from e
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(str(path), "", f"not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise SpecError(str(path), "", "the spec must be a YAML mapping")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<spec>") -> ClusterSpec:
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise _spec_error(source, e) from e


class _FieldError(ValueError):
    """Raised inside a model validator to blame one field (turned into SpecError)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _spec_error(source: str, error: ValidationError) -> SpecError:
    problems = []
    for item in error.errors():
        ctx_error = (item.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _FieldError):
            problems.append((ctx_error.field, ctx_error.reason))
            continue
        field = ".".join(str(part) for part in item["loc"])
        reason = item["msg"]
        if item["type"] == "extra_forbidden":
            reason = "unknown key"
        elif item["type"] == "missing":
            reason = "required field is missing"
        elif "input" in item and item["type"] not in ("model_type", "dict_type"):
            reason = f"{reason} (got {item['input']!r})"
        problems.append((field, reason))
    field, reason = problems[0]
    return SpecError(source, field, reason, more=problems[1:])
