"""Writing a Plan: fence, name, commit, take what landed, publish.

The applier proves the lease before writing (at most once per heartbeat interval),
gives each placement the next replica id of its deployment (`ids.py`), turns the
plan's entries into writes, commits them (one atomic batch per stream where the
server takes them), and publishes what was written. Placement's memory (`Held`, the
kept index) changes only from what landed: each commit acknowledged is taken into it
(`proposed.Proposed`), and a step whose writes all landed settles its plan.

What did not land was never taken, so nothing is taken back: placements named and not
written are kept (`Held.unwritten`) and the next step writes them again with the same
ids (a NATS that refuses writes for space costs no replica ids, however long it lasts);
removals and changes of state are decided again by the next step from what placement
holds. A commit that raised may still have landed (its answer lost on every try), so
the records of changes it carried are written again, as memory holds them, by the next
flush, whatever else it writes: the bucket never keeps a change placement does not
hold. A placement decided but not named when the step failed is dropped with the
step's plan (no id used, no GPU held).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from opentelemetry import trace

from llmgw_core.bus import Bus, Writes
from llmgw_core.engines import Member, ShardSpec
from llmgw_core.errors import BusError, StoreFull
from llmgw_core.events import PlacementDecision, ReplicaRecord, ReplicaStatus, now
from llmgw_core.telemetry import context_from, current_traceparent, links

from .config import ServerConfig
from .held import Held, key
from .ids import ID_BLOCK, ID_BLOCK_MAX, ReplicaIds, next_replica_id
from .index import KeptIndex
from .metrics import PlacementMetrics
from .plan import Place, Placed, Plan, Refuse, Remove, Save
from .proposed import Proposed

__all__ = ["BATCH_MAX", "ID_BLOCK", "ID_BLOCK_MAX", "Applier", "ReplicaIds"]

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")


# Placements written together after one proof of the lease, and how many are in flight at once.
BATCH_MAX = 512


class Applier:
    def __init__(
        self,
        config: ServerConfig,
        bus: Bus,
        held: Held,
        index: KeptIndex,
        *,
        clock: Callable[[], float] = time.monotonic,
        fence: Callable[[], Awaitable[None]] | None = None,
        metrics: PlacementMetrics | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.held = held
        self.index = index
        self.clock = clock
        # Called before every write: raises if this placement no longer holds the lease,
        # so a paused ex-leader never writes.
        self.fence = fence
        self.metrics = metrics
        self.writes = 0
        self._fenced_at: float | None = None

    # --- naming -------------------------------------------------------------------

    async def name(self, plan: Plan) -> None:
        """Give every placement queued in `plan` its replica id and build its writes (into
        `plan.placed`); then name every refusal and tell those whose reasons changed, and
        send the dead letters."""
        if self.metrics is not None:
            for seconds in plan.decision_seconds:
                self.metrics.decision_seconds.observe(seconds)
        plan.decision_seconds = []
        proposed = self._proposed(plan)
        done = 0
        try:
            for place in plan.places:
                replica = await next_replica_id(self.bus, self.held, place.deployment.name, place.wanted)
                placed = self._build(place, replica)
                proposed.named(placed)
                plan.placed.append(placed)
                done += 1
        finally:
            del plan.places[:done]
        refusals, plan.refusals = plan.refusals, []
        for refuse in refusals:
            replica = refuse.replica or await next_replica_id(
                self.bus, self.held, refuse.deployment, refuse.wanted
            )
            await self._refuse(refuse, replica, proposed)
        letters, plan.dead_letters = plan.dead_letters, []
        for letter in letters:
            await self.bus.dead_letter(letter.subject, letter.data, letter.error)

    def _proposed(self, plan: Plan) -> Proposed:
        """What `plan` was decided against (a plan made by hand gets an overlay of its own)."""
        if plan.proposed is None:
            plan.proposed = Proposed.over(self.held, self.index)
        return plan.proposed

    def settle(self, plan: Plan) -> None:
        """A step whose every write landed: what it decided and remembers is placement's now."""
        self._proposed(plan).settle()

    def abandon(self, plan: Plan) -> None:
        """A step that failed: what `plan` still holds is not written, and placement's memory
        keeps only what landed. Placements named are kept to be written again next step;
        the rest is decided again from what placement holds. Nothing is reported."""
        self._keep_unwritten(plan.placed)
        self._proposed(plan).drop()
        plan.take()
        plan.reports = []

    def _build(self, place: Place, replica: str) -> Placed:
        dep, profile, fp, p = place.deployment, place.profile, place.fp, place.placement
        # One trace from `ctl deploy` to the engines: the deployment carries its
        # trace context, this span continues it, and the shard specs carry it on.
        with tracer.start_as_current_span(
            f"place {dep.name}/{replica}", context=context_from(dep.traceparent)
        ):
            traceparent = current_traceparent()
        names = self.bus.names
        members = (
            tuple(Member(node=a.node, addr=a.addr, port=a.port) for a in p.members)
            if len(p.members) > 1
            else ()
        )
        specs = tuple(
            ShardSpec(
                replica=replica,
                shard=f"{dep.name}-{replica}-{a.rank}",
                node=a.node,
                profile=profile,
                rank=a.rank,
                gpus=a.gpus,
                host=a.addr,
                port=0,
                members=members,
                hcas=a.hcas,
                mgmt_iface=a.mgmt_iface,
                fabric=p.fabric,
                pool=dep.pool,
                profile_fp=fp,
                deployment=dep.name,
                traceparent=traceparent,
            )
            for a in p.members
        )
        record = ReplicaRecord(
            deployment=dep.name,
            replica=replica,
            profile=profile.name,
            profile_fp=fp,
            state="placing",
            engine=profile.engine,
            members=tuple(Member(node=a.node, addr=a.addr, port=a.port) for a in p.members),
            shards=tuple(names.shard_key(s.node, s.shard) for s in specs),
            fabric=p.fabric,
            pool=dep.pool,
            created_at=now(),
            updated_at=now(),
            since=now(),
        )
        number, end = self.held.ids[dep.name]
        self.held.ids[dep.name] = (number + 1, end)
        decision = PlacementDecision(
            deployment=dep.name,
            replica=replica,
            outcome="placed",
            nodes=tuple(a.node for a in p.members),
            at=now(),
        )
        log.info("placed %s/%s on %s", dep.name, replica, ", ".join(decision.nodes))
        return Placed(record, specs, decision, traceparent)

    # --- writing ------------------------------------------------------------------

    async def fenced(self) -> None:
        """Prove the lease before writing: at most once per heartbeat interval, so a batch of
        placements costs one compare-and-set, not one each. A paused ex-leader resumes with
        its proof older than that, tries again, and learns here that it lost the lease."""
        if self.fence is None:
            return
        at = self.clock()
        if self._fenced_at is not None and at - self._fenced_at < self.config.heartbeat_interval_s:
            return
        await self.fence()
        self._fenced_at = self.clock()

    async def flush(self, plan: Plan) -> None:
        """Write every removal `plan` holds, then every named placement, then every replica's
        change of state, after one proof of the lease: each as one commit per stream (an
        atomic batch where the server takes them), its events after it.

        Removals go first: a placement may reuse GPUs a removal freed. Each commit that
        lands is taken into placement's memory at once (`Proposed.removed`, `placed`,
        `saved`); what does not land is not (see the module's docstring). Any failure
        costs this step (BusError).
        """
        held, proposed = self.held, self._proposed(plan)
        removals, plan.removals = plan.removals, []
        gone = {key(r.record) for r in removals}
        # A placement removed since it was queued (its node was lost meanwhile) is not written.
        batch = [b for b in plan.placed if key(b.record) not in gone]
        plan.placed = []
        saves, plan.saves = plan.saves, []
        if self.metrics is not None:
            for save in saves:
                if save.after.state == "ready" and save.before is not None and save.before.state != "ready":
                    self.metrics.replica_ready(save.before)
        # Of a replica's changes queued, only its last is written, and none of one removed since.
        last = {key(s.after): s for s in saves}
        saves = [s for s in saves if last[key(s.after)] is s and key(s.after) not in gone]
        if not removals and not batch and not saves and not held.rewrite:
            return
        try:
            await self.fenced()
            await self._remove(removals, proposed)
        except BaseException:
            self._keep_unwritten(batch)
            raise
        await self._place(batch, proposed)
        await self._save(saves, {key(p.record) for p in batch}, proposed)

    async def _remove(self, removals: list[Remove], proposed: Proposed) -> None:
        """Delete the removed replicas' shard specs and records, then tell it."""
        if not removals:
            return
        names = self.bus.names
        kv, events = Writes(), Writes()
        for removal in removals:
            record = removal.record
            for k in record.shards:
                kv.delete(names.shards_bucket, k)
            kv.delete(names.replicas_bucket, key(record))
            events.publish(
                names.replica_event(record.deployment, record.replica),
                ReplicaStatus(
                    deployment=record.deployment,
                    replica=record.replica,
                    state=removal.state,
                    reason=removal.why,
                    at=now(),
                ),
            )
        await self._write(kv)
        proposed.removed(removals)
        await self._publish(events)

    async def _place(self, batch: list[Placed], proposed: Proposed) -> None:
        """Write the named placements: shard specs, then records (`starting`), then their events."""
        if not batch:
            return
        names = self.bus.names
        kv, events = Writes(), Writes()
        started: list[tuple[Placed, ReplicaRecord]] = []
        # Shards before records: a record never names shards that were not written.
        for placed in batch:
            for spec in placed.specs:
                kv.put(names.shards_bucket, names.shard_key(spec.node, spec.shard), spec)
        for placed in batch:
            record = placed.record
            starting = msgspec.structs.replace(record, state="starting", updated_at=now(), since=now())
            started.append((placed, starting))
            kv.put(names.replicas_bucket, key(record), starting)
            events.publish(
                names.replica_event(record.deployment, record.replica),
                ReplicaStatus(
                    deployment=record.deployment, replica=record.replica, state="starting", at=now()
                ),
                traceparent=placed.traceparent,
            )
            events.publish(
                names.placement_event(record.deployment), placed.decision, traceparent=placed.traceparent
            )
        # One commit does the work of many deployments' traces: each is linked to it.
        with tracer.start_as_current_span(
            f"commit {len(batch)} placements", links=links(p.traceparent for p in batch)
        ):
            try:
                await self._write(kv)
            except BaseException:
                self._keep_unwritten(batch)
                raise
        proposed.placed(started)
        await self._publish(events)

    async def _save(self, saves: list[Save], placed: set[str], proposed: Proposed) -> None:
        """Write the replicas' changes of record, with the records whose last commit raised."""
        held, names = self.held, self.bus.names
        saved = {key(s.after) for s in saves} | placed
        # Records whose last commit raised and that this flush writes no change of: as memory
        # holds them now (one removed since was deleted with its removal; a placement not yet
        # written is written as such).
        again = {
            k: held.replicas[k]
            for k in sorted(held.rewrite)
            if k not in saved and k in held.replicas and k not in held.unwritten
        }
        # Each is written below, or by this flush's other writes, or is gone.
        held.rewrite.clear()
        if saves or again:
            kv, events = Writes(), Writes()
            for k, record in again.items():
                kv.put(names.replicas_bucket, k, record)
            for save in saves:
                old, new = save.before, save.after
                kv.put(names.replicas_bucket, key(new), new)
                if old is None or old.state != new.state:
                    events.publish(
                        names.replica_event(new.deployment, new.replica),
                        ReplicaStatus(
                            deployment=new.deployment,
                            replica=new.replica,
                            state=new.state,
                            reason=new.reason,
                            url=new.url,
                            at=now(),
                        ),
                        traceparent=save.traceparent,
                    )
            with tracer.start_as_current_span(
                f"commit {len(saves) + len(again)} replica changes", links=links(s.traceparent for s in saves)
            ):
                try:
                    await self._write(kv)
                except BaseException:
                    # Sent, so perhaps landed: what memory holds for them is written again.
                    held.rewrite.update(again)
                    held.rewrite.update(key(s.after) for s in saves)
                    raise
            proposed.saved(saves)
            await self._publish(events)

    async def report(self, plan: Plan) -> None:
        """Publish the step's changed statuses, after its writes were committed: a status never
        counts a replica ready (or gone) before the bucket says so."""
        reports, plan.reports = plan.reports, []
        for report in reports:
            name = report.status.deployment
            if report.gone:
                self.held.statuses.pop(name, None)
            else:
                self.held.statuses[name] = report.status
            await self._event(self.bus.names.deployment_event(name), report.status)

    async def sweep(self) -> None:
        """Remove what the buckets hold and this leader does not: a write that landed after
        its writer lost the lease (a paused ex-leader's last batch, sent when it resumed) is
        nobody's, and a shard spec of it would run an engine that holds GPUs forever."""
        names = self.bus.names
        kv = Writes()
        # A placement whose commit raised may have landed all the same: it is this leader's.
        unwritten = self.held.unwritten.values()
        replicas = set(self.held.replicas) | set(self.held.unwritten)
        shards = set(self.held.shards) | {k for p in unwritten for k in p.record.shards}
        for k in sorted(await self.bus.keys(names.replicas_bucket) - replicas):
            log.warning("replica record %s is not this leader's (an ex-leader's late write?); removing it", k)
            kv.delete(names.replicas_bucket, k)
        for k in sorted(await self.bus.keys(names.shards_bucket) - shards):
            log.warning("shard spec %s is not this leader's (an ex-leader's late write?); removing it", k)
            kv.delete(names.shards_bucket, k)
        if kv:
            await self.fenced()
            await self.bus.commit(kv)
            self.writes += len(kv)

    async def delete_shard(self, k: str) -> None:
        await self.bus.delete(self.bus.names.shards_bucket, k)
        spec = self.held.shards.pop(k, None)
        if spec is not None:
            self.index.remove(spec)
        self.writes += 1

    async def _write(self, kv: Writes) -> None:
        """Commit `kv` (raising where it does not land)."""
        await self.bus.commit(kv)
        self.writes += len(kv)

    def _keep_unwritten(self, batch: list[Placed]) -> None:
        """Placements named whose writes did not land: the next step writes them again."""
        for placed in batch:
            self.held.unwritten[key(placed.record)] = placed

    async def _publish(self, events: Writes) -> None:
        """Events tell what was written; one that fails is logged, never undoes the write."""
        if not events:
            return
        try:
            await self.bus.commit(events)
        except StoreFull:
            pass  # the bus said the episode once; the step's writes say the rest
        except BusError as exc:
            log.warning("could not publish %d events: %s", len(events), exc)

    async def _refuse(self, refuse: Refuse, replica: str, proposed: Proposed) -> None:
        dep = refuse.deployment
        decision = PlacementDecision(
            deployment=dep, replica=replica, outcome="refused", reasons=refuse.reasons, at=now()
        )
        proposed.decisions[dep] = decision
        if not refuse.tell:
            return
        # Every node's reason goes to the event; the log says it in one line.
        log.warning("cannot place %s: %s", dep, refuse.refusal.summary())
        await self._event(self.bus.names.placement_event(dep), decision)
        if replica != "-":
            # The replica that could not be: no record (it holds nothing), but its state is told.
            await self._event(
                self.bus.names.replica_event(dep, replica),
                ReplicaStatus(
                    deployment=dep,
                    replica=replica,
                    state="unplaceable",
                    reason=refuse.refusal.text(),
                    at=now(),
                ),
            )

    async def _event(self, subject: str, msg: msgspec.Struct) -> None:
        try:
            await self.bus.publish(subject, msg)
        except StoreFull:
            pass  # the bus said the episode once
        except BusError as exc:
            log.warning("could not publish to %s: %s", subject, exc)
