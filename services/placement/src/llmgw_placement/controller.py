"""The control loop of the active placement: snapshot → reconcile → apply, once per step.

Level-triggered: each step reads the current state (nodes, heartbeats, catalog,
deployments, shard statuses, the replicas and shards this placement wrote) and
makes the writes that move it one step towards the desired state. A restarted
placement loads the buckets and, for replicas that are fine, writes nothing.

A step works on a snapshot taken when it starts: the watchers keep changing
`ClusterState` while the step awaits its writes (a deployment deleted mid-step
must cost nothing but its replicas). What to do is decided by `reconcile.py`
(pure, against placement's memory with the step's plan over it: `proposed.py`),
written by `apply.py`; this module loads what the buckets hold and runs the two,
writing a batch whenever BATCH_MAX of one kind are queued and letting the event loop
run between decisions. Placement's memory takes only what the bus acknowledged: a
step that fails part-way keeps what landed and drops the rest of its plan, and the
next step decides again from there (see `apply.py` for what is kept to be written again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio.lowlevel
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.engines import ShardSpec
from llmgw_core.errors import BusError, StoreFull
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeLifecycle,
    PlacementDecision,
    ReplicaRecord,
    ScaleDecision,
)
from llmgw_core.events import now as wall_now

from .apply import BATCH_MAX, Applier
from .autoscale import Windows, follow, start
from .config import ServerConfig
from .decide import NodeView
from .demand import DemandBook, Summed, engine_demand
from .held import Held
from .ids import ID_BLOCK, ID_BLOCK_MAX, ReplicaIds
from .index import KeptIndex, Usage
from .judged import JudgedBook
from .liveness import Liveness
from .metrics import PlacementMetrics
from .plan import Plan
from .reconcile import YIELD_EVERY, Snapshot, steps
from .state import ClusterState

__all__ = [
    "BATCH_MAX",
    "ID_BLOCK",
    "ID_BLOCK_MAX",
    "YIELD_EVERY",
    "ClusterState",
    "Controller",
    "ReplicaIds",
    "Snapshot",
    "Usage",
]

log = logging.getLogger("llmgw.placement")


class Controller:
    def __init__(
        self,
        config: ServerConfig,
        bus: Bus,
        state: ClusterState,
        *,
        clock: Callable[[], float] = time.monotonic,
        fence: Callable[[], Awaitable[None]] | None = None,
        metrics: PlacementMetrics | None = None,
        demand: DemandBook | None = None,
        judged: JudgedBook | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.state = state
        self.clock = clock
        self.liveness = Liveness(config, state)
        # What this placement wrote (the shards and replicas buckets, in memory) and remembers.
        self.held = Held()
        self.index = KeptIndex(config, state, self.liveness)
        self.applier = Applier(config, bus, self.held, self.index, clock=clock, fence=fence, metrics=metrics)
        # When the buckets were last swept of what this leader does not hold (`load` does it first).
        self._reconciled_at = clock()
        # The gateways' demand, as every placement hears it (the service's book, or one of its own).
        a = config.autoscaler
        self.demand = demand or DemandBook(started=clock(), stale_intervals=a.demand_stale_intervals)
        # The gateways' judgements of replicas by their answers (the service's book, or its own).
        self.judged = judged or JudgedBook(stale_intervals=a.demand_stale_intervals)
        self.windows = Windows(
            stable_s=a.stable_window_s,
            panic_s=a.panic_window_s,
            panic_factor=a.panic_factor,
            max_step_factor=a.max_step_factor,
        )

    # --- what it holds, read by the view --------------------------------------------

    @property
    def replicas(self) -> dict[str, ReplicaRecord]:
        return self.held.replicas

    @property
    def shards(self) -> dict[str, ShardSpec]:
        return self.held.shards

    @property
    def decisions(self) -> dict[str, PlacementDecision]:
        return self.held.decisions

    @property
    def statuses(self) -> dict[str, DeploymentStatus]:
        return self.held.statuses

    @property
    def writes(self) -> int:
        return self.applier.writes

    def alive(self, node: str, at: float) -> tuple[bool, float]:
        return self.liveness.alive(node, at)

    def in_grace(self, node: str, at: float) -> float | None:
        return self.liveness.in_grace(node, at)

    def alive_nodes(self, at: float) -> frozenset[str]:
        return self.liveness.alive_nodes(at)

    def views(self, at: float) -> list[NodeView]:
        return self.index.views(at)

    # --- loading -----------------------------------------------------------------

    async def load(self) -> None:
        """Rebuild from the buckets; finish half-written replicas, drop shards no replica owns."""
        names = self.bus.names
        shards = await self.bus.entries(names.shards_bucket, ShardSpec)
        replicas = await self.bus.entries(names.replicas_bucket, ReplicaRecord)
        held = self.held
        held.shards = {k: c.value for k, c in shards.items() if c.value is not None}
        held.replicas = {k: c.value for k, c in replicas.items() if c.value is not None}
        self.index.reset(held.shards.values())
        owned = {k for r in held.replicas.values() for k in r.shards}
        for k in sorted(set(held.shards) - owned):
            log.warning("shard %s belongs to no replica; removing it", k)
            await self.applier.delete_shard(k)
        for k, record in held.replicas.items():
            if record.state != "placing" and not set(record.shards) <= set(held.shards):
                # Its shard specs are gone (deleted by hand, or a value that did not
                # decode): what it holds is unknown, so it is removed and placed again.
                log.warning("replica %s lost its shard specs; placing it again", k)
                held.replicas[k] = msgspec.structs.replace(record, state="placing")

    # --- the step ---------------------------------------------------------------------

    async def step(self) -> None:
        """One pass over every deployment. A bus fault raises BusError and costs this pass
        only: what was written stays consistent, and the next pass goes on from there."""
        at = self.clock()
        state = self.state
        deployments = dict(state.deployments)
        catalog = dict(state.catalog)
        shard_status = dict(state.shard_status)
        alive = self.index.refresh(at)
        scaled = self._autoscale(deployments, at)
        # Told as decided: the count is taken whether or not this step's writes land.
        await self._tell_scaled(scaled[1])
        snap = Snapshot(
            deployments=deployments,
            catalog=catalog,
            shard_status=shard_status,
            nodes=dict(state.nodes),
            alive=alive,
            liveness=self.liveness,
            config=self.config,
            deployments_bucket=self.bus.names.deployments_bucket,
            intents=dict(state.intents),
            missing_models=dict(state.missing_models),
            counts=scaled[0],
            quiet=self._quiet(at),
            unhealthy=self.judged.mark(at, self.held.replicas),
        )
        applier = self.applier
        plan = Plan()
        try:
            for pause in steps(snap, self.held, self.index, at, plan):
                if plan.refusals or plan.dead_letters:
                    await applier.name(plan)
                if plan.full(BATCH_MAX):
                    await applier.name(plan)
                    await applier.flush(plan)
                if pause:
                    # Let heartbeats and statuses in between decisions: a step that places
                    # thousands must not hold the loop until its next write.
                    await anyio.lowlevel.checkpoint()
            await applier.name(plan)
            await applier.flush(plan)
        except BaseException:
            applier.abandon(plan)
            raise
        applier.settle(plan)
        await applier.report(plan)
        await self._forget(at)
        await self._tell_lifecycles()
        if at - self._reconciled_at >= self.config.reconcile_interval_s:
            await self.applier.sweep()
            self._reconciled_at = at

    def _autoscale(
        self, deployments: dict[str, Deployment], at: float
    ) -> tuple[dict[str, int], list[ScaleDecision]]:
        """The count of every autoscaled deployment, from the demand heard (`autoscale.follow`),
        and the changes of count to tell. A new leader starts from the replicas that exist."""
        held, book = self.held, self.demand
        sums = book.sample(at, engine_demand(self.state.shard_status))
        book.forget(set(book.series) - set(deployments))
        counts: dict[str, int] = {}
        told: list[ScaleDecision] = []
        for name in sorted(deployments):
            try:
                decision = self._autoscale_one(name, deployments[name], sums, at, counts)
            except Exception:
                # One deployment's fault keeps its count where it was; the others scale on.
                log.exception("%s: cannot follow demand this step", name)
                was = held.scaling.get(name)
                if was is not None:
                    counts[name] = was.count
                continue
            if decision is not None:
                told.append(decision)
        for name in set(held.scaling) - set(deployments):
            held.scaling.pop(name, None)
            held.scaled.pop(name, None)
            held.counts.pop(name, None)
        return counts, told

    def _autoscale_one(
        self, name: str, deployment: Deployment, sums: dict[str, Summed], at: float, counts: dict[str, int]
    ) -> ScaleDecision | None:
        """One deployment's count from its demand (into `counts`), and its change to tell."""
        held, book = self.held, self.demand
        bounds = deployment.autoscale
        if bounds is None:
            held.scaling.pop(name, None)
            held.scaled.pop(name, None)
            held.counts.pop(name, None)
            return None
        was = held.scaling.get(name)
        if was is None:
            serving = sum(1 for r in held.replicas.values() if r.deployment == name and r.state != "draining")
            was = start(serving, bounds)
        summed = sums.get(name, Summed())
        now, change = follow(
            was,
            bounds,
            book.history(name),
            book.requested_at(name),
            at,
            self.windows,
            # A held request is in its gateway's `queued` and, in the report after it
            # came, in `arrived` too: adding them said one request at zero was two.
            waiting=max(summed.queued, summed.arrived),
        )
        held.scaling[name] = now
        counts[name] = now.count
        chosen = held.counts.setdefault(name, [])
        if not chosen or chosen[-1][1] != now.count:
            chosen.append((at, float(now.count)))
        while len(chosen) > 1 and chosen[1][0] <= at - book.history_s:
            del chosen[0]
        if change is None:
            return None
        decision = ScaleDecision(
            deployment=name,
            before=change.before,
            after=change.after,
            reason=change.reason,
            at=wall_now(),
        )
        held.scaled[name] = decision
        log.info("%s: %s", name, change.reason)
        return decision

    def _quiet(self, at: float) -> frozenset[str]:
        """The draining replicas every gateway heard from says have nothing in flight."""
        held, book = self.held, self.demand
        return frozenset(
            k
            for k, r in held.replicas.items()
            if r.state == "draining" and k in held.draining and book.quiet(r, held.draining[k], at)
        )

    async def _tell_scaled(self, decisions: list[ScaleDecision]) -> None:
        """Each change of count as an event; one that cannot be published is logged only."""
        for decision in decisions:
            try:
                await self.bus.publish(self.bus.names.scale_event(decision.deployment), decision)
            except StoreFull:
                pass  # the bus said the episode once
            except BusError as exc:
                log.warning(
                    "could not publish to %s: %s", self.bus.names.scale_event(decision.deployment), exc
                )

    async def _forget(self, at: float) -> None:
        """Forget each node `ctl delete node` asked for once it is lost and holds no replica:
        its shard statuses, its intent and its status (then `get nodes` no longer lists it)."""
        state, names = self.state, self.bus.names
        for node, intent in sorted(state.intents.items()):
            if not intent.forget or node not in state.nodes or self.liveness.alive(node, at)[0]:
                continue
            if any(m.node == node for r in self.held.replicas.values() for m in r.members):
                continue  # failed over in this step; forgotten in the next
            for key in sorted(k for k in state.shard_status if k.startswith(f"{node}.")):
                await self.bus.delete(names.shard_status_bucket, key)
            await self.bus.delete(names.nodes_bucket, node)
            await self.bus.delete(names.node_intent_bucket, node)
            log.warning("node %s forgotten (lost; deleted by %s)", node, intent.by or "an operator")

    async def _tell_lifecycles(self) -> None:
        """Each change of a node's lifecycle, once, as an event on its subject: cordoned,
        draining (n replicas left), drained, uncordoned, and a node's status deleted."""
        state, told, index = self.state, self.held.lifecycle, self.index
        changed: list[tuple[str, str]] = []
        for node in sorted(set(state.intents) | set(told) | index.gone):
            intent = state.intents.get(node)
            if node not in state.nodes:
                words = "deleted" if node in index.gone else told.get(node, "")
            elif intent is None:
                words = "uncordoned"
            elif intent.forget:
                continue
            else:
                try:
                    words = intent.state(index.usage.shards[node])
                except Exception:  # an intent that cannot be said (its time out of range) is not told
                    log.debug("node %s: its intent cannot be told", node, exc_info=True)
                    continue
            if words and told.get(node) != words and not (words == "uncordoned" and node not in told):
                changed.append((node, words))
        for node, words in changed:
            await self.bus.publish(
                self.bus.names.node_intent(node), NodeLifecycle(node=node, state=words, at=wall_now())
            )
            if words in ("uncordoned", "deleted"):
                told.pop(node, None)
            else:
                told[node] = words
            index.gone.discard(node)
        index.gone.clear()
