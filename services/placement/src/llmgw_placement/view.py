"""A read-only view of the cluster as this placement knows it, for the API, the page and the
metrics: liveness judged alike on a leader and a standby, and what the leader holds."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw_core.engines import ShardSpec
from llmgw_core.events import DeploymentStatus, NodeLiveness, PlacementDecision, ReplicaRecord

from .config import ServerConfig
from .feasibility import NodeView
from .held import Held
from .index import KeptIndex
from .liveness import Liveness
from .state import ClusterState


class ClusterView:
    """Reads; never writes. `led` is told by the service when it becomes the leader;
    `leading` says whether it leads now (holds a proven lease)."""

    def __init__(self, config: ServerConfig, state: ClusterState, leading: Callable[[], bool]) -> None:
        self.config = config
        self.state = state
        self._leading = leading
        self.liveness = Liveness(config, state)
        # What this placement wrote while it led (kept after it lost the lease: an
        # ex-leader's memory, shown by the metrics only), and its kept index.
        self.held: Held | None = None
        self._index: KeptIndex | None = None

    def led(self, held: Held, index: KeptIndex) -> None:
        self.held = held
        self._index = index

    def alive(self, node: str, at: float) -> tuple[bool, float]:
        return self.liveness.alive(node, at)

    def in_grace(self, node: str, at: float) -> float | None:
        return self.liveness.in_grace(node, at)

    def judged(self, node: str, at: float) -> NodeLiveness:
        return self.liveness.judged(node, at)

    def shard_states(self, at: float) -> dict[str, str]:
        """Every stored shard status's key and how it reads now (`NodeLiveness.shard_reading`):
        a lost node's shard is `unknown (node lost 13 s ago)`, never the `ready` it last said."""
        judged: dict[str, NodeLiveness] = {}
        out = {}
        for k, status in sorted(self.state.shard_status.items()):
            live = judged.get(status.node)
            if live is None:
                live = judged[status.node] = self.liveness.judged(status.node, at)
            out[k] = live.shard_reading(status.state)
        return out

    def shard_states_of(self, nodes: set[str], at: float) -> dict[str, list[tuple[str, str]]]:
        """`shard_states` for the shards of `nodes`, by node, each list by key."""
        judged = {node: self.liveness.judged(node, at) for node in nodes}
        out: dict[str, list[tuple[str, str]]] = {}
        for k, status in sorted(self.state.shard_status.items()):
            live = judged.get(status.node)
            if live is not None:
                out.setdefault(status.node, []).append((k, live.shard_reading(status.state)))
        return out

    def mine(self) -> Held | None:
        """What the leader holds; None on a standby (an ex-leader's memory is stale)."""
        return self.held if self._leading() else None

    def replicas(self) -> dict[str, ReplicaRecord]:
        """The replicas the leader holds (empty on a standby)."""
        mine = self.mine()
        return dict(mine.replicas) if mine else {}

    def shards(self) -> dict[str, ShardSpec]:
        mine = self.mine()
        return dict(mine.shards) if mine else {}

    def statuses(self) -> dict[str, DeploymentStatus]:
        mine = self.mine()
        return dict(mine.statuses) if mine else {}

    def decision(self, deployment: str) -> PlacementDecision | None:
        mine = self.mine()
        return mine.decisions.get(deployment) if mine else None

    def scaling(self, deployment: str) -> dict[str, object] | None:
        """An autoscaled deployment's count now and its last change, as the leader holds them;
        None on a standby, or for a deployment that does not autoscale."""
        mine = self.mine()
        if mine is None or deployment not in mine.scaling:
            return None
        last = mine.scaled.get(deployment)
        return {
            "count": mine.scaling[deployment].count,
            "last_decision": {
                "before": last.before,
                "after": last.after,
                "reason": last.reason,
                "at": last.at,
            }
            if last is not None
            else None,
        }

    def counts(self, deployment: str) -> tuple[tuple[float, float], ...]:
        """The count the leader chose for an autoscaled deployment over time (monotonic time,
        count), oldest first; empty on a standby or for one that does not autoscale."""
        mine = self.mine()
        return tuple(mine.counts.get(deployment, ())) if mine else ()

    def views(self, at: float | None = None) -> list[NodeView] | None:
        """Every node's view as the leader would decide over it now; None on a standby."""
        if self._index is None or not self._leading():
            return None
        return self._index.views(time.monotonic() if at is None else at)

    def intent(self, node: str) -> str:
        """The node's lifecycle as every surface says it (`cordoned by …`, `draining (1 replica
        left) by …`, `drained by …`), "" when the operator asked nothing of it. The replicas
        left are counted by the leader; a standby says only the intent."""
        intent = self.state.intents.get(node)
        if intent is None:
            return ""
        if self._index is None or not self._leading():
            return intent.words()
        return intent.state(self._index.usage.shards[node])
