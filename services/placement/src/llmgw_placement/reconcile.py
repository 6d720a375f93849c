"""Keeping every deployment at its replica count: what one control step decides, as a Plan.

`reconcile(snapshot, held, index, now)` is pure: no awaits, no bus. It reads one
`Snapshot` (copies taken when the step starts, so a watcher's change cannot move
under it) and what this placement holds, and for every deployment, in name order:

- fails over: a replica with any rank on a lost node is removed (`failed`) and placed
  again, whole;
- observes: a replica's state from its shards' statuses (`_observe`);
- places again a replica that failed for good because a GPU it was given is gone;
- rolls: a deployment whose profile changed gets replicas of the new profile one at a
  time, a new one ready before an old one goes where capacity allows; a replica on a
  draining node is rolled the same way, except that it never goes before its
  replacement is ready (a drain waits for room instead);
- scales up and down, to `replicas`, or to the autoscaler's count (`Snapshot.counts`)
  for a deployment with `autoscale`; a deployment whose profile is not in the catalog is
  refused and its value dead-lettered once;
- drains before it stops: a serving replica that goes (scaled down, replaced, its
  deployment deleted, its node drained) is first saved `draining`, and removed once the
  gateways say nothing is in flight on it (`Snapshot.quiet`) or its drain timed out;
- reports the deployment's status when it changed.

No single record can fail the step: a fault while converging one deployment (a value
no decision can use, whatever it is) refuses that deployment in words, once, and every
other deployment is placed and scaled in the same step; a fault on one held replica
record costs that record this step.

What it decides is taken in memory at once (`held`, and the index, so the next
decision sees GPUs taken or freed) and returned as named entries for the applier
(`apply.py`), which takes back in memory whatever did not land. `steps` is the same
walk, pausing where the control loop may write what is queued and let the event loop
run (a step that places thousands must not hold the loop until its last decision).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
from opentelemetry import trace

from llmgw_core import failures, fit
from llmgw_core.engines import Profile
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeIntent,
    NodeReason,
    NodeStatus,
    ReplicaRecord,
    ReplicaState,
    ShardStatus,
)
from llmgw_core.events import now as wall_now
from llmgw_core.subjects import Names
from llmgw_core.telemetry import context_from, current_traceparent

from .config import ServerConfig
from .decide import Placement, Refusal, decide
from .feasibility import fault_words
from .held import Held, key, replica_order
from .index import KeptIndex
from .liveness import Liveness
from .plan import DeadLetter, Place, Plan, Refuse, Remove, Report, Save

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

# Placements decided between two turns of the event loop.
YIELD_EVERY = 64


@dataclass(frozen=True)
class Snapshot:
    """What one step acts on: copies, so a watcher's change cannot move under it."""

    deployments: dict[str, Deployment]
    catalog: dict[str, Profile]
    shard_status: dict[str, ShardStatus]
    # The nodes as placement knows them, and who is alive by `liveness` at the step's time.
    nodes: dict[str, NodeStatus]
    alive: frozenset[str]
    liveness: Liveness
    config: ServerConfig
    # The deployments bucket's name, for the dead-letter subject of an unknown profile.
    deployments_bucket: str = "deployments"
    # The operator's cordons and drains, by node: a draining node's replicas are replaced.
    intents: dict[str, NodeIntent] = field(default_factory=dict)
    # The model files each node's launcher reports missing.
    missing_models: dict[str, frozenset[str]] = field(default_factory=dict)
    # The count the autoscaler chose, by autoscaled deployment (in place of `replicas`).
    counts: dict[str, int] = field(default_factory=dict)
    # Draining replicas (by key) that every gateway heard from says have nothing in flight.
    quiet: frozenset[str] = frozenset()


def reconcile(snapshot: Snapshot, held: Held, index: KeptIndex, now: float) -> Plan:
    """The whole step's plan (see the module's docstring)."""
    plan = Plan()
    for _ in steps(snapshot, held, index, now, plan):
        pass
    return plan


def steps(snapshot: Snapshot, held: Held, index: KeptIndex, now: float, plan: Plan) -> Iterator[bool]:
    """`reconcile`, filling `plan`, pausing (yielding) after each entry it queued: the caller
    may write and tell what `plan` holds then (and take it out), or go on. It yields True
    every YIELD_EVERY placements: the caller lets the event loop run then."""
    walk = _Walk(snapshot, held, index, now, plan)
    yield from walk.run()


class _Walk:
    def __init__(self, snapshot: Snapshot, held: Held, index: KeptIndex, now: float, plan: Plan) -> None:
        self.snap = snapshot
        self.held = held
        self.index = index
        self.now = now
        self.plan = plan
        self.config = snapshot.config
        # Deployments placed in this step (their last decision is a placement now), and the
        # reasons of those refused in this step.
        self.placed: Counter[str] = Counter()
        self.refused: dict[str, tuple[NodeReason, ...]] = {}

    def run(self) -> Iterator[bool]:
        held, snap, plan = self.held, self.snap, self.plan
        for k in sorted(held.replicas):
            try:
                yield from self._held_replica(k)
            except Exception:
                # The record stays as held; the next step tries it again.
                log.exception("replica %s: this step cannot act on it", k)
        held.unwritten.clear()  # what is left names replicas removed since
        for name in sorted(set(held.statuses) - set(snap.deployments)):
            held.decisions.pop(name, None)
            plan.reports.append(
                Report(
                    DeploymentStatus(deployment=name, desired=0, summary=f"{name}: deleted", at=wall_now()),
                    gone=True,
                )
            )
        for name in sorted(snap.deployments):
            yield from self._converge_or_refuse(snap.deployments[name])

    def _held_replica(self, k: str) -> Iterator[bool]:
        """A held replica whose deployment is gone is retired; one still `placing` is written
        again as planned, or removed to be placed anew."""
        held, snap, plan = self.held, self.snap, self.plan
        record = held.replicas.get(k)
        if record is None:
            return
        if record.deployment not in snap.deployments:
            held.unwritten.pop(k, None)
            if record.state == "placing":
                self._remove(record, "deployment deleted")
            else:
                self._retire(record, "deployment deleted")
            yield False
        elif record.state == "placing":
            planned = held.unwritten.pop(k, None)
            if planned is not None and planned.record is record:
                plan.placed.append(planned)  # written again, as it was planned
                return
            # Its shards were not all written (a fault mid-commit): start it again.
            self._remove(record, "placement was interrupted; placing it again")
            yield False

    def _converge_or_refuse(self, dep: Deployment) -> Iterator[bool]:
        """`_converge`, or where it faults, the deployment refused in words (told once: the
        refusal's reasons are the same in the next step), every other one going on."""
        try:
            yield from self._converge(dep)
        except Exception as exc:
            words = f"placement cannot place or scale deployment {dep.name}: {fault_words(exc)}"
            last = self.held.decisions.get(dep.name)
            if last is None or [r.reason for r in last.reasons] != [words]:
                log.exception("%s", words)
            self._refuse(dep, Refusal((("-", words),)), replica="-")
            try:
                mine = [r for r in self.held.replicas.values() if r.deployment == dep.name]
                self._report(dep, mine, refused=True, reasons=self._refused_reasons(dep))
            except Exception:  # its report faults too: the refusal (event, explain) says it
                log.debug("deployment %s: no status this step", dep.name, exc_info=True)
            yield False

    # --- one deployment ---------------------------------------------------------------

    def _converge(self, dep: Deployment) -> Iterator[bool]:
        held = self.held
        profile = self.snap.catalog.get(dep.profile)
        mine = sorted((r for r in held.replicas.values() if r.deployment == dep.name), key=replica_order)
        # Failover: a replica with any rank on a lost node is placed again, whole.
        for record in mine:
            lost = sorted({m.node for m in record.members} - self.snap.alive)
            if lost:
                self._remove(record, f"node {', '.join(lost)} lost", state="failed")
                yield False
        mine = [r for r in mine if key(r) in held.replicas]
        # Replicas whose `ready` is seen in this step: written after this step's removals
        # (the applier commits removals first), so an old replica removed now for one of them
        # would leave a moment with neither ready in the bucket. They count as in flight.
        just_ready: set[str] = set()
        for record in mine:
            # One still to be written has nothing to observe.
            if record.state not in ("placing", "draining") and self._observe(record):
                if record.state != "ready" and held.replicas[key(record)].state == "ready":
                    just_ready.add(key(record))
                yield False
        # A replica that failed for good because a GPU it was given is not on its node (a
        # replacement machine with fewer GPUs under the same node id) is placed again, by
        # what the node reports it has now; left alone it would stay failed forever.
        # So is one that failed on a node now unfit for its profile by what the node reported
        # since: the model file it lacks (its heartbeats say so), or a model whose shape it read
        # when staged and that the shard's GPUs cannot hold (its facts carry the shape). The
        # decision then places the replica on a node that fits, or says every node's figures.
        for record in mine:
            now_held = held.replicas[key(record)]
            gone = self._gpus_gone(now_held) or self._node_unfit(now_held)
            if gone:
                self._remove(held.replicas[key(record)], gone, state="failed")
                yield False
        mine = [r for r in mine if key(r) in held.replicas]
        mine = [held.replicas[key(r)] for r in mine]
        if profile is None:
            yield from self._unknown_profile(dep)
            self._report(dep, mine, refused=True, reasons=self._refused_reasons(dep))
            return
        held.told_unknown.pop(dep.name, None)
        fp = profile.fingerprint()
        wanted = self._wanted(dep)
        # Replicas draining: each goes once nothing is in flight on it (or its drain timed out);
        # meanwhile it serves what it has, so a roll waits for it (never at zero).
        leaving = [r for r in mine if r.state == "draining"]
        for record in leaving:
            if self._retire(record, record.reason.removeprefix("draining: ")):
                yield False
        mine = [r for r in mine if r.state != "draining"]
        leaving = [r for r in leaving if key(r) in held.replicas]
        drained = {key(r): nodes for r in mine if (nodes := self._draining(r))}
        current = [r for r in mine if r.profile_fp == fp and key(r) not in drained]
        stale = [r for r in mine if r.profile_fp != fp or key(r) in drained]
        in_flight = bool(leaving) or any(r.state != "ready" or key(r) in just_ready for r in current)
        if stale:
            # Roll one replica at a time: a new one ready before an old one goes,
            # where capacity allows; else one old one goes first.
            refused: Refusal | None = None
            blocked = ""
            if in_flight:
                pass
            elif len(current) + len(stale) > wanted:
                victim = _pick_to_remove(stale)
                on = drained.get(key(victim))
                self._retire(
                    victim,
                    f"node {on} draining: replaced by a replica placed elsewhere"
                    if on
                    else "replaced by a replica of the new profile",
                )
            else:
                refused = self._place(dep, profile, fp)
                if refused is not None:
                    yield False
                    # No room for a new one first. Only if the new profile fits once
                    # an old replica is gone does that replica go; a profile that fits
                    # nowhere must not take the serving replicas down with it.
                    victim = _pick_to_remove(stale)
                    # A drain never stops a replica before its replacement is ready.
                    if key(victim) not in drained and self._fits_without(victim, dep, profile):
                        self._retire(victim, "replaced in place: no room for a new replica first")
                    else:
                        blocked = _blocked(stale, drained, fp)
            yield False
            self._report(
                dep,
                mine + leaving,
                refused=refused is not None,
                reasons=self._refused_reasons(dep),
                blocked=blocked,
            )
            return
        missing = wanted - len(current)
        # Demand came back while replicas drain for a scale down: they serve on, none placed anew.
        for record in leaving:
            if missing <= 0 or not record.reason.startswith("draining: scaled down"):
                continue
            self._save(
                msgspec.structs.replace(
                    record,
                    state="ready" if record.url else "starting",
                    reason="",
                    since=wall_now(),
                    updated_at=wall_now(),
                )
            )
            self.held.draining.pop(key(record), None)
            missing -= 1
            yield False
        refusal: Refusal | None = None
        for placed in range(missing):
            if placed % YIELD_EVERY == YIELD_EVERY - 1:
                # Let heartbeats and statuses in between decisions.
                yield True
            refusal = self._place(dep, profile, fp, missing - placed)
            yield False
            if refusal is not None:
                break
        for record in sorted(current, key=replica_order, reverse=True)[: max(0, -missing)]:
            self._retire(record, f"scaled down to {wanted}")
            yield False
        if refusal is None:
            # Nothing is missing: an earlier refusal no longer says anything about it.
            last = held.decisions.get(dep.name)
            if last is not None and last.outcome == "refused" and not self.placed[dep.name]:
                del held.decisions[dep.name]
        self._report(dep, mine + leaving, refused=refusal is not None, reasons=self._refused_reasons(dep))

    def _wanted(self, dep: Deployment) -> int:
        """The count to keep: the autoscaler's choice where the deployment follows demand."""
        if dep.autoscale is None:
            return dep.replicas
        return self.snap.counts.get(dep.name, dep.autoscale.min_replicas)

    def _draining(self, record: ReplicaRecord) -> str:
        """The draining nodes a replica has a rank on (`n1, n2`), else ""."""
        intents = self.snap.intents
        return ", ".join(
            sorted({m.node for m in record.members if (i := intents.get(m.node)) is not None and i.drain})
        )

    def _refused_reasons(self, dep: Deployment) -> tuple[NodeReason, ...]:
        """The reasons of the deployment's last refusal: this step's, else the one held."""
        if dep.name in self.refused:
            return self.refused[dep.name]
        last = self.held.decisions.get(dep.name)
        if last is not None and last.outcome == "refused" and not self.placed[dep.name]:
            return last.reasons
        return ()

    def _place(self, dep: Deployment, profile: Profile, fp: str, wanted: int = 1) -> Refusal | None:
        """Decide one new replica: queue it (its GPUs taken in the index), or its refusal."""
        held, index = self.held, self.index
        # Nothing a refusal depends on moved since the last one: it still holds, and
        # deciding again would cost a pass over every node for the same answer.
        refused = held.refused.get(dep.name)
        if refused == (index.id, index.index.generation, fp, dep.pool, dep.strategy):
            last = held.decisions.get(dep.name)
            return Refusal(tuple((r.node, r.reason) for r in last.reasons) if last is not None else ())
        fabric_hcas = {name: fc.hcas for name, fc in self.config.fabrics.items()}
        started = time.perf_counter()
        decision = decide(
            dep, profile, index.index, fabric_hcas=fabric_hcas, port_range=self.config.dist_port_range
        )
        self.plan.decision_seconds.append(time.perf_counter() - started)
        if isinstance(decision, Refusal):
            held.refused[dep.name] = (index.id, index.index.generation, fp, dep.pool, dep.strategy)
            self._refuse(dep, decision, wanted=wanted)
            return decision
        held.refused.pop(dep.name, None)
        multi = len(decision.members) > 1
        for a in decision.members:
            index.take(a.node, a.gpus, a.port if multi else None, dep.name, profile.staged_key)
        self.plan.places.append(Place(dep, profile, fp, decision, wanted))
        self.placed[dep.name] += 1
        return None

    def _refuse(self, dep: Deployment, refusal: Refusal, *, replica: str = "", wanted: int = 1) -> None:
        previous = self.held.decisions.get(dep.name)
        reasons = tuple(NodeReason(node=n, reason=r) for n, r in refusal.reasons)
        tell = (
            previous is None
            or previous.outcome != "refused"
            or previous.reasons != reasons
            or bool(self.placed[dep.name])
        )
        self.refused[dep.name] = reasons
        self.plan.refusals.append(Refuse(dep.name, refusal, replica=replica, wanted=wanted, tell=tell))

    def _unknown_profile(self, dep: Deployment) -> Iterator[bool]:
        """A deployment naming no profile of the catalog: refused (once), and its value copied to
        the DLQ once, so whoever wrote it can see why. It is placed when the profile appears."""
        self._refuse(dep, Refusal((("-", f"profile {dep.profile} is not in the catalog"),)), replica="-")
        if self.held.told_unknown.get(dep.name) != dep:
            self.held.told_unknown[dep.name] = dep
            self.plan.dead_letters.append(
                DeadLetter(
                    Names.kv_subject(self.snap.deployments_bucket, dep.name),
                    msgspec.json.encode(dep),
                    f"deployment {dep.name}: profile {dep.profile} is not in the catalog "
                    f"({', '.join(sorted(self.snap.catalog)) or 'the catalog is empty'})",
                )
            )
        yield False

    def _report(
        self,
        dep: Deployment,
        observed: list[ReplicaRecord],
        *,
        refused: bool,
        reasons: tuple[NodeReason, ...],
        blocked: str = "",
    ) -> None:
        """The deployment's desired, ready, pending and unplaceable counts, with the refusal
        that keeps some from being placed (or a roll or drain from proceeding: `blocked`, with
        every node's reason), when any of them changed."""
        held = self.held
        keys = {key(r) for r in observed}
        records = [held.replicas[k] for k in keys if k in held.replicas]
        # Placed in this step (not observed yet): placing.
        placed_now = self.placed[dep.name] + sum(
            1 for p in self.plan.placed if p.record.deployment == dep.name and key(p.record) not in keys
        )
        ready = sum(1 for r in records if r.state == "ready")
        pending = len(records) + placed_now - ready
        wanted = self._wanted(dep)
        unplaceable = max(0, wanted - len(records) - placed_now) if refused else 0
        reasons = reasons if refused else ()
        parts = [f"{dep.name}: {ready} of {wanted} ready"]
        if pending:
            states = Counter(r.state for r in records if r.state != "ready")
            if placed_now:
                states["placing"] += placed_now
            parts.append(", ".join(f"{n} {state}" for state, n in sorted(states.items())))
            # Why the first replicas still starting are not ready (a few, in replica order).
            waiting = [r for r in sorted(records, key=replica_order) if r.state == "starting" and r.reason]
            parts += [f"{r.replica}: {r.reason}" for r in waiting[:3]]
        if unplaceable:
            parts.append(f"{unplaceable} cannot be placed: {_reasons_text(reasons)}")
        if blocked:
            blocked = f"{blocked}: {_reasons_text(reasons)}"
            parts.append(blocked)
        if dep.autoscale is not None:
            a = dep.autoscale
            scaled = held.scaled.get(dep.name)
            parts.append(
                f"following demand, {a.min_replicas} to {a.max_replicas} replicas"
                + (f", last {scaled.reason}" if scaled is not None else "")
            )
        status = DeploymentStatus(
            deployment=dep.name,
            desired=wanted,
            ready=ready,
            pending=pending,
            unplaceable=unplaceable,
            summary="; ".join(parts),
            reasons=reasons,
            at=wall_now(),
            blocked=blocked,
        )
        previous = held.statuses.get(dep.name)
        if previous is not None and msgspec.structs.replace(previous, at=status.at) == status:
            return
        self.plan.reports.append(Report(status))

    # --- replicas held ---------------------------------------------------------------

    def _remove(self, record: ReplicaRecord, why: str, state: ReplicaState = "stopping") -> None:
        """Forget the replica now (its GPUs are free for the next decision) and queue its deletes."""
        log.info("removing %s/%s: %s", record.deployment, record.replica, why)
        held = self.held
        held.replicas.pop(key(record), None)
        held.draining.pop(key(record), None)
        specs = {k: spec for k in record.shards if (spec := held.shards.pop(k, None)) is not None}
        for spec in specs.values():
            self.index.remove(spec)
        self.plan.removals.append(Remove(record, specs, why, state))

    def _retire(self, record: ReplicaRecord, why: str) -> bool:
        """Drain a replica before it goes: its record says `draining` (gateways send it nothing
        new); it is removed once every gateway heard from says nothing is in flight on it, or
        after drain_timeout_s. One that never served (not ready) goes at once. Whether it was
        removed now."""
        k = key(record)
        held = self.held
        if record.state != "draining":
            if record.state not in ("ready", "unknown"):
                self._remove(record, why)
                return True
            held.draining[k] = self.now
            self._save(
                msgspec.structs.replace(
                    record,
                    state="draining",
                    reason=f"draining: {why}",
                    since=wall_now(),
                    updated_at=wall_now(),
                )
            )
            log.info("draining %s/%s: %s", record.deployment, record.replica, why)
            return False
        # Draining since a leader that is not this one: its drain starts over here.
        since = held.draining.setdefault(k, self.now)
        timeout = self.config.autoscaler.drain_timeout_s
        if k in self.snap.quiet:
            held.draining.pop(k, None)
            self._remove(record, f"{why}; drained")
            return True
        if self.now - since >= timeout:
            held.draining.pop(k, None)
            self._remove(record, f"{why}; drain timed out after {timeout:g} s with requests in flight")
            return True
        return False

    def _save(self, record: ReplicaRecord) -> None:
        """Take a replica's new record in memory now, and queue its write."""
        k = key(record)
        self.plan.saves.append(Save(self.held.replicas.get(k), record, current_traceparent()))
        self.held.replicas[k] = record

    def _gpus_gone(self, record: ReplicaRecord) -> str:
        """Why a replica that failed for good holds GPUs its node no longer has, else ""."""
        if record.state != "failed":
            return ""
        for k in record.shards:
            spec = self.held.shards.get(k)
            status = self.snap.nodes.get(spec.node) if spec is not None else None
            if spec is None or status is None:
                continue
            have = sorted(g.index for g in status.facts.gpus)
            missing = [i for i in spec.gpus if i not in have]
            if missing:
                plural = "s" if len(missing) > 1 else ""
                return (
                    f"GPU{plural} {', '.join(map(str, missing))} no longer on node {spec.node} "
                    f"(it reports {len(have)} GPU{'' if len(have) == 1 else 's'}"
                    f"{': ' + ', '.join(map(str, have)) if have else ''})"
                )
        return ""

    def _node_unfit(self, record: ReplicaRecord) -> str:
        """Why a replica that failed for good is on a node now unfit for its profile, else "":
        the node reports the model file missing (`node-b: model file not found: /models/x.gguf`),
        or the model's shape is known now and the GPUs the shard was given (for a CPU profile,
        the node's memory) cannot hold it, by the rule `unfit` applies (`gpu-a: needs ~41.2 GiB
        per GPU (…), L40S-48G has 44.5 GiB usable`)."""
        if record.state != "failed":
            return ""
        for k in record.shards:
            spec = self.held.shards.get(k)
            if spec is None:
                continue
            profile = spec.profile
            path = profile.node_file
            if path and path in self.snap.missing_models.get(spec.node, ()):
                return f"{spec.node}: model file not found: {path}"
            status = self.snap.nodes.get(spec.node)
            shape = self.index.shapes.get(profile.weights_key)
            if status is None or shape is None:
                continue
            gpus = [g for g in status.facts.gpus if g.index in spec.gpus]
            try:
                too_big = fit.check_shard(shape, profile, gpus, status.facts.memory_mb)
            except fit.FitError as exc:
                # A shape or a reported memory no estimate can use: placed again, the replica
                # is refused on every node in these words (`unfit` says the same).
                too_big = f"model {profile.weights_key or profile.model_path}: {exc}"
            if too_big:
                return f"{spec.node}: {too_big}"
        return ""

    def _fits_without(self, record: ReplicaRecord, dep: Deployment, profile: Profile) -> bool:
        usage = self.index.usage.copy()
        for k in record.shards:
            spec = self.held.shards.get(k)
            if spec is not None:
                usage.remove(spec)
        views = self.index.views(self.now, usage)
        fabric_hcas = {name: fc.hcas for name, fc in self.config.fabrics.items()}
        decision = decide(
            dep, profile, views, fabric_hcas=fabric_hcas, port_range=self.config.dist_port_range
        )
        return isinstance(decision, Placement)

    def _observe(self, record: ReplicaRecord) -> bool:
        """A replica's state from its shards: ready only when every shard is and the leader answered.
        Whether its record changed (queued to be saved).

        A shard whose launcher has gone silent reported what it saw then, not
        now: the replica's readiness is `unknown` until the launcher is heard
        again (or the node is declared lost and the replica placed elsewhere).
        An `unknown` replica whose shards were last heard ready keeps its URL:
        the gateway sends to it when no replica is known ready, so a launcher
        restart (its engines serving on) costs no request.
        """
        at = self.now
        liveness = self.snap.liveness
        statuses = [self.snap.shard_status.get(k) for k in record.shards]
        url = ""
        state: ReplicaState
        reason = ""
        failed = [s for s in statuses if s is not None and s.state == "failed"]
        silent = sorted({m.node for m in record.members if liveness.launcher_stale(m.node, at)})
        last_ready = bool(statuses) and all(
            s is not None and s.state == "ready" and s.profile_fp == record.profile_fp for s in statuses
        )
        if silent:
            state = "unknown"
            reason = f"launcher on {', '.join(silent)} silent: readiness unknown"
            if all(liveness.installer_heard(n, at) for n in silent):
                reason += (
                    f"; its installer still beats (an agent restart?): its engines are routed to for up "
                    f"to launcher_grace_s ({self.config.launcher_grace_s:g} s) before it fails over"
                )
            if last_ready and statuses[0] is not None:
                url = statuses[0].url
        elif failed:
            state = "failed" if any(not s.retryable for s in failed) else "degraded"
            reason = "; ".join(f"{s.node}/{s.shard}: {failures.reason_line(s)}" for s in failed)
        elif last_ready:
            leader = statuses[0]
            assert leader is not None
            url = leader.url
            state = "ready" if url else "starting"
        else:
            state = "starting"
        # Restarts and the last failure, as the launchers keep them: the failure stays
        # until the replica is ready again, so a retry never hides why it is retrying.
        known = [s for s in statuses if s is not None]
        restarts = sum(s.restarts for s in known)
        last = max(known, key=lambda s: s.last_failure_at, default=None)
        last_failure = last.last_failure if last is not None and state != "ready" else ""
        failure = failures.failure_of(last) if last is not None and state != "ready" else None
        if state == "starting" and failure is not None:
            reason = failures.retrying(restarts + 1, failure)
        elif state == "starting":
            # What its shards wait for, in their nodes' words: the weights staging with its
            # progress (`n1: weights qwen@a1b2c3: downloading m.gguf (38%, 5.1 of 13.4 GB)`).
            reason = "; ".join(f"{s.node}: {s.reason}" for s in known if s.state == "waiting" and s.reason)
        if (state, reason, url, restarts, last_failure, failure) == (
            record.state,
            record.reason,
            record.url,
            record.restarts,
            record.last_failure,
            record.failure,
        ):
            return False
        changed = msgspec.structs.replace(
            record,
            state=state,
            reason=reason,
            url=url,
            restarts=restarts,
            last_failure=last_failure,
            failure=failure,
            since=record.since if state == record.state and record.since else wall_now(),
            updated_at=wall_now(),
        )
        if state == record.state:
            self._save(changed)
            return True
        # A change of state continues the replica's trace (from `ctl deploy` through its
        # placement and its shards' starts), so its `ready` is not a trace of its own.
        spec = self.held.shards.get(record.shards[0]) if record.shards else None
        with tracer.start_as_current_span(
            f"replica {record.deployment}/{record.replica} {state}",
            context=context_from(spec.traceparent if spec is not None else ""),
            attributes={"llmgw.deployment": record.deployment, "llmgw.replica": record.replica},
        ):
            self._save(changed)
        return True


def _reasons_text(reasons: tuple[NodeReason, ...], limit: int = 5) -> str:
    """`node-a 0 of 2 GPUs free, node-b lost: …` for a few nodes, counted past `limit`."""
    return Refusal(tuple((r.node, r.reason) for r in reasons)).summary(limit) if reasons else "no nodes known"


def _blocked(stale: list[ReplicaRecord], drained: dict[str, str], fp: str) -> str:
    """Why a roll cannot proceed, the replicas serving on meanwhile: a profile change that no
    node fits, or a drain with nowhere to go (every node's reason follows in the summary)."""
    said = []
    if any(r.profile_fp != fp for r in stale):
        said.append("rolling update blocked: no node fits the new profile")
    nodes = sorted({n for r in stale if (on := drained.get(key(r))) for n in on.split(", ")})
    if nodes:
        said.append(f"drain of {', '.join(nodes)} blocked: no other node fits")
    return "; ".join(said)


def _pick_to_remove(stale: list[ReplicaRecord]) -> ReplicaRecord:
    """A replica that is not ready goes before one that serves; then the oldest."""
    return sorted(stale, key=lambda r: (r.state == "ready", replica_order(r)))[0]
