"""One model's part of a cluster: its pools and the collaborators that work on them.

A cluster of one model has one ``ModelGroup``; a cluster of several (``ClusterSpec.models``) one per model, each
built from the model's view of the spec (``ClusterSpec.views``). They share the controller's engine handles, its
proxy link (each publishes through its own ``ModelPublisher``), its event log and its tasks; their engines' ids
differ (``ClusterSpec.engine_id``), and so does each one's ``Pools``, ``PoolChanges``, ``EngineSupervisor``
and autoscaler, so that a model's pools grow, shrink and move apart from another's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from contract.wire import ROLES
from orchestrator.autoscale.actuator import Autoscaler
from orchestrator.autoscale.profile import PerformanceProfile
from orchestrator.engine_handles import EngineHandles
from orchestrator.launch import plan_engines
from orchestrator.pool_changes import PoolChanges
from orchestrator.pools import Events, Pools, Tasks
from orchestrator.proxy_link import ProxyLink
from orchestrator.spec import ClusterSpec
from orchestrator.state import state_dir
from orchestrator.supervision import EngineSupervisor


class ModelGroup:
    def __init__(
        self,
        spec: ClusterSpec,
        host: str | None,
        log_dir: Path,
        handles: EngineHandles,
        events: Events,
        tasks: Tasks,
        profile: dict[str, Any] | None,
    ) -> None:
        """``spec``: the model's view; its engines' launches are planned for ``host`` (``plan_engines``)."""
        self.name = spec.model_name
        # Every engine the pools may grow to; the first `replicas` of each start with the cluster.
        launches = {e.engine_id: e for e in plan_engines(spec, host)}
        self.pools = Pools(spec, launches, log_dir, {role: spec.pool(role).replicas for role in ROLES})
        for role in ROLES:
            for launch in self.pools.launches_of(role)[: self.pools.targets[role]]:
                self.pools.add(launch)
        self._parts = (handles, events, tasks, profile)
        self.supervisor: EngineSupervisor
        self.changes: PoolChanges
        self.autoscaler: Autoscaler | None = None

    def link(self, proxy: ProxyLink) -> None:
        """Build the collaborators, which publish through ``proxy`` (made once every model's pools are)."""
        handles, events, tasks, profile = self._parts
        publisher = proxy.publisher(self.pools)
        spec = self.pools.spec
        self.supervisor = EngineSupervisor(self.pools, handles, publisher, events, tasks)
        self.changes = PoolChanges(self.pools, self.supervisor, publisher, events, tasks, handles.nodes)
        if spec.autoscaling is not None and profile is not None:
            self.autoscaler = Autoscaler(
                spec.autoscaling,
                PerformanceProfile.from_dict(profile),
                proxy.url,
                lambda: [(r.engine_id, r.role, r.state, r.url) for r in self.pools.engines.values()],
                lambda targets, reason: self.changes.scale(
                    targets, reason, keep_warm_s=spec.autoscaling.keep_warm_s, move=True
                ),
                moves=spec.move_problem() is None,
                model=spec.model_name,
                season_path=season_path(spec),
            )
            self.changes.scaled_by_hand = self.autoscaler.policy.scaled_by_hand  # not undone before its cooldown


def season_path(spec: ClusterSpec) -> Path:
    """Where a model's learned season is kept: beside the cluster's state, by cluster and model name, so that it
    outlives a restart of the controller and of the cluster."""
    return state_dir() / "seasons" / f"{spec.name}-{re.sub(r'[^A-Za-z0-9._-]', '_', spec.model_name)}.json"
