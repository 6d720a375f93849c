"""What a control step decided, as named entries: what `reconcile` returns and `apply` writes.

A `Place` names no replica id: the applier gives each one the next id of its
deployment's reserved block (reserving a block when none is left), so deciding
never waits on the bus and a store that refuses writes costs no ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeReason,
    PlacementDecision,
    ReplicaRecord,
    ReplicaState,
)

from .decide import Placement, Refusal


@dataclass(frozen=True)
class Place:
    """A new replica of `deployment` on the nodes and GPUs of `placement` (taken in the index)."""

    deployment: Deployment
    profile: Profile
    fp: str
    placement: Placement
    # Replicas of the deployment still to place when this one was decided: the size of the
    # id block reserved if none is left (see `apply.Applier.name`).
    wanted: int = 1


@dataclass(frozen=True)
class Placed:
    """A placement named and built, to be written: its shards, its record, its decision."""

    record: ReplicaRecord
    specs: tuple[ShardSpec, ...]
    decision: PlacementDecision
    traceparent: str


@dataclass(frozen=True)
class Remove:
    """A replica forgotten in memory (its GPUs are free for the next decision), its keys to delete."""

    record: ReplicaRecord
    specs: dict[str, ShardSpec]
    why: str
    state: ReplicaState = "stopping"


@dataclass(frozen=True)
class Save:
    """A replica's changed record (taken in memory), to write; `before` is None for a new one."""

    before: ReplicaRecord | None
    after: ReplicaRecord
    traceparent: str


@dataclass(frozen=True)
class Refuse:
    """A deployment that cannot be placed, told (event and log) because its reasons changed.

    `replica` is "-" for a deployment whose profile is unknown; "" asks the applier for
    the id the next replica would get, which the refusal names without using it up."""

    deployment: str
    refusal: Refusal
    replica: str = ""
    wanted: int = 1
    # False: the same refusal as last told; only the decision kept for `explain` is renewed.
    tell: bool = True

    @property
    def reasons(self) -> tuple[NodeReason, ...]:
        return tuple(NodeReason(node=n, reason=r) for n, r in self.refusal.reasons)


@dataclass(frozen=True)
class DeadLetter:
    """A deployment's value copied to the dead-letter subject, with why it cannot be placed."""

    subject: str
    data: bytes
    error: str


@dataclass(frozen=True)
class Report:
    """A deployment's status that changed, published once the step's writes are committed."""

    status: DeploymentStatus
    # The deployment was deleted: its status is forgotten once published.
    gone: bool = False


@dataclass
class Plan:
    """One control step's entries, in the order they are written: removals before placements
    (a placement may reuse GPUs a removal freed), then changes of state, then reports."""

    removals: list[Remove] = field(default_factory=list)
    # Placements decided, not named yet; and placements named, to write (those of earlier
    # steps whose writes did not land are written again as they were, same ids).
    places: list[Place] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    # Seconds each decision took (for the metrics).
    decision_seconds: list[float] = field(default_factory=list)

    def full(self, most: int) -> bool:
        """Whether any kind of write has `most` queued: time to write them."""
        return max(len(self.removals), len(self.places) + len(self.placed), len(self.saves)) >= most

    def take(self) -> Plan:
        """Everything queued so far, handed over (this plan is left empty but for its reports)."""
        taken = Plan(
            removals=self.removals,
            places=self.places,
            placed=self.placed,
            saves=self.saves,
            refusals=self.refusals,
            dead_letters=self.dead_letters,
            decision_seconds=self.decision_seconds,
        )
        self.removals, self.places, self.placed, self.saves = [], [], [], []
        self.refusals, self.dead_letters, self.decision_seconds = [], [], []
        return taken
