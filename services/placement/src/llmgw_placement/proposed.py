"""What one control step decides against: what placement holds, with the step's plan on top.

Placement decides as Nomad's scheduler does, against a snapshot plus the plan's own
proposed allocations (`ProposedAllocs`): `Proposed` is `Held` and the kept node index
with this step's decisions over them. `reconcile` reads and changes the overlay only;
what placement holds changes only from writes the bus acknowledged:

- `removed`, `placed`, `saved`: a commit landed; its entries are taken into `Held` (and
  into the overlay, where a placement's record is now `starting`);
- `settle`: the step's every write landed; the overlay's memory of decisions, refusals,
  drains and dead letters is taken, and the working index becomes the kept one;
- `drop`: the step failed; the overlay is dropped, and the kept index takes only the
  shards whose writes landed. Nothing decided and not written is held, so nothing needs
  taking back: no GPU is freed or held in memory that the store does not say.

Placements named whose writes did not land are `Held.unwritten`: the next step's overlay
starts with them (their GPUs taken first) and writes them again with the same ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import Deployment, PlacementDecision, ReplicaRecord

from .config import ServerConfig
from .decide import Decision, Placement, Refusal, decide
from .entries import Placed, Remove, Save
from .held import Held, key
from .index import KeptIndex


@dataclass
class Proposed:
    held: Held
    kept: KeptIndex
    # What the step sees: copies of what `held` has, changed by the step's decisions.
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    draining: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, PlacementDecision] = field(default_factory=dict)
    refused: dict[str, tuple[int, int, str, str, str]] = field(default_factory=dict)
    told_unknown: dict[str, Deployment] = field(default_factory=dict)
    unwritten: dict[str, Placed] = field(default_factory=dict)
    # The step's own index, made at its first change (until then, decisions read the kept one).
    fork: KeptIndex | None = None
    # The shards whose writes landed in this step, in order (taken, or freed): what the kept
    # index takes should the step fail (had it succeeded, it takes the fork whole).
    landed: list[tuple[bool, ShardSpec]] = field(default_factory=list)

    @classmethod
    def over(cls, held: Held, kept: KeptIndex) -> Proposed:
        """The overlay of a step that starts now: nothing decided yet but the placements of
        earlier steps that were named and not written, taken first."""
        p = cls(
            held,
            kept,
            replicas=dict(held.replicas),
            shards=dict(held.shards),
            draining=dict(held.draining),
            decisions=dict(held.decisions),
            refused=dict(held.refused),
            told_unknown=dict(held.told_unknown),
            unwritten=dict(held.unwritten),
        )
        for k, placed in sorted(held.unwritten.items()):
            p.replicas[k] = placed.record
            for shard, spec in zip(placed.record.shards, placed.specs, strict=False):
                p.shards[shard] = spec
                p.changing().add(spec)
        return p

    @property
    def index(self) -> KeptIndex:
        """The index decisions read: the step's own once it changed anything."""
        return self.fork if self.fork is not None else self.kept

    def changing(self) -> KeptIndex:
        if self.fork is None:
            self.fork = self.kept.fork()
        return self.fork

    # --- the step's decisions -----------------------------------------------------------

    def remove(self, record: ReplicaRecord) -> dict[str, ShardSpec]:
        """A replica removed in this step: its GPUs free for the next decision; its specs."""
        k = key(record)
        self.replicas.pop(k, None)
        self.draining.pop(k, None)
        specs = {s: spec for s in record.shards if (spec := self.shards.pop(s, None)) is not None}
        for spec in specs.values():
            self.changing().remove(spec)
        return specs

    def named(self, placed: Placed) -> None:
        """A placement given its id: the rest of the step sees its record `placing`."""
        self.replicas[key(placed.record)] = placed.record
        self.shards.update(zip(placed.record.shards, placed.specs, strict=False))
        self.decisions[placed.record.deployment] = placed.decision

    def still_refused(self, dep: Deployment, fp: str) -> Refusal | None:
        """The deployment's last refusal, where nothing it was decided against has moved since
        (the index, the profile, the pool, the strategy), else None."""
        index = self.index
        if self.refused.get(dep.name) != (index.id, index.index.generation, fp, dep.pool, dep.strategy):
            return None
        last = self.decisions.get(dep.name)
        return Refusal.of(last.reasons if last is not None else ())

    def decide(self, dep: Deployment, profile: Profile, fp: str, config: ServerConfig) -> Decision:
        """One new replica of `dep` over the step's index: placed (its GPUs and port taken for
        the next decision), or refused (remembered with what it was decided against)."""
        index = self.index
        fabric_hcas = {name: fc.hcas for name, fc in config.fabrics.items()}
        port_range = config.dist_port_range
        decision = decide(dep, profile, index.index, fabric_hcas=fabric_hcas, port_range=port_range)
        if isinstance(decision, Refusal):
            self.refused[dep.name] = (index.id, index.index.generation, fp, dep.pool, dep.strategy)
            return decision
        self.refused.pop(dep.name, None)
        multi, taking = len(decision.members) > 1, self.changing()
        for a in decision.members:
            taking.take(a.node, a.gpus, a.port if multi else None, dep.name, profile.staged_key)
        return decision

    def fits_without(
        self, record: ReplicaRecord, dep: Deployment, profile: Profile, at: float, config: ServerConfig
    ) -> bool:
        """Whether a new replica of `dep` would fit were `record`'s GPUs free (nothing is taken)."""
        index = self.index
        usage = index.usage.copy()
        for k in record.shards:
            spec = self.shards.get(k)
            if spec is not None:
                usage.remove(spec)
        fabric_hcas = {name: fc.hcas for name, fc in config.fabrics.items()}
        decision = decide(
            dep, profile, index.views(at, usage), fabric_hcas=fabric_hcas, port_range=config.dist_port_range
        )
        return isinstance(decision, Placement)

    # --- acknowledged writes ------------------------------------------------------------

    def removed(self, removals: Iterable[Remove]) -> None:
        """Removals whose deletes landed."""
        held = self.held
        for removal in removals:
            k = key(removal.record)
            held.replicas.pop(k, None)
            held.draining.pop(k, None)
            held.unwritten.pop(k, None)
            for s, spec in removal.specs.items():
                if held.shards.pop(s, None) is not None:
                    self.landed.append((False, spec))

    def placed(self, written: Iterable[tuple[Placed, ReplicaRecord]]) -> None:
        """Placements whose shards and records landed, each with the record written (`starting`)."""
        held = self.held
        for placed, starting in written:
            k = key(placed.record)
            held.replicas[k] = starting
            held.unwritten.pop(k, None)
            held.decisions[placed.record.deployment] = placed.decision
            for s, spec in zip(placed.record.shards, placed.specs, strict=False):
                held.shards[s] = spec
                self.landed.append((True, spec))
            if self.replicas.get(k) is placed.record:
                self.replicas[k] = starting

    def saved(self, saves: Iterable[Save]) -> None:
        """Changes of replicas' records that landed."""
        held = self.held
        for save in saves:
            k = key(save.after)
            held.replicas[k] = save.after
            if save.after.state != "draining":
                held.draining.pop(k, None)
            elif k in self.draining:
                held.draining[k] = self.draining[k]

    def settle(self) -> None:
        """Every write of the step landed: what it remembers is placement's now."""
        held = self.held
        held.draining = self.draining
        held.decisions = self.decisions
        held.refused = self.refused
        held.told_unknown = self.told_unknown
        if self.fork is not None:
            self.kept.adopt(self.fork)
        self.fork = None
        self.landed = []

    def drop(self) -> None:
        """The step failed: the kept index takes the shards whose writes landed, and only those."""
        for taken, spec in self.landed:
            if taken:
                self.kept.add(spec)
            else:
                self.kept.remove(spec)
        self.fork = None
        self.landed = []
