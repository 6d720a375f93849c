"""What one control step acts on: copies taken when it starts."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, NodeIntent, NodeStatus, ReplicaRecord, ShardStatus
from llmgw_core.events import now as wall_now

from .config import ServerConfig
from .judged import Marked
from .liveness import Liveness


@dataclass(frozen=True)
class Snapshot:
    """What one step acts on: copies, so a watcher's change cannot move under it."""

    deployments: dict[str, Deployment]
    catalog: dict[str, Profile]
    shard_status: dict[str, ShardStatus]
    # The nodes as placement knows them, and who is alive by `liveness` at the step's time.
    nodes: dict[str, NodeStatus]
    alive: frozenset[str]
    liveness: Liveness
    config: ServerConfig
    # The deployments bucket's name, for the dead-letter subject of an unknown profile.
    deployments_bucket: str = "deployments"
    # The operator's cordons and drains, by node: a draining node's replicas are replaced.
    intents: dict[str, NodeIntent] = field(default_factory=dict)
    # The model files each node's launcher reports missing.
    missing_models: dict[str, frozenset[str]] = field(default_factory=dict)
    # The count the autoscaler chose, by autoscaled deployment (in place of `replicas`).
    counts: dict[str, int] = field(default_factory=dict)
    # Draining replicas (by key) that every gateway heard from says have nothing in flight.
    quiet: frozenset[str] = frozenset()
    # Replicas the gateways judge failing their requests, by key (`judged.py`).
    unhealthy: dict[str, Marked] = field(default_factory=dict)
    # The step's wall-clock time (records' `since`, statuses' `at`): one value per step, so a
    # step's plan is a function of its snapshot.
    wall: float = field(default_factory=wall_now)

    def wanted(self, dep: Deployment) -> int:
        """The count to keep: the autoscaler's choice where the deployment follows demand."""
        if dep.autoscale is None:
            return dep.replicas
        return self.counts.get(dep.name, dep.autoscale.min_replicas)

    def draining_nodes(self, record: ReplicaRecord) -> str:
        """The draining nodes a replica has a rank on (`n1, n2`), else ""."""
        intents = self.intents
        return ", ".join(
            sorted({m.node for m in record.members if (i := intents.get(m.node)) is not None and i.drain})
        )
