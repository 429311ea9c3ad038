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

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from connectors.options import ConnectorOptions
from contract.wire import ROLES
from orchestrator import placement
from orchestrator.autoscale.config import AutoscalingConfig
from orchestrator.errors import FieldError, PdserveError, SpecError, read_mapping
from orchestrator.models import KNOWN_MODELS, model_cache_dir, resolve_model
from orchestrator.paths import pdserve_dir
from proxy.config import EnvName, ProxyConfig, ProxySettings, RoutingConfig

# Connector names a spec may use, mapped to the vLLM kv_transfer_config they need.
CONNECTORS = ("vllm-nixl", "pdserve")

VLLM_CPU_MAX_NUM_SEQS = 128
"""vLLM's --max-num-seqs default for its OpenAI server on CPU, per TP rank (``EngineArgs``' CPU defaults)."""


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
AdapterName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.:/]{0,127}$")]
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


class PoolSpec(_Strict):
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


MODEL_KEY = r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"
MODEL_FIELDS = ("model", "served_model_name", "prefill", "decode", "engine", "autoscaling")
"""What each entry of ``models`` sets for its model, and a one-model spec at its top level."""


class ModelSpec(_Strict):
    """One model of a cluster that serves several (``models``): its own pools, engine settings, routing and
    autoscaling. The proxy sends a request to the pools of the model (or adapter) it names."""

    key: str | None = Field(
        default=None,
        pattern=MODEL_KEY,
        description="A short name for the model's engines: their ids (KEY-prefill-0), Ray actors and logs; "
        "`pdserve scale --model` takes it or the served name. Default: from the served name "
        "(lowercase letters, digits and '-').",
    )
    model: str = Field(description="Known model name, a model directory, or a Hugging Face id.")
    served_model_name: str | None = Field(
        default=None, description="Name clients use in 'model' (default: this entry's model)."
    )
    prefill: PoolSpec = Field(description="This model's prefill pool.")
    decode: PoolSpec = Field(description="This model's decode pool.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Settings of this model's engines.")
    autoscaling: AutoscalingConfig | None = Field(
        default=None, description="Grow and shrink this model's pools from its load (its own budget)."
    )
    routing: RoutingConfig | None = Field(
        default=None, description="The routing policy of this model's pools (default: proxy.routing)."
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def engine_key(self) -> str:
        """``key``, else the served name made into one (``MODEL_KEY``)."""
        if self.key is not None:
            return self.key
        made = re.sub(r"[^a-z0-9]+", "-", self.model_name.rsplit("/", 1)[-1].lower()).strip("-")[:32].strip("-")
        return made or "model"


class ClusterSpec(_Strict):
    name: str = Field(
        default="pdserve",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="The cluster's name: its Ray actors, state directory and KV tier directories carry it.",
    )
    model: str | None = Field(
        default=None,
        description="Known model name, a model directory, or a Hugging Face id (a cluster of one model; several: "
        "`models`).",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients use in 'model' (default: the spec's model)."
    )
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="Where the engines run: CPU cores or GPUs.")
    connector: Literal["vllm-nixl", "pdserve"] = Field(
        default="pdserve",
        description="KV connector between prefill and decode engines: our own pull-mode connector "
        "('pdserve', connectors.vllm_connector; the default) or vLLM's NixlConnector ('vllm-nixl').",
    )
    connector_options: ConnectorOptions | None = Field(
        default=None, description="Settings of connector 'pdserve' (lease TTL, timeouts, fault injection)."
    )
    ray: RaySpec = Field(default_factory=RaySpec, description="The Ray cluster the engines run on.")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="The addresses engines advertise.")
    proxy: ProxySpec = Field(default_factory=ProxySpec, description="The OpenAI-compatible proxy.")
    prefill: PoolSpec | None = Field(default=None, description="The prefill pool: engines that compute prompts' KV.")
    decode: PoolSpec | None = Field(
        default=None, description="The decode pool: engines that read that KV and generate."
    )
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Settings of every engine, both pools.")
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="What the engines may use of the machine or cluster."
    )
    autoscaling: AutoscalingConfig | None = Field(
        default=None,
        description="Grow and shrink the pools from load; the pools' replicas are then the starting sizes.",
    )
    kv_tier: KvTierSpec | None = Field(
        default=None, description="A KV tier shared by the cluster's engines (connector 'pdserve'); absent: none."
    )
    role_moves: bool = Field(
        default=True,
        description="Ready engines may change pool (prefill <-> decode) without a restart: `pdserve scale --move` "
        "and the autoscaler's changes of the P:D ratio. Only pools of one shape move (same TP size, cores, "
        "node selector and KV tier); false: engines never move.",
    )
    models: list[ModelSpec] | None = Field(
        default=None,
        min_length=1,
        description="A cluster that serves several models: each entry sets what a one-model spec sets at its top "
        "level (model, served_model_name, prefill, decode, engine, autoscaling; and routing), and those keys are "
        "then left out there. One proxy serves them all, routing each request by its 'model'; KV moves only "
        "between engines of one model. On CPU each model's cores follow the previous model's.",
    )

    _key: str = PrivateAttr(default="")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model or ", ".join(v.model_name for v in self.views())

    @property
    def key(self) -> str:
        """The model's ``ModelSpec.engine_key`` in a view of a cluster of several models; "" otherwise."""
        return self._key

    def engine_id(self, role: str, replica: int) -> str:
        """The id of replica ``replica`` of pool ``role``: ``prefill-0``, or ``KEY-prefill-0`` in a view."""
        return f"{self._key}-{role}-{replica}" if self._key else f"{role}-{replica}"

    def pool(self, role: str) -> PoolSpec:
        pool = self.prefill if role == "prefill" else self.decode
        if pool is None:
            raise ValueError(f"a spec of several models has no {role} pool of its own: take one of views()")
        return pool

    def views(self) -> list[ClusterSpec]:
        """One spec per model, each as a one-model spec would be (its pools, engine settings, autoscaling; its
        routing as ``proxy.routing``) with the cluster's shared settings; ``[self]`` for a one-model spec. On
        CPU, a model's pools start at the cores after the previous model's (per placement), so that their
        engines do not share cores. Built once, when the spec is validated."""
        return self._views if self.models else [self]

    _views: list[ClusterSpec] = PrivateAttr(default_factory=list)

    def view(self, model: str | None) -> ClusterSpec:
        """The view of ``model`` (its served name or key; None: the one model); ``PdserveError`` naming the
        models otherwise."""
        views = self.views()
        if model is None and len(views) == 1:
            return views[0]
        for view in views:
            if model in (view.model_name, view.key):
                return view
        names = ", ".join(v.model_name for v in views)
        raise PdserveError(
            f"name the model (--model): one of {names}" if model is None else f"no model {model!r}: {names}"
        )

    def _build_views(self) -> None:
        shared = {f: getattr(self, f) for f in type(self).model_fields if f not in (*MODEL_FIELDS, "models")}
        offsets: dict[tuple, int] = {}  # per placement: the first core not taken by the models before
        views = []
        for index, entry in enumerate(self.models or ()):
            pools = {}
            for role in ROLES:
                pool: PoolSpec = getattr(entry, role)
                if self.device == "cpu":
                    first = pool.placement.first_core + offsets.get(pool.placement.key, 0)
                    moved = pool.placement.model_copy(update={"first_core": first})
                    pool = pool.model_copy(update={"placement": moved})
                pools[role] = pool
            proxy = self.proxy if entry.routing is None else self.proxy.model_copy(update={"routing": entry.routing})
            data = {**shared, **{f: getattr(entry, f) for f in MODEL_FIELDS}, **pools, "proxy": proxy}
            try:
                view = ClusterSpec.model_validate(data)
            except ValidationError as e:
                problem = SpecError.of("", e)
                field, reason = problem.field, problem.reason
                if field.split(".")[0] in (*MODEL_FIELDS, "routing"):
                    field = f"models.{index}.{field}"
                elif field == "proxy.routing" or field.startswith("proxy.routing."):
                    field = f"models.{index}.routing" + field[len("proxy.routing") :]
                raise FieldError(field, reason) from None
            view._key = entry.engine_key
            if self.device == "cpu":
                for key, needed in placement.domain_cores_needed(view).items():
                    offsets[key] = needed
            views.append(view)
        self._views = views

    @model_validator(mode="after")
    def _check_models(self) -> ClusterSpec:
        if self.models is None:
            for role in ROLES:
                if getattr(self, role) is None:
                    raise FieldError(role, "required field is missing (or list the cluster's `models`)")
            if self.model is None:
                raise FieldError("model", "required field is missing (or list the cluster's `models`)")
            if self.model_name in self.engine.lora_adapters:
                raise FieldError("engine.lora_adapters", f"{self.model_name!r} names the model itself")
            return self
        fields = type(self).model_fields
        given = [f for f in MODEL_FIELDS if getattr(self, f) != fields[f].get_default(call_default_factory=True)]
        if given:
            raise FieldError(given[0], "a spec of several models sets it per model, in each entry of `models`")
        keys: dict[str, int] = {}
        names: dict[str, int] = {}
        for index, entry in enumerate(self.models):
            for seen, value, what in ((keys, entry.engine_key, "key"), (names, entry.model_name, "served name")):
                if value in seen:
                    raise FieldError(
                        f"models.{index}",
                        f"its {what} {value!r} is also models.{seen[value]}'s (set `key` or `served_model_name` apart)",
                    )
                seen[value] = index
        # A request's model picks its pools by name (the proxy's one map of served names and adapters): a name
        # taken twice, whichever entry lists it first, would send one model's requests to another's engines.
        adapters: dict[str, int] = {}
        for index, entry in enumerate(self.models):
            for adapter in entry.engine.lora_adapters:
                if adapter in names and names[adapter] == index:
                    reason = f"{adapter!r} names the model itself"
                elif adapter in names:
                    reason = f"{adapter!r} names another model too: models.{names[adapter]}'s served name"
                elif adapter in adapters:
                    reason = f"{adapter!r} names another model too: an adapter of models.{adapters[adapter]}"
                else:
                    adapters[adapter] = index
                    continue
                raise FieldError(f"models.{index}.engine.lora_adapters", reason)
        self._build_views()
        owners: dict[int, str] = {self.proxy.port: "proxy.port"}
        for index, view in enumerate(self._views):
            for field, ports in view.ports_used():
                for port in ports:
                    if port in owners and owners[port] != "proxy.port":
                        raise FieldError(f"models.{index}.{field}", f"port {port} is also used by {owners[port]}")
                    owners[port] = f"models.{index}.{field}"
        if problem := placement.cluster_resource_problem(self):
            raise FieldError(*problem)
        return self

    def max_replicas(self, role: str) -> int:
        """The most engines pool ``role`` may grow to (``pdserve scale``, the autoscaler): ports, cores
        and GPUs are planned and checked for this many. ``autoscaling.<role>.max``, else ``replicas``."""
        if self.autoscaling is not None:
            return getattr(self.autoscaling, role).max
        return self.pool(role).replicas

    def min_replicas(self, role: str) -> int:
        """The fewest engines pool ``role`` may shrink to: ``autoscaling.<role>.min``, else 1."""
        return getattr(self.autoscaling, role).min if self.autoscaling is not None else 1

    def move_problem(self) -> str | None:
        """Why engines may not move between the pools (``role_moves``); None when they may."""
        if not self.role_moves:
            return "the spec forbids it (role_moves: false)"
        prefill, decode = self.prefill, self.decode
        differ = [f for f in ("tensor_parallel_size", "cpu_cores") if getattr(prefill, f) != getattr(decode, f)]
        if prefill.placement.key != decode.placement.key or prefill.placement.strategy != decode.placement.strategy:
            differ.append("placement")
        if self.kv_tier is not None and len(set(self.kv_tier.pools)) == 1:
            differ.append("kv_tier.pools")
        return f"the pools differ in shape ({', '.join(differ)})" if differ else None

    def proxy_config(self) -> ProxyConfig:
        """The settings of the cluster's proxy; it refuses what cannot fit ``engine.max_model_len``, and admits
        as many requests as its ready engines run (``proxy.requests_per_engine``, else ``engine_max_num_seqs``)."""
        return ProxyConfig.of(
            self.proxy,
            model_name=self.model_name,
            adapters=tuple(self.engine.lora_adapters),
            max_loras=self.engine.max_loras,
            max_model_len=self.engine.max_model_len,
            tier_pools=self.shared_tier_pools,
            engine_auth=True,
            bind_reader=self.connector == "pdserve",
            requests_per_engine=self.proxy.requests_per_engine or self.engine_max_num_seqs(),
        )

    def proxy_configs(self) -> list[ProxyConfig]:
        """``proxy_config`` of each model (``views``): what the cluster's one proxy serves."""
        return [view.proxy_config() for view in self.views()]

    def engine_max_num_seqs(self) -> int | None:
        """How many requests one engine runs at once (vLLM's --max-num-seqs), as far as the spec tells:
        ``engine.extra_args``, else vLLM's CPU default (per TP rank, of the pool with more ranks) on CPU. None on
        GPUs, where vLLM's default depends on the GPU's memory (the proxy then takes the largest)."""
        extra = self.engine.extra_args
        value = str(extra.get("max_num_seqs", extra.get("max-num-seqs")))
        if value.isdigit() and int(value) >= 1:  # (a flag vLLM will refuse, e.g. false: left to vLLM)
            return int(value)
        if self.device == "cpu":
            return VLLM_CPU_MAX_NUM_SEQS * max(self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size)
        return None

    @model_validator(mode="after")
    def _check_model(self) -> ClusterSpec:
        if self.models is not None:  # each model's view is checked (``_check_models``)
            return self
        looks_like_path = self.model.startswith((".", "/", "~"))
        if looks_like_path and not Path(self.model).expanduser().is_dir():
            raise FieldError("model", f"model directory {self.model!r} does not exist")
        if self.model in KNOWN_MODELS and not Path(resolve_model(self.model)).is_dir():
            raise FieldError(
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
            raise FieldError("connector_options", f"these settings are for connector 'pdserve', not {self.connector!r}")
        return self

    @model_validator(mode="after")
    def _check_kv_tier(self) -> ClusterSpec:
        if self.kv_tier is not None and self.connector != "pdserve":
            raise FieldError("kv_tier", f"the KV tier runs beside connector 'pdserve', not {self.connector!r}")
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
        # Each model of a cluster of several has a directory of its own: the tier names entries by block hashes.
        model = (self._key,) if self._key else ()
        node = Path("/dev/shm/pdserve-kv", self.name, *model) if tier.node_gib > 0 else None
        shared = None
        if tier.shared_gib > 0:
            default = pdserve_dir("kv-tier", "PDSERVE_KV_TIER_DIR") / self.name
            shared = Path(tier.shared_path).expanduser() if tier.shared_path else default
            shared = shared.joinpath(*model)
        return node, shared

    def ports_used(self) -> list[tuple[str, list[int]]]:
        """(field, its ports) of each pool's HTTP and side-channel ports, for every replica it may grow to."""
        used = []
        for role in ROLES:
            pool = self.pool(role)
            count = self.max_replicas(role)
            kv_span = [p + r for p in pool.kv_ports(count) for r in range(pool.tensor_parallel_size)]
            used += [(f"{role}.port", pool.ports(count)), (f"{role}.kv_port", kv_span)]
        return used

    @model_validator(mode="after")
    def _check_ports(self) -> ClusterSpec:
        if self.models is not None:  # each model's view is checked (``_check_models``)
            return self
        owners: dict[int, str] = {self.proxy.port: "proxy.port"}
        for field, ports in self.ports_used():
            for port in ports:
                if port > 65535:
                    raise FieldError(field, f"port {port} of its replicas is above 65535")
                if port in owners:
                    raise FieldError(field, f"port {port} is also used by {owners[port]}")
                owners[port] = field
        return self

    @model_validator(mode="after")
    def _check_resources(self) -> ClusterSpec:
        if self.models is not None:  # each model's view is checked (``_check_models``)
            return self
        if problem := placement.resource_problem(self):
            raise FieldError(*problem)
        return self

    @model_validator(mode="after")
    def _check_autoscaling(self) -> ClusterSpec:
        if self.models is not None:  # each model's view is checked (``_check_models``)
            return self
        scaling = self.autoscaling
        if scaling is None:
            return self
        for role in ROLES:
            limits, replicas = getattr(scaling, role), self.pool(role).replicas
            if not limits.min <= replicas <= limits.max:
                raise FieldError(
                    f"{role}.replicas",
                    f"{replicas} is outside autoscaling.{role}'s range {limits.min}..{limits.max}",
                )
        if self.prefill.replicas + self.decode.replicas > scaling.max_engines:
            raise FieldError(
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
        return cls.from_dict(read_mapping(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<spec>") -> ClusterSpec:
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise SpecError.of(source, e) from e
