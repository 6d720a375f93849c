"""A deployment's status in words, and its value dead-lettered: what a control step says of it (pure)."""

from __future__ import annotations

from collections import Counter

import msgspec

from llmgw_core.adapters import AdapterQuota
from llmgw_core.events import Deployment, DeploymentStatus, NodeReason, ReplicaRecord, ScaleDecision
from llmgw_core.subjects import Names

from .decide import Refusal
from .held import key, replica_order
from .plan import DeadLetter
from .snapshot import Snapshot

# The states of a replica that failed (for good, or retrying): each one's reason is said in
# its deployment's summary, up to FAILING_SAID of them.
FAILING = ("failed", "degraded")
FAILING_SAID = 5


def deployment_status(
    dep: Deployment,
    records: list[ReplicaRecord],
    *,
    placed_now: int,
    wanted: int,
    refused: bool,
    reasons: tuple[NodeReason, ...],
    blocked: str,
    scaled: ScaleDecision | None,
    at: float,
    quotas: tuple[AdapterQuota, ...] = (),
) -> DeploymentStatus:
    """The deployment's desired, ready, pending and unplaceable counts, from its replicas'
    `records` and the replicas `placed_now` (in this step, not written yet: placing), with
    the refusal that keeps some from being placed (or a roll or drain from proceeding:
    `blocked`, with every node's reason), and its profile's adapters' limits (`quotas`)."""
    ready = sum(1 for r in records if r.state == "ready")
    pending = len(records) + placed_now - ready
    unplaceable = max(0, wanted - len(records) - placed_now) if refused else 0
    reasons = reasons if refused else ()
    parts = [f"{dep.name}: {ready} of {wanted} ready"]
    if pending:
        states = Counter(r.state for r in records if r.state != "ready")
        if placed_now:
            states["placing"] += placed_now
        parts.append(", ".join(f"{n} {state}" for state, n in sorted(states.items())))
        # Why the replicas that failed are failing, then why the first still starting are not
        # ready (a few, in replica order): a replica failed on a gated repository read only
        # `1 failed` here and in `explain`, its reason on its shard alone.
        ordered = sorted(records, key=replica_order)
        failing = [r for r in ordered if r.state in FAILING and r.reason]
        waiting = [r for r in ordered if r.state == "starting" and r.reason]
        said = failing[:FAILING_SAID]
        parts += [f"{r.replica}: {r.reason}" for r in said + waiting[: max(0, 3 - len(said))]]
        if len(failing) > len(said):
            parts.append(f"{len(failing) - len(said)} more failing (`llmgw ctl get replicas`)")
    if unplaceable:
        parts.append(f"{unplaceable} cannot be placed: {reasons_text(reasons)}")
    if blocked:
        blocked = f"{blocked}: {reasons_text(reasons)}"
        parts.append(blocked)
    if dep.autoscale is not None:
        a = dep.autoscale
        parts.append(
            f"following demand, {a.min_replicas} to {a.max_replicas} replicas"
            + (f", last {scaled.reason}" if scaled is not None else "")
        )
    return DeploymentStatus(
        deployment=dep.name,
        desired=wanted,
        ready=ready,
        pending=pending,
        unplaceable=unplaceable,
        summary="; ".join(parts),
        reasons=reasons,
        at=at,
        blocked=blocked,
        adapter_quotas=quotas,
    )


def deleted_status(deployment: str, at: float) -> DeploymentStatus:
    """The last status of a deployment deleted: nothing is desired of it any more."""
    return DeploymentStatus(deployment=deployment, desired=0, summary=f"{deployment}: deleted", at=at)


def reasons_text(reasons: tuple[NodeReason, ...], limit: int = 5) -> str:
    """`node-a 0 of 2 GPUs free, node-b lost: …` for a few nodes, counted past `limit`."""
    return Refusal(tuple((r.node, r.reason) for r in reasons)).summary(limit) if reasons else "no nodes known"


def blocked_words(stale: list[ReplicaRecord], drained: dict[str, str], fp: str) -> str:
    """Why a roll cannot proceed, the replicas serving on meanwhile: a profile change that no
    node fits, or a drain with nowhere to go (every node's reason follows in the summary)."""
    said = []
    if any(r.profile_fp != fp for r in stale):
        said.append("rolling update blocked: no node fits the new profile")
    nodes = sorted({n for r in stale if (on := drained.get(key(r))) for n in on.split(", ")})
    if nodes:
        said.append(f"drain of {', '.join(nodes)} blocked: no other node fits")
    return "; ".join(said)


def unknown_profile_letter(dep: Deployment, snap: Snapshot) -> DeadLetter:
    """A deployment naming no profile of the catalog: its value for the dead-letter subject,
    with why, so whoever wrote it can see it."""
    return DeadLetter(
        Names.kv_subject(snap.deployments_bucket, dep.name),
        msgspec.json.encode(dep),
        f"deployment {dep.name}: profile {dep.profile} is not in the catalog "
        f"({', '.join(sorted(snap.catalog)) or 'the catalog is empty'})",
    )
