"""What a control step decided, as named entries: what `reconcile` returns and `apply` writes.

A `Place` names no replica id: the applier gives each one the next id of its
deployment's reserved block (reserving a block when none is left), so deciding
never waits on the bus and a store that refuses writes costs no ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .entries import DeadLetter, Place, Placed, Refuse, Remove, Report, Save

if TYPE_CHECKING:
    from .proposed import Proposed

__all__ = ["DeadLetter", "Place", "Placed", "Plan", "Refuse", "Remove", "Report", "Save"]


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
    decision_seconds: list[float] = field(default_factory=list, compare=False)
    # What the step decided against (`steps` makes it): placement's memory with the plan over it.
    proposed: Proposed | None = field(default=None, compare=False, repr=False)

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
