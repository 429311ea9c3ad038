"""The cluster spec: one YAML file that describes a pdserve cluster.

``ClusterSpec.from_file(path)`` reads and validates the YAML. Every problem is
reported at load time as a ``SpecError`` that names the file, the field (as a
dotted path, e.g. ``prefill.replicas``) and the reason; nothing half-valid
reaches the orchestrator.

``ClusterSpec`` is the document's top level: its fields, the checks that span
them (ports apart, resources enough, a model that is there), and what the rest
of the orchestrator derives from it (engine ids, the proxy's settings, the KV
tier's directories, the pools' limits). Its sections are ``orchestrator.spec_sections``;
a cluster of several models and the one-model view of each, ``orchestrator.spec_views``.

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
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from connectors.options import ConnectorOptions
from contract.wire import ROLES
from orchestrator import placement
from orchestrator.autoscale.config import AutoscalingConfig
from orchestrator.errors import FieldError, PdserveError, SpecError, read_mapping
from orchestrator.models import KNOWN_MODELS, model_cache_dir, resolve_model
from orchestrator.paths import pdserve_dir
from orchestrator.spec_sections import (
    EngineSpec,
    KvTierSpec,
    NetworkSpec,
    PoolSpec,
    ProxySpec,
    RaySpec,
    ResourcesSpec,
    SpecModel,
)
from orchestrator.spec_views import ModelSpec, build_views, check_entries, check_views
from proxy.config import ProxyConfig

__all__ = ["CONNECTORS", "VLLM_CPU_MAX_NUM_SEQS", "ClusterSpec"]

CONNECTORS = ("vllm-nixl", "pdserve")
"""The KV connectors a spec may name (``connector``)."""

VLLM_CPU_MAX_NUM_SEQS = 128
"""vLLM's --max-num-seqs default for its OpenAI server on CPU, per TP rank (``EngineArgs``' CPU defaults)."""


class ClusterSpec(SpecModel):
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
    connector: Literal[CONNECTORS] = Field(  # type: ignore[valid-type]
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
        check_entries(self)
        self._views = build_views(self)
        check_views(self)
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
