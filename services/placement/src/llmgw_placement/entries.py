"""The entries of a control step's plan, one kind of write each (`plan.Plan` holds them in order).

A leaf of placement's step: what is held (`held`) and what a step proposes (`proposed`)
name these without the plan that orders them.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """A new replica of `deployment` on the nodes and GPUs of `placement` (taken in the step's index)."""

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
    """A replica removed in the step (its GPUs free for its next decision), its keys to delete."""

    record: ReplicaRecord
    specs: dict[str, ShardSpec]
    why: str
    state: ReplicaState = "stopping"


@dataclass(frozen=True)
class Save:
    """A replica's changed record (seen by the rest of the step), to write; `before` is None for a new one."""

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
        return self.refusal.node_reasons()


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
