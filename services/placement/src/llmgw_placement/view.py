"""A read-only view of the cluster as this placement knows it, for the API, the page and the
metrics: liveness judged alike on a leader and a standby, and what the leader holds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from llmgw_core.engines import ShardSpec
from llmgw_core.events import DeploymentStatus, NodeLiveness, PlacementDecision, ReplicaRecord

from .config import ServerConfig
from .feasibility import NodeView
from .held import Held
from .index import KeptIndex
from .liveness import Liveness
from .state import ClusterState

# A refusal's reasons as the page, the events and `llmgw ctl describe` say them: the commonest
# reasons first, each with how many nodes gave it and a few of their names. Every node's reason
# in a line made one "cannot place" event 26,797 characters at 500 nodes, and the page
# tens of thousands of pixels tall; `llmgw ctl explain` and `/api/explain` keep every node's.
REASON_GROUPS = 5
EXAMPLE_NODES = 3
# A reason is the node's or placement's words: one is cut here, where a line must stay short.
REASON_CHARS = 240


class ReasonGroup(NamedTuple):
    """One reason, how many nodes gave it, and the first few of them (in the order given)."""

    reason: str
    nodes: int
    examples: tuple[str, ...]


def _cut(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "…"


def reason_groups(
    reasons: Iterable[tuple[str, str]], *, groups: int = REASON_GROUPS, examples: int = EXAMPLE_NODES
) -> tuple[list[ReasonGroup], int, int]:
    """`(node, reason)` pairs grouped by reason: the `groups` commonest (most nodes first, then
    the first given), each with its first `examples` nodes; then how many other reasons were
    left out and on how many nodes. Memory is bounded by the distinct reasons, never by a
    copy of every node's name."""
    counts: dict[str, int] = {}
    names: dict[str, list[str]] = {}
    for node, reason in reasons:
        said = _cut(reason)
        counts[said] = counts.get(said, 0) + 1
        kept = names.setdefault(said, [])
        if len(kept) < examples:
            kept.append(node)
    order = sorted(counts, key=lambda r: -counts[r])  # stable: ties keep the order first given
    top = [ReasonGroup(r, counts[r], tuple(names[r])) for r in order[:groups]]
    rest = order[groups:]
    return top, len(rest), sum(counts[r] for r in rest)


def reasons_text(reasons: Iterable[tuple[str, str]]) -> str:
    """A refusal in one bounded line: every node's reason when a few (`node-1: GPU class
    H100-80G, profile needs A100-80G`), else grouped: `on 1000 nodes: 998 x 0 of 8 GPUs free,
    profile needs 1 (sim-00000, sim-00001, sim-00002, …); 2 x lost 30 s ago (gone-00000, gone-00001)`."""
    pairs = list(reasons)
    if not pairs:
        return "no nodes known"
    if len(pairs) <= REASON_GROUPS:
        return "; ".join(f"{node}: {_cut(reason)}" for node, reason in pairs)
    top, other, on = reason_groups(pairs)
    parts = [
        f"{g.nodes} x {g.reason} ({', '.join(g.examples)}{', …' if g.nodes > len(g.examples) else ''})"
        for g in top
    ]
    if other:
        parts.append(
            f"and {other} other reason{'s' if other != 1 else ''} on {on} node{'s' if on != 1 else ''}"
        )
    nodes = len(pairs)
    return f"on {nodes} node{'s' if nodes != 1 else ''}: " + "; ".join(parts)


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
        """The replicas the leader holds (empty on a standby), with the placements whose write
        did not land yet (the store full): `placing`, as their records say."""
        mine = self.mine()
        if mine is None:
            return {}
        return {k: placed.record for k, placed in mine.unwritten.items()} | mine.replicas

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
