"""What placement reads: the cluster as the bucket and heartbeat watchers keep it, in every
placement, active or standing by."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_core.claims import Claims
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, NodeIntent, NodeStatus, ShardStatus


@dataclass
class ClusterState:
    """Everything placement reads, kept current by watchers (in every placement, active or not)."""

    nodes: dict[str, NodeStatus]
    # The node's launcher (or all-in-one agent) last heard, by this placement's
    # monotonic clock (liveness is judged on it).
    last_seen: dict[str, float]
    catalog: dict[str, Profile]
    deployments: dict[str, Deployment]
    shard_status: dict[str, ShardStatus]
    # When this placement last heard the node's launcher, by its own wall clock (never the
    # node's: a node whose clock is off would read "no heartbeat since" ten minutes ahead).
    last_seen_wall: dict[str, float] = field(default_factory=dict)
    # When this placement first read the node's status (monotonic): a node that just joined
    # is given a full node_timeout from then for its first heartbeat, not judged lost before it.
    first_known: dict[str, float] = field(default_factory=dict)
    # The node's installer last heard (monotonic): shown, never a reason to fail over.
    installer_seen: dict[str, float] = field(default_factory=dict)
    # Nodes whose launcher runs apart from an installer (it beats as `launcher`, not as an
    # all-in-one `agent`): an installer is expected to beat for them too.
    with_installer: set[str] = field(default_factory=set)
    # The node's clock minus this placement's, as its last heartbeat showed (its `at` against
    # when it arrived), and the nodes whose offset is a warning now (`CLOCK_OFFSET_S`).
    clock_offset: dict[str, float] = field(default_factory=dict)
    clock_off: set[str] = field(default_factory=set)
    # Since when (monotonic) a node's beats have said otherwise than `clock_off` does.
    clock_crossed: dict[str, float] = field(default_factory=dict)
    # Bumped on every change to `nodes`.
    nodes_version: int = 0
    # Nodes whose status changed since the controller last looked (it views only those again).
    dirty_nodes: set[str] = field(default_factory=set)
    # Since when this placement could hear every heartbeat (its start, its last
    # reconnect, the end of its last stall); None while it cannot hear at all.
    # A node is judged only on silence that this placement could have heard.
    heard_from: float | None = 0.0
    # Who sends each node's heartbeats: a node two machines claim is placed on no more.
    claims: Claims = field(default_factory=lambda: Claims(window=5.0))
    # The operator's cordons and drains (the node-intent bucket), by node.
    intents: dict[str, NodeIntent] = field(default_factory=dict)
    # The model files each node's launcher reports missing (its heartbeats' `missing_models`).
    missing_models: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ClusterState:
        return cls({}, {}, {}, {}, {})
