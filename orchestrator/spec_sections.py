"""The sections of a cluster spec: where engines run, the pools, the engines' settings, the KV tier.

Each section is a pydantic model that refuses unknown keys and is frozen once loaded; ``orchestrator.spec``
puts them together as ``ClusterSpec`` (and ``orchestrator.spec_views`` as each entry of ``models``), and
the configuration reference (``orchestrator.reference``) is written from their fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.config import EnvName, ProxySettings

__all__ = [
    "EngineSpec",
    "KvTierSpec",
    "NetworkSpec",
    "NodeSelectorSpec",
    "PlacementSpec",
    "PoolSpec",
    "ProxySpec",
    "RaySpec",
    "ResourcesSpec",
    "SpecModel",
]


class SpecModel(BaseModel):
    """A cluster spec or a part of it: unknown keys are refused (a typo fails at load time), and it is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RaySpec(SpecModel):
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
AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.:/]{0,127}$")]
"""A LoRA adapter's name, as clients put it in a request's ``model``."""
PG_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


class NodeSelectorSpec(SpecModel):
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


class NetworkSpec(SpecModel):
    interface: str | None = Field(
        default=None,
        description="Engines advertise this network interface's IPv4 address to their peers (default: their "
        "Ray node IP).",
    )
    listen_all: bool = Field(
        default=False,
        description="Engines' HTTP servers bind 0.0.0.0 instead of the address they advertise.",
    )


class ProxySpec(ProxySettings):
    """The cluster's proxy: its settings (``proxy.config``) and where it runs."""

    placement: NodeSelectorSpec | None = Field(
        default=None,
        description="Where the proxy and the controller run (default: the Ray head node).",
    )

    @field_validator("port")
    @classmethod
    def _fixed_port(cls, value: int) -> int:
        if value == 0:
            raise ValueError("a cluster's proxy needs a fixed port (clients and `pdserve status` name it)")
        return value

    @field_validator("forward_authorization")
    @classmethod
    def _no_forwarding(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "a pdserve cluster's engines accept only the cluster's engine key, which the proxy sends; "
                "clients' keys stay at the proxy (remove this field)"
            )
        return value


class PoolSpec(SpecModel):
    replicas: int = Field(default=1, ge=1, description="Number of engines in this pool.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="TP size of each engine.")
    cpu_cores: int = Field(
        default=1,
        ge=1,
        description="CPU cores pinned to each engine (per TP rank) on CPU, from the start of its start-up: a start "
        "under load leaves the other engines' cores to them.",
    )
    port: int = Field(ge=1, le=65535, description="HTTP port of replica 0; replica i uses port+i.")
    kv_port: int = Field(ge=1, le=65535, description="KV side-channel port of replica 0; replica i uses kv_port+i.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Where this pool's engines run.")

    def ports(self, count: int | None = None) -> list[int]:
        """HTTP ports of the first ``count`` replicas (default: ``replicas``)."""
        return [self.port + i for i in range(self.replicas if count is None else count)]

    def kv_ports(self, count: int | None = None) -> list[int]:
        return [self.kv_port + i * self.tensor_parallel_size for i in range(self.replicas if count is None else count)]


class EngineSpec(SpecModel):
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
    tool_call_parser: str | None = Field(
        default=None,
        min_length=1,
        description="vLLM's tool-call parser for the model (e.g. hermes, llama3_json, mistral, qwen3_xml): both "
        "pools get --enable-auto-tool-choice --tool-call-parser, which every tool_choice but none needs (auto, "
        "required, a named function). Unset: requests with tools are refused by the engines (400).",
    )
    chat_template: str | None = Field(
        default=None,
        min_length=1,
        description="A chat template for both pools where the model's own does not render tools (vLLM "
        "--chat-template): a file on every engine host, or the template itself.",
    )
    lora_adapters: dict[AdapterName, str] = Field(
        default_factory=dict,
        description="LoRA adapters both pools load at start: name -> its directory (PEFT format) on every engine "
        "host. A request whose model is an adapter's name is prefilled and decoded with it; /v1/models lists them. "
        "An adapter's name is no model's served name and no other adapter's, in the whole spec.",
    )
    max_loras: int = Field(
        default=1,
        ge=1,
        description="Adapters an engine applies at once (vLLM --max-loras); with fewer than lora_adapters, the proxy "
        "keeps each adapter's requests on the same engines of a pool.",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, description="The largest rank of lora_adapters (vLLM --max-lora-rank)."
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Further vLLM server flags, e.g. {max_num_seqs: 64} -> --max-num-seqs 64, false -> --no-..., "
        "null -> left out.",
    )
    env: dict[EnvName, str] = Field(
        default_factory=dict,
        description="Environment of every engine process, e.g. {UCX_TLS: tcp} or {UCX_NET_DEVICES: mlx5_0:1}; "
        "pdserve's own settings (core binding, KV cache size) win. On CPU, PDSERVE_FORK_WORKERS: '0' makes "
        "vLLM's engine core spawn its worker instead of forking it, and with connector vllm-nixl "
        "PDSERVE_CALM_NIXL: '0' leaves vLLM's NIXL progress thread spinning (connectors.vllm_plugin). With "
        "enforce_eager, TORCHDYNAMO_DISABLE: '0' lets vLLM torch.compile its sampler helpers (an engine's first "
        "logprobs request then compiles for seconds).",
    )


class ResourcesSpec(SpecModel):
    cpus: int | None = Field(
        default=None, ge=1, description="CPU cores pdserve may pin engines to (default: all of this machine's)."
    )
    gpus: int = Field(default=0, ge=0, description="GPUs available to engines (device: cuda).")
    share_cores: bool = Field(
        default=False,
        description="CPU engines that need more cores than resources.cpus share them, assigned in turn, "
        "instead of being refused. Slow (engines spin on their cores): for tests on small machines.",
    )


class KvTierSpec(SpecModel):
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
