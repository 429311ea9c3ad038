"""A cluster that serves several models: its entries (``models``) and the one-model view of each.

A spec of several models lists, in ``models``, what a one-model spec sets at its top level (``MODEL_FIELDS``,
and routing). ``ClusterSpec`` validates such a spec in three steps, each here: ``check_entries`` (nothing of
a model at the top level; served names, keys and adapters each name one model), ``build_views`` (each entry
with the cluster's shared settings, as the ``ClusterSpec`` of one model, which validates it), and
``check_views`` (the views' ports apart, the cluster's resources enough for them all). Every later step of the
orchestrator takes a model's view and reads it as a one-model spec.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pydantic import Field, ValidationError

from contract.wire import ROLES
from orchestrator import placement
from orchestrator.autoscale.config import AutoscalingConfig
from orchestrator.errors import FieldError, SpecError
from orchestrator.spec_sections import EngineSpec, PoolSpec, SpecModel
from proxy.config import RoutingConfig

if TYPE_CHECKING:
    from orchestrator.spec import ClusterSpec

__all__ = ["MODEL_FIELDS", "MODEL_KEY", "ModelSpec", "build_views", "check_entries", "check_views"]

MODEL_KEY = r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"
MODEL_FIELDS = ("model", "served_model_name", "prefill", "decode", "engine", "autoscaling")
"""What each entry of ``models`` sets for its model, and a one-model spec at its top level."""


class ModelSpec(SpecModel):
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


def check_entries(spec: ClusterSpec) -> None:
    """``FieldError`` where a model's field is set at the top level, or a served name, key or adapter name
    is taken by two entries."""
    fields = type(spec).model_fields
    given = [f for f in MODEL_FIELDS if getattr(spec, f) != fields[f].get_default(call_default_factory=True)]
    if given:
        raise FieldError(given[0], "a spec of several models sets it per model, in each entry of `models`")
    keys: dict[str, int] = {}
    names: dict[str, int] = {}
    for index, entry in enumerate(spec.models or ()):
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
    for index, entry in enumerate(spec.models or ()):
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


def build_views(spec: ClusterSpec) -> list[ClusterSpec]:
    """Each entry of ``spec.models`` as the one-model spec it stands for: its fields and routing with the
    cluster's shared settings, validated as a ``ClusterSpec`` (a problem is a ``FieldError`` naming the
    entry's field). On CPU, a model's pools start at the cores after the previous model's (per placement)."""
    shared = {f: getattr(spec, f) for f in type(spec).model_fields if f not in (*MODEL_FIELDS, "models")}
    offsets: dict[tuple, int] = {}  # per placement: the first core not taken by the models before
    views = []
    for index, entry in enumerate(spec.models or ()):
        pools = {}
        for role in ROLES:
            pool: PoolSpec = getattr(entry, role)
            if spec.device == "cpu":
                first = pool.placement.first_core + offsets.get(pool.placement.key, 0)
                moved = pool.placement.model_copy(update={"first_core": first})
                pool = pool.model_copy(update={"placement": moved})
            pools[role] = pool
        proxy = spec.proxy if entry.routing is None else spec.proxy.model_copy(update={"routing": entry.routing})
        data = {**shared, **{f: getattr(entry, f) for f in MODEL_FIELDS}, **pools, "proxy": proxy}
        try:
            view = type(spec).model_validate(data)
        except ValidationError as e:
            problem = SpecError.of("", e)
            field, reason = problem.field, problem.reason
            if field.split(".")[0] in (*MODEL_FIELDS, "routing"):
                field = f"models.{index}.{field}"
            elif field == "proxy.routing" or field.startswith("proxy.routing."):
                field = f"models.{index}.routing" + field[len("proxy.routing") :]
            raise FieldError(field, reason) from None
        view._key = entry.engine_key
        if spec.device == "cpu":
            for key, needed in placement.domain_cores_needed(view).items():
                offsets[key] = needed
        views.append(view)
    return views


def check_views(spec: ClusterSpec) -> None:
    """``FieldError`` where two models' ports meet (or one meets the proxy's), or the cluster's resources
    cannot hold every model's engines at once."""
    owners: dict[int, str] = {spec.proxy.port: "proxy.port"}
    for index, view in enumerate(spec.views()):
        for field, ports in view.ports_used():
            for port in ports:
                if port in owners and owners[port] != "proxy.port":
                    raise FieldError(f"models.{index}.{field}", f"port {port} is also used by {owners[port]}")
                owners[port] = f"models.{index}.{field}"
    if problem := placement.cluster_resource_problem(spec):
        raise FieldError(*problem)
