"""Where the cluster's parts run on a Ray cluster of several hosts (pure: no Ray import).

- ``engine_placement(spec, role)``: what one engine of a pool asks Ray for.
  CPU engines: an actor with ``num_cpus`` = TP x cores, the pool's node labels
  as a Ray ``label_selector`` and its custom resources (per TP rank). GPU
  engines: one placement group per engine, one bundle per TP rank
  (``{"GPU": 1, **resources}``, as vLLM makes its own; ``STRICT_PACK`` by
  default, the labels as each bundle's selector). The engine actor sits in
  bundle 0 with no resources of its own and hands the group to vLLM, whose Ray
  executor runs one TP worker per bundle: the CUDA devices are the bundles' own.
- ``control_placement(spec)``: the proxy and the controller, on the Ray head
  node unless ``proxy.placement`` says otherwise.
- ``check_fit(spec, nodes)``: whether the alive nodes can hold the starting
  engines and the control plane; each problem names the spec field and the
  reason (a plan Ray cannot place would otherwise wait for ever).
- ``host_plan(spec, launches, assign(...))``: the plan per host, for ``pdserve validate``.
- Resource planning, which the spec checks when it is loaded: ``placement_domains``
  (pools that may share hosts), ``most_at_once`` (the most of a resource the
  engines hold at once, over every split autoscaling allows), ``cpu_cores_needed``
  and ``resource_problem``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contract.wire import ROLES

if TYPE_CHECKING:  # the spec checks its resources with this module's planning
    from orchestrator.spec import ClusterSpec
    from orchestrator.spec_sections import NodeSelectorSpec

HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives its head node only."""
CONTROL_CPUS = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    """What one part of the cluster asks Ray for."""

    node_labels: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom resources of the whole part (all its TP ranks)."""
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    bundles: tuple[Mapping[str, float], ...] = ()
    """GPU engines: one bundle per TP rank, in one placement group."""
    strategy: str = "STRICT_PACK"

    def actor_options(self) -> dict[str, Any]:
        """``ray.remote(...).options(**these)`` for a part placed without a placement group."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.node_labels:
            options["label_selector"] = dict(self.node_labels)
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def placement_group_args(self) -> dict[str, Any]:
        """``ray.util.placement_group(**these)`` for a GPU engine."""
        args: dict[str, Any] = {"bundles": [dict(b) for b in self.bundles], "strategy": self.strategy}
        if self.node_labels:
            args["bundle_label_selector"] = [dict(self.node_labels) for _ in self.bundles]
        return args

    def demand(self) -> dict[str, float]:
        """Everything it takes from the nodes, as Ray resources."""
        if self.bundles:
            total: dict[str, float] = {}
            for bundle in self.bundles:
                for name, amount in bundle.items():
                    total[name] = total.get(name, 0.0) + amount
            return total
        demand = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in demand.items() if amount}


def engine_placement(spec: ClusterSpec, role: str) -> Placement:
    pool = spec.pool(role)
    tp, where = pool.tensor_parallel_size, pool.placement
    if spec.device == "cpu":
        return Placement(
            node_labels=dict(where.node_labels),
            resources={name: amount * tp for name, amount in where.resources.items()},
            num_cpus=float(tp * pool.cpu_cores),
        )
    bundle = {"GPU": 1.0, **where.resources}
    return Placement(
        node_labels=dict(where.node_labels),
        resources={name: amount * tp for name, amount in where.resources.items()},
        bundles=tuple(dict(bundle) for _ in range(tp)),
        strategy=where.strategy,
    )


def control_placement(spec: ClusterSpec) -> Placement:
    """The controller's and the proxy's: the head node by default."""
    where = spec.proxy.placement
    if where is None:
        return Placement(resources={HEAD_RESOURCE: 0.001}, num_cpus=CONTROL_CPUS)
    return Placement(node_labels=dict(where.node_labels), resources=dict(where.resources), num_cpus=CONTROL_CPUS)


@dataclass(frozen=True, slots=True)
class Node:
    """A Ray node, as ``ray.nodes()`` describes it."""

    node_id: str
    ip: str
    labels: Mapping[str, str]
    resources: Mapping[str, float]
    alive: bool = True

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources

    @classmethod
    def from_ray(cls, entry: Mapping[str, Any]) -> Node:
        return cls(
            node_id=str(entry.get("NodeID", "")),
            ip=str(entry.get("NodeManagerAddress", "")),
            labels=dict(entry.get("Labels") or {}),
            resources={k: float(v) for k, v in (entry.get("Resources") or {}).items()},
            alive=bool(entry.get("Alive", False)),
        )


def _matches(node: Node, placement: Placement) -> bool:
    if any(node.labels.get(key) != value for key, value in placement.node_labels.items()):
        return False
    return all(name in node.resources for name in placement.demand() if name not in ("CPU", "GPU"))


def _describe(selector: NodeSelectorSpec | None) -> str:
    """The nodes a part may use, in words."""
    if selector is None:
        return "the Ray head node"
    where = selector.describe()
    return "any node" if where == "any node" else f"nodes with {where}"


def _parts(spec: ClusterSpec) -> list[tuple[str, str, Placement, NodeSelectorSpec | None]]:
    """``(part, name, placement, selector)`` of the control plane and each starting engine."""
    parts = [("proxy", "proxy+controller", control_placement(spec), spec.proxy.placement)]
    for view in spec.views():
        field = f"models.{spec.views().index(view)}." if spec.models else ""
        for role in ROLES:
            placement, pool = engine_placement(view, role), view.pool(role)
            parts += [(field + role, view.engine_id(role, i), placement, pool.placement) for i in range(pool.replicas)]
    return parts


def _fits_in(free: dict[str, float], demand: Mapping[str, float]) -> bool:
    return all(free.get(name, 0.0) + 1e-9 >= amount for name, amount in demand.items())


def _take(left: dict[str, float], demand: Mapping[str, float]) -> None:
    for name, amount in demand.items():
        left[name] = left.get(name, 0.0) - amount


def _first_fitting(
    nodes: Iterable[Node], free: dict[str, dict[str, float]], demand: Mapping[str, float]
) -> Node | None:
    return next((n for n in nodes if _fits_in(free[n.node_id], demand)), None)


def _place_bundles(placement: Placement, nodes: list[Node], free: dict[str, dict[str, float]]) -> str | None:
    """Place a GPU engine's bundles on ``nodes`` (those it may use) under its strategy; the node ips it took,
    or None (and nothing taken) when they do not fit."""
    if placement.strategy == "STRICT_PACK":
        node = _first_fitting(nodes, free, placement.demand())
        if node is None:
            return None
        _take(free[node.node_id], placement.demand())
        return node.ip
    trial = {n.node_id: dict(free[n.node_id]) for n in nodes}
    spread = placement.strategy in ("SPREAD", "STRICT_SPREAD")
    used: list[str] = []
    for bundle in placement.bundles:
        order = sorted(nodes, key=lambda n: n.ip in used) if spread else nodes
        if placement.strategy == "STRICT_SPREAD":
            order = [n for n in order if n.ip not in used]
        node = _first_fitting(order, trial, bundle)
        if node is None:
            return None
        _take(trial[node.node_id], bundle)
        used.append(node.ip)
    free.update(trial)
    return ",".join(dict.fromkeys(used))


def assign(spec: ClusterSpec, nodes: Iterable[Node]) -> tuple[dict[str, str], list[str]]:
    """First-fit the control plane and the starting engines onto the alive nodes.

    Returns ``(where, problems)``: the node ip(s) of each part that fits, and one
    ``"<field>: <reason>"`` per part that does not.
    """
    alive = [n for n in nodes if n.alive]
    free = {n.node_id: dict(n.resources) for n in alive}
    where: dict[str, str] = {}
    problems: list[str] = []
    for part, name, placement, selector in _parts(spec):
        matching = [n for n in alive if _matches(n, placement)]
        if not matching:
            problems.append(
                f"{part}.placement: no alive Ray node is one of {_describe(selector)} (nodes: "
                + "; ".join(f"{n.ip} {dict(n.labels) or '{}'}" for n in alive)
                + ")"
            )
            continue
        if placement.bundles:
            taken = _place_bundles(placement, matching, free)
        elif node := _first_fitting(matching, free, placement.demand()):
            _take(free[node.node_id], placement.demand())
            taken = node.ip
        else:
            taken = None
        if taken is None:
            asked = ", ".join(f"{k} {v:g}" for k, v in sorted(placement.demand().items()))
            have = "; ".join(
                f"{n.ip}: " + ", ".join(f"{k} {free[n.node_id].get(k, 0):g}" for k in sorted(placement.demand()))
                for n in matching
            )
            how = placement.strategy if placement.bundles else "on one node"
            among = _describe(selector)
            problems.append(f"{part}: {name} needs {asked} ({how}) but the nodes it may use ({among}) have left {have}")
            continue
        where[name] = taken
    return where, problems


def host_plan(
    spec: ClusterSpec, launches: Iterable[Any], placed: tuple[dict[str, str], list[str]] | None = None
) -> list[str]:
    """The plan per host, as ``pdserve validate`` prints it.

    Without ``placed`` (no Ray cluster to ask): per placement, the engines that
    go there with their cores or GPUs. With ``placed`` (``assign``'s answer on a
    cluster's nodes): which node each part lands on, and the problems.
    """
    by_id = {launch.engine_id: launch for launch in launches}
    lines: list[str] = []
    if placed is None:
        groups: dict[str, list[str]] = {}
        control = spec.proxy.placement.describe() if spec.proxy.placement else "Ray head node"
        groups.setdefault(control, []).append("proxy, controller")
        for view in spec.views():
            for role in ROLES:
                where = view.pool(role).placement.describe()
                for launch in (v for v in by_id.values() if v.role == role and v.model == view.model_name):
                    groups.setdefault(where, []).append(_engine_line(view, launch))
        for where, items in groups.items():
            lines.append(f"  on {where}:")
            lines += [f"    {item}" for item in items]
        return lines
    where, problems = placed
    by_host: dict[str, list[str]] = {}
    for name, ip in where.items():
        item = "proxy, controller" if name == "proxy+controller" else _engine_line(spec, by_id[name])
        by_host.setdefault(ip, []).append(item)
    for ip, items in sorted(by_host.items()):
        lines.append(f"  host {ip}:")
        lines += [f"    {item}" for item in items]
    lines += [f"  cannot place: {problem}" for problem in problems]
    return lines


def _engine_line(spec: ClusterSpec, launch: Any) -> str:
    """A line of ``launch``'s engine (``spec``: the cluster's, or its model's view)."""
    spec = next((v for v in spec.views() if v.model_name == launch.model), spec)
    starts = int(launch.engine_id.rpartition("-")[2]) < spec.pool(launch.role).replicas
    what = f"cores {launch.cpu_bind}" if launch.cpu_bind else f"{launch.num_gpus:g} GPU(s) in one placement group"
    return f"{launch.engine_id:<10} {what}, port {launch.port}, kv_port {launch.kv_port}" + (
        "" if starts else " (autoscaling)"
    )


# --- resource planning --------------------------------------------------------------------------


def placement_domains(spec: ClusterSpec) -> dict[tuple, tuple[str, ...]]:
    """Pools grouped by where they may run: pools of one group may share hosts (and a core plan)."""
    domains: dict[tuple, tuple[str, ...]] = {}
    for role in ROLES:
        key = spec.pool(role).placement.key
        domains[key] = (*domains.get(key, ()), role)
    return domains


def most_at_once(spec: ClusterSpec, per_engine: Mapping[str, int]) -> int:
    """The most of a resource (``per_engine[role]`` each) the engines can hold at once."""
    if spec.autoscaling is None:
        return sum(spec.pool(r).replicas * per_engine[r] for r in ROLES)
    scaling = spec.autoscaling
    return max(
        p * per_engine["prefill"] + min(scaling.decode.max, scaling.max_engines - p) * per_engine["decode"]
        for p in range(scaling.prefill.min, min(scaling.prefill.max, scaling.max_engines - scaling.decode.min) + 1)
    )


def cpu_cores_available(spec: ClusterSpec) -> int:
    """Cores CPU engines may be pinned to: ``resources.cpus``, else all of this machine's."""
    return spec.resources.cpus or os.cpu_count() or 1


def domain_cores_needed(spec: ClusterSpec) -> dict[tuple, int]:
    """Per group of pools that may share hosts (``placement_domains``): the first core after those its CPU
    engines are pinned to: their ``first_core`` + replicas x TP x cores per rank (with autoscaling, of the
    largest split its ranges and budget allow)."""
    needed = {}
    for key, roles in placement_domains(spec).items():
        per_engine = {r: spec.pool(r).tensor_parallel_size * spec.pool(r).cpu_cores if r in roles else 0 for r in ROLES}
        first = min(spec.pool(r).placement.first_core for r in roles)
        needed[key] = first + most_at_once(spec, per_engine)
    return needed


def cpu_cores_needed(spec: ClusterSpec) -> int:
    """Cores the CPU engines are pinned to at most on one host (``domain_cores_needed``), of every model."""
    return max(max(domain_cores_needed(view).values()) for view in spec.views())


def cluster_resource_problem(spec: ClusterSpec) -> tuple[str, str] | None:
    """(field, reason) when the engines of a spec of several models cannot fit its GPUs together, else None
    (each model's own fit, and on CPU their cores one after the other, are checked on its view)."""
    if spec.device == "cpu":
        return None
    needed = sum(most_at_once(view, {r: view.pool(r).tensor_parallel_size for r in ROLES}) for view in spec.views())
    if needed > spec.resources.gpus:
        return (
            "resources.gpus",
            f"the models' engines need {needed} GPUs together (replicas x tensor_parallel_size, or what their "
            f"autoscaling may run) but resources.gpus is {spec.resources.gpus}",
        )
    return None


def resource_problem(spec: ClusterSpec) -> tuple[str, str] | None:
    """(field, reason) when the engines cannot fit the spec's resources, else None."""
    if spec.device == "cpu":
        available, needed = cpu_cores_available(spec), cpu_cores_needed(spec)
        if needed > available and not spec.resources.share_cores:
            return (
                "resources.cpus",
                f"engines need {needed} CPU cores on one host (first_core + replicas x tensor_parallel_size x "
                f"cpu_cores of the pools that share hosts) but only {available} are available (resources.cpus; "
                "resources.share_cores lets them share)",
            )
        return None
    gpus = spec.resources.gpus
    for role in ROLES:
        tp = spec.pool(role).tensor_parallel_size
        if tp > gpus:
            return (
                f"{role}.tensor_parallel_size",
                f"TP size {tp} needs {tp} GPUs per engine but resources.gpus is {gpus}",
            )
    # Each engine asks Ray for tensor_parallel_size whole GPUs, and the Ray head is
    # started with resources.gpus of them: engines beyond that would wait forever.
    needed = most_at_once(spec, {r: spec.pool(r).tensor_parallel_size for r in ROLES})
    if needed > gpus and spec.autoscaling is not None:
        return (
            "autoscaling.max_engines",
            f"the autoscaler may run engines that need {needed} GPUs but resources.gpus is {gpus}",
        )
    if needed > gpus:
        return (
            "resources.gpus",
            f"engines need {needed} GPUs (replicas x tensor_parallel_size, both pools) but resources.gpus is {gpus}",
        )
    return None
