"""The placement decision: a pure function from the cluster's state to a placement or a refusal.

Same input, same output: every choice ends in a tie-break on node id, so a
restarted placement (or a test) computes exactly what the last one did.
What a node can take is `feasibility.py`'s; the candidates come from `index.py`.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

from llmgw_core import failures
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, NodeReason

from .feasibility import NodeView, Reason, cached_score, choose_gpus, gpus_needed, node_reason, score, unfit
from .index import NodeIndex

__all__ = [
    "Assignment",
    "Decision",
    "NodeIndex",
    "NodeView",
    "Placement",
    "Reason",
    "Refusal",
    "choose_gpus",
    "decide",
    "gpus_needed",
    "unfit",
]


@dataclass(frozen=True)
class Assignment:
    node: str
    rank: int
    gpus: tuple[int, ...]
    addr: str
    port: int = 0
    hcas: tuple[str, ...] = ()
    mgmt_iface: str = ""


@dataclass(frozen=True)
class Placement:
    members: tuple[Assignment, ...]
    fabric: str = ""


@dataclass(frozen=True)
class Refusal:
    # Each node and its reason: a `Reason` (words and kind) where placement judged the node.
    reasons: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, reasons: Sequence[NodeReason]) -> Refusal:
        """A refusal as it was told, its kinds kept."""
        return cls(tuple((r.node, Reason.of(r)) for r in reasons))

    def node_reasons(self) -> tuple[NodeReason, ...]:
        """Every node's reason as it travels (`NodeReason`: words and kind as fields)."""
        return tuple(node_reason(node, reason) for node, reason in self.reasons)

    def text(self) -> str:
        if not self.reasons:
            return "no nodes known"
        return "; ".join(f"{node}: {reason}" for node, reason in self.reasons)

    def summary(self, limit: int = 5) -> str:
        """For a log line: every node when a few, else the reasons counted.

        `5000 nodes refused: 4998 x 0 of 8 GPUs free, profile needs 1; 2 x lost: …`"""
        if len(self.reasons) <= limit:
            return self.text()
        counts = Counter(reason for _, reason in self.reasons)
        parts = [f"{n} x {reason}" for reason, n in counts.most_common(limit)]
        rest = len(counts) - limit
        more = f"; and {rest} other reasons" if rest > 0 else ""
        return f"{len(self.reasons)} nodes refused: {'; '.join(parts)}{more}"


Decision = Placement | Refusal


def _port(nodes: Sequence[NodeView], port_range: tuple[int, int]) -> int | None:
    """The first port of `port_range` free on every one of `nodes`, None where none is."""
    used = set().union(*(n.used_ports for n in nodes))
    for port in range(port_range[0], port_range[1] + 1):
        if port not in used:
            return port
    return None


def decide(
    deployment: Deployment,
    profile: Profile,
    nodes: Sequence[NodeView] | NodeIndex,
    *,
    fabric_hcas: Mapping[str, tuple[str, ...]] | None = None,
    port_range: tuple[int, int] = (30000, 39999),
) -> Decision:
    """Where one new replica of `deployment` goes, or every node's reason why nowhere.

    Given a NodeIndex, only the candidates (engine running, GPU class present)
    are examined unless the replica cannot be placed, when every node's reason
    is needed anyway; a multi-node profile reads the index's fabric table for
    its profile and pool (`_FabricFit`) and examines the chosen fabric only.
    """
    if isinstance(nodes, NodeIndex) and profile.nodes > 1:
        # A kept index keeps each multi-node profile's fabric table current: the decision
        # reads it instead of examining every candidate. (A plain list is indexed for this
        # one call, so building the table too would only add to its cost.)
        fp = profile.fingerprint()
        found = nodes.fabric_fit(profile, deployment, fp).choose(deployment, fp)
        if found is not None:
            return _assemble(profile, *found, fabric_hcas, port_range)
        return _decide(deployment, profile, nodes.all(), fabric_hcas, port_range)
    index = nodes if isinstance(nodes, NodeIndex) else NodeIndex(nodes)
    if profile.nodes <= 1 and profile.gpu_class and deployment.strategy == "binpack":
        # Binpack's order is (holds the weights, fewest GPUs left, ...): look at the
        # weight holders, then walk the free-GPU buckets upwards; the first bucket
        # with a fitting node holds the answer, so a big fleet is not scanned.
        need = gpus_needed(profile)
        holders = [v for v in index.holding(profile.weights_key) if index.is_candidate(profile, v.node)]
        # In score order, the first node that fits is the best. A weight holder that does
        # not fit here does not fit in its free-GPU bucket either, so the buckets' own order
        # (which ignores weights) picks the same node the full score would.
        ordered = chain(
            sorted(holders, key=lambda v: score(v, profile, deployment)), index.binpack_order(profile, need)
        )
        memo: dict[tuple[tuple[str, str, int], ...], list[Reason]] = {}
        # Kept in the view under _decide's key: _decide finds it there for the winner, and
        # the next decision for the deployment finds it for every node walked past.
        cache_key = (profile.fingerprint(), deployment.name, deployment.pool)
        for view in ordered:
            if cache_key not in view._unfit:
                view._unfit[cache_key] = unfit(view, profile, deployment, memo)
            if view._unfit[cache_key] is None:
                return _decide(deployment, profile, [view], fabric_hcas, port_range)
    else:
        decision = _decide(deployment, profile, index.candidates(profile), fabric_hcas, port_range)
        if isinstance(decision, Placement):
            return decision
    return _decide(deployment, profile, index.all(), fabric_hcas, port_range)


def _decide(
    deployment: Deployment,
    profile: Profile,
    nodes: Sequence[NodeView],
    fabric_hcas: Mapping[str, tuple[str, ...]] | None,
    port_range: tuple[int, int],
) -> Decision:
    reasons: dict[str, str] = {}
    fit: list[NodeView] = []
    memo: dict[tuple[tuple[str, str, int], ...], list[Reason]] = {}
    fp = profile.fingerprint()
    cache_key = (fp, deployment.name, deployment.pool)
    for node in nodes:
        if cache_key in node._unfit:
            why = node._unfit[cache_key]
        else:
            why = node._unfit[cache_key] = unfit(node, profile, deployment, memo)
        if why is None:
            fit.append(node)
        else:
            reasons[node.node] = why
    need = gpus_needed(profile)
    if profile.nodes <= 1:
        if not fit:
            return Refusal(tuple(sorted(reasons.items())))
        best = min(fit, key=lambda n: score(n, profile, deployment))
        gpus = choose_gpus(best.free_gpus(profile.gpu_class), need) if need else []
        return Placement(
            (
                Assignment(
                    node=best.node,
                    rank=0,
                    gpus=tuple(g.index for g in gpus),
                    addr=best.mgmt_addr,
                    mgmt_iface=best.mgmt_iface,
                ),
            )
        )
    by_fabric: dict[str, list[NodeView]] = defaultdict(list)
    for node in fit:
        by_fabric[node.fabric].append(node)
    # The fabric first (its key names it, so no two tie), then its members: ranking the
    # members of every fabric would cost a sort per fabric for one winner.
    winner: tuple[tuple[int, str], list[NodeView]] | None = None
    for fabric, members in by_fabric.items():
        if len(members) < profile.nodes:
            for node in members:
                reasons[node.node] = Reason(
                    f"fabric {fabric} has {len(members)} fitting node{'s' if len(members) != 1 else ''}, "
                    f"profile needs {profile.nodes}",
                    failures.FABRIC,
                )
            continue
        free_after = sum(len(n.free_gpus(profile.gpu_class)) for n in members) - need * profile.nodes
        key = (free_after, fabric) if deployment.strategy == "binpack" else (-free_after, fabric)
        if winner is None or key < winner[0]:
            winner = (key, members)
    if winner is None:
        return Refusal(tuple(sorted(reasons.items())))
    (_, fabric), members = winner
    chosen = heapq.nsmallest(profile.nodes, members, key=lambda n: cached_score(n, profile, deployment, fp))
    return _assemble(profile, fabric, chosen, fabric_hcas, port_range)


def _assemble(
    profile: Profile,
    fabric: str,
    chosen: Sequence[NodeView],
    fabric_hcas: Mapping[str, tuple[str, ...]] | None,
    port_range: tuple[int, int],
) -> Decision:
    """A multi-node replica on `chosen` (in rank order) over `fabric`; refused where the nodes
    have no port of `port_range` free in common (their ranks would have nothing to meet on)."""
    need = gpus_needed(profile)
    port = _port(chosen, port_range)
    if port is None:
        # Refused in words, as any other node is: raised, it failed the whole step.
        low, high = port_range
        why = Reason(
            f"no port of dist_port_range {low}-{high} free on every node of fabric {fabric}", failures.FABRIC
        )
        return Refusal(tuple(sorted((n.node, why) for n in chosen)))
    hcas_of_fabric = (fabric_hcas or {}).get(fabric, ())
    members_out = []
    for rank, node in enumerate(chosen):
        gpus = choose_gpus(node.free_gpus(profile.gpu_class), need) if need else []
        # Only the chosen fabric's adapters: see NCCL_IB_HCA in llmgw_core.engines.
        hcas = tuple(h for h in hcas_of_fabric if not node.hcas or h in node.hcas)
        members_out.append(
            Assignment(
                node=node.node,
                rank=rank,
                gpus=tuple(g.index for g in gpus),
                addr=node.mgmt_addr,
                port=port,
                hcas=hcas,
                mgmt_iface=node.mgmt_iface,
            )
        )
    return Placement(tuple(members_out), fabric=fabric)
