"""Keeping every deployment at its replica count: what one control step decides, as a Plan.

`reconcile(snapshot, held, index, now)` is pure: no awaits, no bus, and it changes none
of its inputs. It reads one `Snapshot` (copies taken when the step starts, so a
watcher's change cannot move under it, and the step's wall-clock time) and what this
placement holds, and for every deployment, in name order:

- fails over: a replica with any rank on a lost node is removed (`failed`) and placed
  again, whole;
- observes: a replica's state from its shards' statuses (`observe.py`);
- places again a replica holding a GPU its node no longer reports;
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

It decides against what placement holds with this step's plan over it (`Plan.proposed`,
`proposed.py`: the next decision sees the GPUs taken or freed before it) and returns
named entries for the applier (`apply.py`); placement's memory takes only what the bus
acknowledged. The same snapshot, held replicas and index give the same plan. `steps` is
the same walk, pausing where the control loop may write what is queued and let the event
loop run (a step that places thousands must not hold the loop until its last decision).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
from opentelemetry import trace

from llmgw_core import failures
from llmgw_core.adapters import adapter_quotas
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, NodeReason, ReplicaRecord, ReplicaState
from llmgw_core.telemetry import context_from, current_traceparent

from .decide import Refusal
from .feasibility import Reason, fault_words
from .held import Held, key, replica_order
from .index import KeptIndex
from .judged import judged, restart_words
from .observe import observe, replace_words
from .plan import Place, Plan, Refuse, Remove, Report, Save
from .proposed import Proposed
from .snapshot import Snapshot
from .status import blocked_words, deleted_status, deployment_status, unknown_profile_letter

__all__ = ["YIELD_EVERY", "Snapshot", "reconcile", "steps"]

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

# Placements decided between two turns of the event loop.
YIELD_EVERY = 64


def reconcile(snapshot: Snapshot, held: Held, index: KeptIndex, now: float) -> Plan:
    """The whole step's plan (see the module's docstring); `held` and `index` are left as they are."""
    plan = Plan()
    for _ in steps(snapshot, held, index, now, plan):
        pass
    return plan


def steps(snapshot: Snapshot, held: Held, index: KeptIndex, now: float, plan: Plan) -> Iterator[bool]:
    """`reconcile`, filling `plan`, pausing (yielding) after each entry it queued: the caller
    may write and tell what `plan` holds then (and take it out), or go on. It yields True
    every YIELD_EVERY placements: the caller lets the event loop run then. It decides
    against `plan.proposed` (made over `held` and `index` if `plan` has none yet)."""
    walk = _Walk(snapshot, held, index, now, plan)
    yield from walk.run()


class _Walk:
    def __init__(self, snapshot: Snapshot, held: Held, index: KeptIndex, now: float, plan: Plan) -> None:
        self.snap = snapshot
        self.held = held
        # What the step decides against, and all it changes: `held` and `index` stay as they are.
        self.p = plan.proposed if plan.proposed is not None else Proposed.over(held, index)
        plan.proposed = self.p
        self.now = now
        self.plan = plan
        self.config = snapshot.config
        # Deployments placed in this step (their last decision is a placement now), and the
        # reasons of those refused in this step.
        self.placed: Counter[str] = Counter()
        self.refused: dict[str, tuple[NodeReason, ...]] = {}

    def run(self) -> Iterator[bool]:
        p, snap, plan = self.p, self.snap, self.plan
        for k in sorted(p.replicas):
            try:
                yield from self._held_replica(k)
            except Exception:
                # The record stays as held; the next step tries it again.
                log.exception("replica %s: this step cannot act on it", k)
        p.unwritten.clear()  # what is left names replicas removed since
        for name in sorted(set(self.held.statuses) - set(snap.deployments)):
            p.decisions.pop(name, None)
            plan.reports.append(Report(deleted_status(name, snap.wall), gone=True))
        for name in sorted(snap.deployments):
            yield from self._converge_or_refuse(snap.deployments[name])

    def _held_replica(self, k: str) -> Iterator[bool]:
        """A held replica whose deployment is gone is retired; one still `placing` is written
        again as planned, or removed to be placed anew."""
        p, snap, plan = self.p, self.snap, self.plan
        record = p.replicas.get(k)
        if record is None:
            return
        if record.deployment not in snap.deployments:
            p.unwritten.pop(k, None)
            if record.state == "placing":
                self._remove(record, "deployment deleted")
            else:
                self._retire(record, "deployment deleted")
            yield False
        elif record.state == "placing":
            planned = p.unwritten.pop(k, None)
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
            last = self.p.decisions.get(dep.name)
            if last is None or [r.reason for r in last.reasons] != [words]:
                log.exception("%s", words)
            self._refuse(dep, Refusal((("-", Reason(words, failures.FAULT)),)), replica="-")
            try:
                mine = [r for r in self.p.replicas.values() if r.deployment == dep.name]
                self._report(dep, mine, refused=True, reasons=self._refused_reasons(dep))
            except Exception:  # its report faults too: the refusal (event, explain) says it
                log.debug("deployment %s: no status this step", dep.name, exc_info=True)
            yield False

    # --- one deployment ---------------------------------------------------------------

    def _converge(self, dep: Deployment) -> Iterator[bool]:
        p = self.p
        profile = self.snap.catalog.get(dep.profile)
        mine = sorted((r for r in p.replicas.values() if r.deployment == dep.name), key=replica_order)
        # Failover: a replica with any rank on a lost node is placed again, whole.
        for record in mine:
            lost = sorted({m.node for m in record.members} - self.snap.alive)
            if lost:
                self._remove(record, f"node {', '.join(lost)} lost", state="failed")
                yield False
        mine = [r for r in mine if key(r) in p.replicas]
        # Replicas whose `ready` is seen in this step: written after this step's removals
        # (the applier commits removals first), so an old replica removed now for one of them
        # would leave a moment with neither ready in the bucket. They count as in flight.
        just_ready: set[str] = set()
        for record in mine:
            # One still to be written has nothing to observe.
            if record.state not in ("placing", "draining") and self._observe(record):
                if record.state != "ready" and p.replicas[key(record)].state == "ready":
                    just_ready.add(key(record))
                yield False
        # A replica on GPUs or a node that can no longer run it, or judged unhealthy too long,
        # is failed whatever its state and placed again by what the node reports now
        # (`observe.replace_words`): left alone it stayed failed forever, or `ready` on no GPU.
        for record in mine:
            now_held = p.replicas[key(record)]
            marked = self.snap.unhealthy.get(key(now_held))
            restart = restart_words(now_held, marked, self.config.unhealthy_restart_s, self.now)
            gone = replace_words(now_held, p.shards, self.snap, p.index.shapes, restart)
            if gone:
                self._remove(now_held, gone, state="failed")
                yield False
        mine = [p.replicas[key(r)] for r in mine if key(r) in p.replicas]
        if profile is None:
            yield from self._unknown_profile(dep)
            self._report(dep, mine, refused=True, reasons=self._refused_reasons(dep))
            return
        p.told_unknown.pop(dep.name, None)
        fp = profile.fingerprint()
        wanted = self.snap.wanted(dep)
        # Replicas draining: each goes once nothing is in flight on it (or its drain timed out);
        # meanwhile it serves what it has, so a roll waits for it (never at zero).
        leaving = [r for r in mine if r.state == "draining"]
        for record in leaving:
            if self._retire(record, record.reason.removeprefix("draining: ")):
                yield False
        mine = [r for r in mine if r.state != "draining"]
        leaving = [r for r in leaving if key(r) in p.replicas]
        drained = {key(r): nodes for r in mine if (nodes := self.snap.draining_nodes(r))}
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
                    if key(victim) not in drained and self.p.fits_without(
                        victim, dep, profile, self.now, self.config
                    ):
                        self._retire(victim, "replaced in place: no room for a new replica first")
                    else:
                        blocked = blocked_words(stale, drained, fp)
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
                    since=self.snap.wall,
                    updated_at=self.snap.wall,
                )
            )
            p.draining.pop(key(record), None)
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
            last = p.decisions.get(dep.name)
            if last is not None and last.outcome == "refused" and not self.placed[dep.name]:
                del p.decisions[dep.name]
        self._report(dep, mine + leaving, refused=refusal is not None, reasons=self._refused_reasons(dep))

    def _refused_reasons(self, dep: Deployment) -> tuple[NodeReason, ...]:
        """The reasons of the deployment's last refusal: this step's, else the one held."""
        if dep.name in self.refused:
            return self.refused[dep.name]
        last = self.p.decisions.get(dep.name)
        if last is not None and last.outcome == "refused" and not self.placed[dep.name]:
            return last.reasons
        return ()

    def _place(self, dep: Deployment, profile: Profile, fp: str, wanted: int = 1) -> Refusal | None:
        """Decide one new replica: queue it (its GPUs taken in the step's index), or its refusal."""
        # Nothing a refusal depends on moved since the last one: it still holds, and
        # deciding again would cost a pass over every node for the same answer.
        still = self.p.still_refused(dep, fp)
        if still is not None:
            return still
        started = time.perf_counter()
        decision = self.p.decide(dep, profile, fp, self.config)
        self.plan.decision_seconds.append(time.perf_counter() - started)
        if isinstance(decision, Refusal):
            self._refuse(dep, decision, wanted=wanted)
            return decision
        self.plan.places.append(Place(dep, profile, fp, decision, wanted))
        self.placed[dep.name] += 1
        return None

    def _refuse(self, dep: Deployment, refusal: Refusal, *, replica: str = "", wanted: int = 1) -> None:
        previous = self.p.decisions.get(dep.name)
        reasons = refusal.node_reasons()
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
        unknown = Reason(f"profile {dep.profile} is not in the catalog", failures.CATALOG)
        self._refuse(dep, Refusal((("-", unknown),)), replica="-")
        if self.p.told_unknown.get(dep.name) != dep:
            self.p.told_unknown[dep.name] = dep
            self.plan.dead_letters.append(unknown_profile_letter(dep, self.snap))
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
        """The deployment's status (`status.deployment_status`), reported when it changed."""
        p = self.p
        keys = {key(r) for r in observed}
        # Placed in this step: placing, once (named mid-step, also in `plan.placed`: counted twice,
        # a scale past capacity read `1 of 6 ready; 6 placing`, none unplaceable, and no warning).
        placed_now = self.placed[dep.name]
        profile = self.snap.catalog.get(dep.profile)
        status = deployment_status(
            dep,
            [p.replicas[k] for k in keys if k in p.replicas],
            placed_now=placed_now,
            wanted=self.snap.wanted(dep),
            refused=refused,
            reasons=reasons,
            blocked=blocked,
            scaled=self.held.scaled.get(dep.name),
            at=self.snap.wall,
            quotas=adapter_quotas(profile.adapters) if profile is not None else (),
        )
        previous = self.held.statuses.get(dep.name)
        if previous is not None and msgspec.structs.replace(previous, at=status.at) == status:
            return
        self.plan.reports.append(Report(status))

    # --- replicas held ---------------------------------------------------------------

    def _remove(self, record: ReplicaRecord, why: str, state: ReplicaState = "stopping") -> None:
        """Remove the replica in the step (its GPUs free for its next decision) and queue its deletes."""
        log.info("removing %s/%s: %s", record.deployment, record.replica, why)
        self.plan.removals.append(Remove(record, self.p.remove(record), why, state))

    def _retire(self, record: ReplicaRecord, why: str) -> bool:
        """Drain a replica before it goes: its record says `draining` (gateways send it nothing
        new); it is removed once every gateway heard from says nothing is in flight on it, or
        after drain_timeout_s. One that never served (not ready) goes at once. Whether it was
        removed now."""
        k = key(record)
        draining = self.p.draining
        if record.state != "draining":
            if record.state not in ("ready", "unknown"):
                self._remove(record, why)
                return True
            draining[k] = self.now
            self._save(
                msgspec.structs.replace(
                    record,
                    state="draining",
                    reason=f"draining: {why}",
                    since=self.snap.wall,
                    updated_at=self.snap.wall,
                )
            )
            log.info("draining %s/%s: %s", record.deployment, record.replica, why)
            return False
        # Draining since a leader that is not this one: its drain starts over here.
        since = draining.setdefault(k, self.now)
        timeout = self.config.autoscaler.drain_timeout_s
        if k in self.snap.quiet:
            draining.pop(k, None)
            self._remove(record, f"{why}; drained")
            return True
        if self.now - since >= timeout:
            draining.pop(k, None)
            self._remove(record, f"{why}; drain timed out after {timeout:g} s with requests in flight")
            return True
        return False

    def _save(self, record: ReplicaRecord) -> None:
        """The replica's new record: seen by the rest of the step, and queued to be written."""
        k = key(record)
        self.plan.saves.append(Save(self.p.replicas.get(k), record, current_traceparent()))
        self.p.replicas[k] = record

    def _observe(self, record: ReplicaRecord) -> bool:
        """A replica's state from its shards (`observe.observe`): whether its record changed
        (queued to be saved)."""
        # What its shards say, with the gateways' judgement of its answers over it.
        changed = judged(
            record, observe(record, self.snap, self.now), self.snap.unhealthy.get(key(record)), self.snap.wall
        )
        if changed is None:
            return False
        if changed.state == record.state:
            self._save(changed)
            return True
        # A change of state continues the replica's trace (from `ctl deploy` through its
        # placement and its shards' starts), so its `ready` is not a trace of its own.
        spec = self.p.shards.get(record.shards[0]) if record.shards else None
        with tracer.start_as_current_span(
            f"replica {record.deployment}/{record.replica} {changed.state}",
            context=context_from(spec.traceparent if spec is not None else ""),
            attributes={"llmgw.deployment": record.deployment, "llmgw.replica": record.replica},
        ):
            self._save(changed)
        return True


def _pick_to_remove(stale: list[ReplicaRecord]) -> ReplicaRecord:
    """A replica that is not ready goes before one that serves; then the oldest."""
    return sorted(stale, key=lambda r: (r.state == "ready", replica_order(r)))[0]
