"""``pdserve doctor`` beside a running cluster: every node of its Ray cluster probed (and measured) where it
runs, through Ray tasks pinned to each node, and the places the engines really are in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connectors.transport import Where

if TYPE_CHECKING:
    from orchestrator.doctor.measure import Geometry, Measurement
    from orchestrator.doctor.probes import HostProbe

__all__ = ["Node", "engine_places", "on_nodes"]

TASK_TIMEOUT_S = 300.0


def _probe() -> tuple[str, HostProbe]:
    import ray

    from orchestrator.doctor.probes import probe_host

    return ray.util.get_node_ip_address(), probe_host()


class Node:
    """One alive node of the cluster: its address, its probe, and measurements run on it."""

    def __init__(self, ray: Any, node_id: str, address: str, probe: HostProbe) -> None:
        self._ray, self.node_id, self.address, self.probe = ray, node_id, address, probe

    def measure(self, geometry: Geometry, env: dict[str, str], memory: str, transport: str) -> Measurement | str:
        from orchestrator.doctor.measure import attempt

        task = self._ray.remote(num_cpus=0)(attempt).options(scheduling_strategy=_on(self.node_id))
        return self._ray.get(task.remote(geometry, env, memory, transport), timeout=TASK_TIMEOUT_S)


def _on(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def on_nodes(ray: Any) -> list[Node]:
    """Every alive node of the cluster ``ray`` is a driver of, probed there."""
    alive = [node for node in ray.nodes() if node.get("Alive")]
    probe = ray.remote(num_cpus=0)(_probe)
    refs = [(node["NodeID"], probe.options(scheduling_strategy=_on(node["NodeID"])).remote()) for node in alive]
    return [Node(ray, node_id, *ray.get(ref, timeout=TASK_TIMEOUT_S)) for node_id, ref in refs]


def engine_places(engines: list[dict[str, Any]], nodes: list[Node], model: str) -> dict[str, set[Where]]:
    """For each node that runs a decode engine of ``model``: where the prefill engines it reads are (the same
    node, another). An engine's node is the one at its address (the only one, on a one-node cluster)."""

    def node_of(engine: dict[str, Any]) -> str | None:
        for node in nodes:
            if node.address == engine.get("host"):
                return node.node_id
        return nodes[0].node_id if len(nodes) == 1 else None

    ours = [e for e in engines if e.get("model", model) == model and e.get("state") not in ("stopped", "failed")]
    prefill = {node_of(e) for e in ours if e["role"] == "prefill"}
    places: dict[str, set[Where]] = {}
    for engine in (e for e in ours if e["role"] == "decode"):
        node = node_of(engine)
        if node is None:
            continue
        found = places.setdefault(node, set())
        if node in prefill:
            found.add(Where.SAME_NODE)
        if prefill - {node}:
            found.add(Where.OTHER_NODE)
    return places
