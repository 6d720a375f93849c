"""What this placement wrote, in memory: the shards and replicas buckets as it holds them, and
what it remembers between steps (decisions, statuses published, ids reserved, writes to retry).

It changes only from what the bus acknowledged (`proposed.py`): a step decides against it
with its own plan over it, never in it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw_core.engines import ShardSpec
from llmgw_core.events import Deployment, DeploymentStatus, PlacementDecision, ReplicaRecord, ScaleDecision
from llmgw_core.subjects import Names

from .autoscale import Scaling
from .entries import Placed

REPLICA_NUMBER = re.compile(r"^r(\d+)$")


@dataclass
class Held:
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    # Per deployment, its last decision (for `ctl explain`).
    decisions: dict[str, PlacementDecision] = field(default_factory=dict)
    # Per deployment, the status last published (published again only when it changes).
    statuses: dict[str, DeploymentStatus] = field(default_factory=dict)
    # Per deployment, what its last refusal was computed against (see `reconcile._place`).
    refused: dict[str, tuple[int, int, str, str, str]] = field(default_factory=dict)
    # Deployments whose unknown profile was dead-lettered already (by value).
    told_unknown: dict[str, Deployment] = field(default_factory=dict)
    # Placements named whose writes did not land, by replica key (not in `replicas` or
    # `shards`: the store does not hold them): the next step's plan starts with them and
    # writes them again as they are (a new id each time would use ids up while NATS cannot
    # store).
    unwritten: dict[str, Placed] = field(default_factory=dict)
    # Replica records whose change's commit raised, though it may have landed (its answer
    # lost on every try): the next flush writes what memory holds for them, so that the
    # bucket never keeps a change placement does not hold.
    rewrite: set[str] = field(default_factory=set)
    # Per deployment, the next replica number and the end of the block reserved in the bucket.
    ids: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per node, its lifecycle as last told (`cordoned by …`, `draining (1 replica left) by …`).
    lifecycle: dict[str, str] = field(default_factory=dict)
    # Per autoscaled deployment, what the autoscaler remembers, and its last change of count.
    scaling: dict[str, Scaling] = field(default_factory=dict)
    scaled: dict[str, ScaleDecision] = field(default_factory=dict)
    # Per autoscaled deployment, the count chosen over time (monotonic time, count), one point
    # per change, for the page's chart.
    counts: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # Draining replicas by key: since when (this leader's monotonic clock).
    draining: dict[str, float] = field(default_factory=dict)


def key(record: ReplicaRecord) -> str:
    return Names.replica_key(record.deployment, record.replica)


def replica_order(record: ReplicaRecord) -> tuple[int, str]:
    m = REPLICA_NUMBER.match(record.replica)
    return (int(m.group(1)) if m else 1 << 30, record.replica)
