"""Keeping every deployment at its replica count: the control loop of the active placement.

Level-triggered: each step reads the current state (nodes, heartbeats, catalog,
deployments, shard statuses, the replicas and shards this placement wrote)
and makes the writes that move it one step towards the desired state. A
restarted placement loads the buckets and, for replicas that are fine,
writes nothing.

A step works on a snapshot taken when it starts: the watchers keep changing
`ClusterState` while the step awaits its writes (a deployment deleted mid-step
must cost nothing but its replicas). Placements and removals are planned in
memory and written in a batch at the end (`flush`). A step that fails
part-way leaves state the next step repairs: a placement whose writes did not
land is written again, the same replica with the same id, by the next step
(a NATS that refuses writes for space costs no replica ids, however long it
lasts); a replica loaded `placing` is removed and placed again; a removal whose
deletes failed is remembered again and retried.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio.lowlevel
import msgspec
from opentelemetry import trace

from llmgw_core import failures
from llmgw_core.bus import Bus, Writes
from llmgw_core.claims import Claims
from llmgw_core.engines import Member, Profile, ShardSpec
from llmgw_core.errors import BusError, StoreFull
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeReason,
    NodeStatus,
    PlacementDecision,
    ReplicaRecord,
    ReplicaState,
    ReplicaStatus,
    ShardStatus,
    now,
)
from llmgw_core.subjects import Names
from llmgw_core.telemetry import context_from, current_traceparent

from .config import ServerConfig
from .decide import NodeIndex, NodeView, Placement, Refusal, decide
from .metrics import PlacementMetrics

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

_REPLICA_NUMBER = re.compile(r"^r(\d+)$")


@dataclass
class Usage:
    """What the placed shards take on each node."""

    gpus: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    ports: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    shards: Counter[str] = field(default_factory=Counter)
    replicas_of: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    def add(self, spec: ShardSpec) -> None:
        self.gpus[spec.node].update(spec.gpus)
        self.shards[spec.node] += 1
        self.replicas_of[spec.node][spec.deployment] += 1
        if spec.members:
            self.ports[spec.node].add(spec.members[spec.rank].port)

    def remove(self, spec: ShardSpec) -> None:
        self.gpus[spec.node].difference_update(spec.gpus)
        self.shards[spec.node] -= 1
        self.replicas_of[spec.node][spec.deployment] -= 1
        if spec.members:
            self.ports[spec.node].discard(spec.members[spec.rank].port)


@dataclass
class ClusterState:
    """Everything placement reads, kept current by watchers (in every placement, active or not)."""

    nodes: dict[str, NodeStatus]
    # The node's launcher (or all-in-one agent) last heard, by this placement's
    # monotonic clock, and by the sender's wall clock (for "no heartbeat since …").
    last_seen: dict[str, float]
    catalog: dict[str, Profile]
    deployments: dict[str, Deployment]
    shard_status: dict[str, ShardStatus]
    last_seen_wall: dict[str, float] = field(default_factory=dict)
    # The node's installer last heard (monotonic): shown, never a reason to fail over.
    installer_seen: dict[str, float] = field(default_factory=dict)
    # Bumped on every change to `nodes`.
    nodes_version: int = 0
    # Nodes whose status changed since the controller last looked (it views only those again).
    dirty_nodes: set[str] = field(default_factory=set)
    # Since when this placement could hear every heartbeat (its start, its last
    # reconnect, the end of its last stall); None while it cannot hear at all.
    # A node is judged only on silence that this placement could have heard.
    heard_from: float | None = 0.0
    # Who sends each node's heartbeats: a node two machines claim is placed on no more.
    claims: Claims = field(default_factory=lambda: Claims(window=5.0))

    @classmethod
    def empty(cls) -> ClusterState:
        return cls({}, {}, {}, {}, {})


@dataclass(frozen=True)
class Snapshot:
    """What one step acts on: copies, so a watcher's change cannot move under it."""

    deployments: dict[str, Deployment]
    catalog: dict[str, Profile]
    shard_status: dict[str, ShardStatus]


class ReplicaIds(msgspec.Struct, frozen=True, kw_only=True):
    """`replica-ids.<deployment>` in the leases bucket: replica numbers below `next` were handed out."""

    deployment: str
    next: int


# Replica numbers are reserved this many at a time: one write per block, not per replica.
ID_BLOCK = 64
ID_BLOCK_MAX = 4096
# Placements decided between two turns of the event loop.
YIELD_EVERY = 64
# Placements written together after one proof of the lease, and how many are in flight at once.
BATCH_MAX = 512


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
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.bus = bus
        self.state = state
        self.clock = clock
        # Called before every placement or removal: raises if this placement
        # no longer holds the lease, so a paused ex-leader never writes.
        self.fence = fence
        # What this placement wrote: the shards and replicas buckets, in memory.
        self.shards: dict[str, ShardSpec] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.decisions: dict[str, PlacementDecision] = {}
        self.writes = 0
        self._index = NodeIndex()
        # Bumped whenever the index is made anew (its generation restarts then).
        self._index_id = 0
        # Per deployment, what its last refusal was computed against (see `_place`).
        self._refused: dict[str, tuple[int, int, str, str, str]] = {}
        # Who was alive when the index was last brought up to date (None: never built).
        self._index_alive: frozenset[str] | None = None
        # The nodes claimed by two machines when the index was last brought up to date.
        self._index_claimed: frozenset[str] = frozenset()
        self._usage_all = Usage()
        self._step_at = 0.0
        # Per deployment, the next replica number and the end of the block reserved in the bucket.
        self._ids: dict[str, tuple[int, int]] = {}
        # Placements taken in memory and not yet written (see `flush`).
        self._batch: list[tuple[ReplicaRecord, list[ShardSpec], PlacementDecision, str]] = []
        # Placements planned whose writes did not land, by replica key: the next step writes them
        # again as they are (a new id each time would use ids up while NATS cannot store).
        self._unwritten: dict[str, tuple[ReplicaRecord, list[ShardSpec], PlacementDecision, str]] = {}
        self._removals: list[tuple[ReplicaRecord, dict[str, ShardSpec], str, ReplicaState]] = []
        # Changes of a replica's record, taken in memory: (before, after, trace context).
        self._saves: list[tuple[ReplicaRecord | None, ReplicaRecord, str]] = []
        self._fenced_at: float | None = None
        # Deployments whose unknown profile was dead-lettered already (by value).
        self._told_unknown: dict[str, Deployment] = {}
        # When the buckets were last reconciled with memory (`load` does it first).
        self._reconciled_at = clock()
        # Per deployment, the status last published (published again only when it changes).
        self.statuses: dict[str, DeploymentStatus] = {}
        # Statuses of this step, published once its writes are committed: a status never
        # counts a replica ready (or gone) before the bucket says so.
        self._reports: dict[str, DeploymentStatus] = {}
        self._gone: set[str] = set()  # deployments whose last status this step says "deleted"

    # --- loading -----------------------------------------------------------------

    async def load(self) -> None:
        """Rebuild from the buckets; finish half-written replicas, drop shards no replica owns."""
        names = self.bus.names
        shards = await self.bus.entries(names.shards_bucket, ShardSpec)
        replicas = await self.bus.entries(names.replicas_bucket, ReplicaRecord)
        self.shards = {k: c.value for k, c in shards.items() if c.value is not None}
        self.replicas = {k: c.value for k, c in replicas.items() if c.value is not None}
        self._usage_all = self._usage(self.shards.values())
        owned = {key for r in self.replicas.values() for key in r.shards}
        for key in sorted(set(self.shards) - owned):
            log.warning("shard %s belongs to no replica; removing it", key)
            await self._delete_shard(key)
        for key, record in self.replicas.items():
            if record.state != "placing" and not set(record.shards) <= set(self.shards):
                # Its shard specs are gone (deleted by hand, or a value that did not
                # decode): what it holds is unknown, so it is removed and placed again.
                log.warning("replica %s lost its shard specs; placing it again", key)
                self.replicas[key] = msgspec.structs.replace(record, state="placing")

    async def reconcile(self) -> None:
        """Remove what the buckets hold and this leader does not: a write that landed after
        its writer lost the lease (a paused ex-leader's last batch, sent when it resumed) is
        nobody's, and a shard spec of it would run an engine that holds GPUs forever."""
        names = self.bus.names
        kv = Writes()
        for key in sorted(await self.bus.keys(names.replicas_bucket) - set(self.replicas)):
            log.warning(
                "replica record %s is not this leader's (an ex-leader's late write?); removing it", key
            )
            kv.delete(names.replicas_bucket, key)
        for key in sorted(await self.bus.keys(names.shards_bucket) - set(self.shards)):
            log.warning("shard spec %s is not this leader's (an ex-leader's late write?); removing it", key)
            kv.delete(names.shards_bucket, key)
        if kv:
            await self._fenced()
            await self.bus.commit(kv)
            self.writes += len(kv)

    # --- node views ------------------------------------------------------------------

    def alive(self, node: str, at: float) -> tuple[bool, float]:
        """Whether the node's launcher was heard within `node_timeout` (or, while its installer
        still is, within `launcher_grace_s`), and for how long it was not.

        Silence counts only from when this placement could hear it: after its
        own start, reconnect or stall every node gets a full timeout again,
        and while it cannot hear the bus at all nobody is declared lost.
        A launcher that restarts (an upgrade) is silent for seconds while its
        engines serve on and its installer beats: failing the node over then
        would cost every replica on it for nothing.
        """
        seen = self.state.last_seen.get(node)
        silent = at - seen if seen is not None else float("inf")
        heard_from = self.state.heard_from
        if heard_from is None:
            return True, silent
        judged = min(silent, at - heard_from)
        if judged < self.config.node_timeout_s:
            return True, silent
        return judged < self.config.launcher_grace_s and self._installer_heard(node, at), silent

    def _installer_heard(self, node: str, at: float) -> bool:
        installer = self.state.installer_seen.get(node)
        return installer is not None and at - installer < self.config.node_timeout_s

    def in_grace(self, node: str, at: float) -> float | None:
        """Seconds of `launcher_grace_s` left while the node is alive only by its installer, else None."""
        seen = self.state.last_seen.get(node)
        heard_from = self.state.heard_from
        if heard_from is None:
            return None
        judged = min(at - seen if seen is not None else float("inf"), at - heard_from)
        if judged < self.config.node_timeout_s or not self._installer_heard(node, at):
            return None
        left = self.config.launcher_grace_s - judged
        return left if left > 0 else None

    def alive_nodes(self, at: float) -> frozenset[str]:
        """The nodes `alive` says are alive at `at`, in one pass over the nodes."""
        nodes = self.state.nodes
        timeout = self.config.node_timeout_s
        grace = self.config.launcher_grace_s
        heard_from = self.state.heard_from
        if heard_from is None or at - heard_from < timeout:
            return frozenset(nodes)
        since = at - heard_from
        seen = self.state.last_seen
        installer = self.state.installer_seen
        never = float("-inf")
        return frozenset(
            n
            for n in nodes
            if (silent := at - seen.get(n, never)) < timeout
            or (min(silent, since) < grace and at - installer.get(n, never) < timeout)
        )

    def launcher_stale(self, node: str, at: float) -> bool:
        """Whether the node's launcher has missed a few heartbeats: what it reported may be stale."""
        if self.state.heard_from is None:
            return False
        seen = max(self.state.last_seen.get(node, float("-inf")), self.state.heard_from)
        return at - seen > max(3 * self.config.heartbeat_interval_s, self.config.node_timeout_s / 2)

    def views(self, at: float) -> list[NodeView]:
        return [self._view(name, at, self._usage_all) for name in sorted(self.state.nodes)]

    @staticmethod
    def _usage(specs: Iterable[ShardSpec]) -> Usage:
        usage = Usage()
        for spec in specs:
            usage.add(spec)
        return usage

    def _view(self, name: str, at: float, usage: Usage) -> NodeView:
        status = self.state.nodes[name]
        alive, since = self.alive(name, at)
        facts = status.facts
        lost_since = ""
        if not alive:
            wall = self.state.last_seen_wall.get(name)
            lost_since = (
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))
                if wall
                else "this placement started"
            )
        return NodeView(
            node=name,
            alive=alive,
            lost_for_s=since,
            lost_since=lost_since,
            pools=frozenset(p for p, pats in self.config.pools.items() if _matches(name, pats)),
            fabric=next((f for f, fc in sorted(self.config.fabrics.items()) if _matches(name, fc.nodes)), ""),
            gpus=facts.gpus,
            used_gpus=frozenset(usage.gpus[name]),
            engines={e.name: e for e in status.engines},
            install=status.install,
            avx2=facts.has_avx2,
            hcas=facts.hcas,
            weights=frozenset(p for p, fp in facts.weights.items() if fp),
            mgmt_addr=facts.mgmt_addr or "127.0.0.1",
            shards=usage.shards[name],
            used_ports=frozenset(usage.ports[name]),
            replicas_of=dict(usage.replicas_of[name]),
            mgmt_iface=facts.mgmt_iface,
            claimed=self.state.claims.claimed(name, at) or "",
        )

    def index(self, at: float) -> NodeIndex:
        """Every node's view, indexed, and kept current: only the nodes whose status changed
        (`state.dirty_nodes`) or whose liveness flipped are viewed again, and this placement's
        own placements and removals update the nodes they touch, so a step costs O(changes),
        not O(nodes). (Computing who is alive is the one pass over every node.)"""
        self._step_at = at
        alive = self.alive_nodes(at)
        claimed = frozenset(self.state.claims.contested(at))
        dirty = self.state.dirty_nodes
        self.state.dirty_nodes = set()
        if self._index_alive is None:
            self._index = NodeIndex([self._view(n, at, self._usage_all) for n in sorted(self.state.nodes)])
            self._index_id += 1
        else:
            for node in sorted(dirty | (alive ^ self._index_alive) | (claimed ^ self._index_claimed)):
                if node in self.state.nodes:
                    self._index.add(self._view(node, at, self._usage_all))
                else:
                    self._index.remove(node)
        self._index_alive = alive
        self._index_claimed = claimed
        return self._index

    def _reindex(self, node: str) -> None:
        if node in self.state.nodes:
            self._index.add(self._view(node, self._step_at, self._usage_all))

    # --- the step ---------------------------------------------------------------------

    async def step(self) -> None:
        """One pass over every deployment. A bus fault raises BusError and costs this pass
        only: what was written stays consistent, and the next pass goes on from there."""
        at = self.clock()
        snap = Snapshot(
            deployments=dict(self.state.deployments),
            catalog=dict(self.state.catalog),
            shard_status=dict(self.state.shard_status),
        )
        self.index(at)
        alive = self._index_alive
        assert alive is not None
        for key in sorted(self.replicas):
            record = self.replicas.get(key)
            if record is None:
                continue
            if record.deployment not in snap.deployments:
                self._unwritten.pop(key, None)
                await self._remove_replica(record, "deployment deleted")
            elif record.state == "placing":
                planned = self._unwritten.pop(key, None)
                if planned is not None and planned[0] is record:
                    self._batch.append(planned)  # written again, as it was planned
                    continue
                # Its shards were not all written (a fault mid-commit): start it again.
                await self._remove_replica(record, "placement was interrupted; placing it again")
        self._unwritten.clear()  # what is left names replicas removed since
        self._reports = {}
        self._gone = set(self.statuses) - set(snap.deployments)
        for name in sorted(self._gone):
            self.decisions.pop(name, None)
            self._reports[name] = DeploymentStatus(
                deployment=name, desired=0, summary=f"{name}: deleted", at=now()
            )
        try:
            for name in sorted(snap.deployments):
                await self._converge(snap.deployments[name], alive, snap, at)
        except BaseException:
            # What was queued is not written: those replicas stay `placing` in
            # memory, and the next step writes them again; the removals are
            # remembered again and retried. Nothing is reported.
            self._keep_unwritten(self._batch)
            self._batch = []
            self._undo(self._removals, self._saves)
            self._removals, self._saves = [], []
            raise
        await self.flush()
        await self._publish_reports()
        if at - self._reconciled_at >= self.config.reconcile_interval_s:
            await self.reconcile()
            self._reconciled_at = at

    async def _converge(self, dep: Deployment, alive: frozenset[str], snap: Snapshot, at: float) -> None:
        profile = snap.catalog.get(dep.profile)
        mine = sorted((r for r in self.replicas.values() if r.deployment == dep.name), key=_replica_order)
        # Failover: a replica with any rank on a lost node is placed again, whole.
        for record in mine:
            lost = sorted({m.node for m in record.members} - alive)
            if lost:
                await self._remove_replica(record, f"node {', '.join(lost)} lost", state="failed")
        mine = [r for r in mine if _key(r) in self.replicas]
        for record in mine:
            if record.state != "placing":  # one still to be written has nothing to observe
                await self._observe(record, snap, at)
        # A replica that failed for good because a GPU it was given is not on its node (a
        # replacement machine with fewer GPUs under the same node id) is placed again, by
        # what the node reports it has now; left alone it would stay failed forever.
        for record in mine:
            gone = self._gpus_gone(self.replicas[_key(record)])
            if gone:
                await self._remove_replica(self.replicas[_key(record)], gone, state="failed")
        mine = [r for r in mine if _key(r) in self.replicas]
        mine = [self.replicas[_key(r)] for r in mine]
        if profile is None:
            await self._unknown_profile(dep)
            await self._report(dep, mine, refused=True)
            return
        self._told_unknown.pop(dep.name, None)
        fp = profile.fingerprint()
        current = [r for r in mine if r.profile_fp == fp]
        stale = [r for r in mine if r.profile_fp != fp]
        in_flight = any(r.state != "ready" for r in current)
        if stale:
            # Roll one replica at a time: a new one ready before an old one goes,
            # where capacity allows; else one old one goes first.
            refused = False
            if in_flight:
                pass
            elif len(current) + len(stale) > dep.replicas:
                await self._remove_replica(_pick_to_remove(stale), "replaced by a replica of the new profile")
            elif not await self._place(dep, profile, fp):
                refused = True
                # No room for a new one first. Only if the new profile fits once
                # an old replica is gone does that replica go; a profile that fits
                # nowhere must not take the serving replicas down with it.
                victim = _pick_to_remove(stale)
                if self._fits_without(victim, dep, profile):
                    await self._remove_replica(victim, "replaced in place: no room for a new replica first")
            await self._report(dep, mine, refused=refused)
            return
        missing = dep.replicas - len(current)
        refused = False
        for placed in range(missing):
            if placed % YIELD_EVERY == YIELD_EVERY - 1:
                # Let heartbeats and statuses in between decisions: a step that places
                # thousands must not hold the loop until its next write.
                await anyio.lowlevel.checkpoint()
            if not await self._place(dep, profile, fp, missing - placed):
                refused = True
                break
        for record in sorted(current, key=_replica_order, reverse=True)[: max(0, -missing)]:
            await self._remove_replica(record, f"scaled down to {dep.replicas}")
        if not refused:
            # Nothing is missing: an earlier refusal no longer says anything about it.
            last = self.decisions.get(dep.name)
            if last is not None and last.outcome == "refused":
                del self.decisions[dep.name]
        await self._report(dep, mine, refused=refused)

    async def _report(self, dep: Deployment, observed: list[ReplicaRecord], *, refused: bool) -> None:
        """Publish the deployment's desired, ready, pending and unplaceable counts, with the
        refusal that keeps some from being placed, when any of them changed."""
        keys = {_key(r) for r in observed}
        records = [self.replicas[k] for k in keys if k in self.replicas]
        # Placed in this step (not observed yet): placing.
        placed_now = sum(1 for r, _, _, _ in self._batch if r.deployment == dep.name and _key(r) not in keys)
        ready = sum(1 for r in records if r.state == "ready")
        pending = len(records) + placed_now - ready
        unplaceable = max(0, dep.replicas - len(records) - placed_now) if refused else 0
        last = self.decisions.get(dep.name)
        reasons = last.reasons if refused and last is not None and last.outcome == "refused" else ()
        parts = [f"{dep.name}: {ready} of {dep.replicas} ready"]
        if pending:
            states = Counter(r.state for r in records if r.state != "ready")
            if placed_now:
                states["placing"] += placed_now
            parts.append(", ".join(f"{n} {state}" for state, n in sorted(states.items())))
        if unplaceable:
            parts.append(f"{unplaceable} cannot be placed: {_reasons_text(reasons)}")
        status = DeploymentStatus(
            deployment=dep.name,
            desired=dep.replicas,
            ready=ready,
            pending=pending,
            unplaceable=unplaceable,
            summary="; ".join(parts),
            reasons=reasons,
            at=now(),
        )
        previous = self.statuses.get(dep.name)
        if previous is not None and msgspec.structs.replace(previous, at=status.at) == status:
            return
        self._reports[dep.name] = status

    async def _publish_reports(self) -> None:
        """Publish the step's changed statuses, after its writes were committed."""
        reports, self._reports = self._reports, {}
        for name, status in reports.items():
            if name in self._gone:
                self.statuses.pop(name, None)
            else:
                self.statuses[name] = status
            await self._event(self.bus.names.deployment_event(name), status)

    async def _unknown_profile(self, dep: Deployment) -> None:
        """A deployment naming no profile of the catalog: refused (once), and its value copied to
        the DLQ once, so whoever wrote it can see why. It is placed when the profile appears."""
        await self._refuse(dep, "-", Refusal((("-", f"profile {dep.profile} is not in the catalog"),)))
        if self._told_unknown.get(dep.name) != dep:
            self._told_unknown[dep.name] = dep
            await self.bus.dead_letter(
                self.bus.names.kv_subject(self.bus.names.deployments_bucket, dep.name),
                msgspec.json.encode(dep),
                f"deployment {dep.name}: profile {dep.profile} is not in the catalog "
                f"({', '.join(sorted(self.state.catalog)) or 'the catalog is empty'})",
            )

    def _gpus_gone(self, record: ReplicaRecord) -> str:
        """Why a replica that failed for good holds GPUs its node no longer has, else ""."""
        if record.state != "failed":
            return ""
        for key in record.shards:
            spec = self.shards.get(key)
            status = self.state.nodes.get(spec.node) if spec is not None else None
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

    def _fits_without(self, record: ReplicaRecord, dep: Deployment, profile: Profile) -> bool:
        at = self.clock()
        usage = self._usage(s for k, s in self.shards.items() if k not in set(record.shards))
        views = [self._view(n, at, usage) for n in sorted(self.state.nodes)]
        fabric_hcas = {name: fc.hcas for name, fc in self.config.fabrics.items()}
        decision = decide(
            dep, profile, views, fabric_hcas=fabric_hcas, port_range=self.config.dist_port_range
        )
        return isinstance(decision, Placement)

    async def _observe(self, record: ReplicaRecord, snap: Snapshot, at: float) -> None:
        """A replica's state from its shards: ready only when every shard is and the leader answered.

        A shard whose launcher has gone silent reported what it saw then, not
        now: the replica's readiness is `unknown` until the launcher is heard
        again (or the node is declared lost and the replica placed elsewhere).
        An `unknown` replica whose shards were last heard ready keeps its URL:
        the gateway sends to it when no replica is known ready, so a launcher
        restart (its engines serving on) costs no request.
        """
        statuses = [snap.shard_status.get(k) for k in record.shards]
        url = ""
        state: ReplicaState
        reason = ""
        failed = [s for s in statuses if s is not None and s.state == "failed"]
        silent = sorted({m.node for m in record.members if self.launcher_stale(m.node, at)})
        last_ready = bool(statuses) and all(
            s is not None and s.state == "ready" and s.profile_fp == record.profile_fp for s in statuses
        )
        if silent:
            state = "unknown"
            reason = f"launcher on {', '.join(silent)} silent: readiness unknown"
            if all(self._installer_heard(n, at) for n in silent):
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
        if state == "ready" and record.state != "ready" and self.metrics is not None:
            self.metrics.replica_ready(record)
        # Restarts and the last failure, as the launchers keep them: the failure stays
        # until the replica is ready again, so a retry never hides why it is retrying.
        known = [s for s in statuses if s is not None]
        restarts = sum(s.restarts for s in known)
        last = max(known, key=lambda s: s.last_failure_at, default=None)
        last_failure = last.last_failure if last is not None and state != "ready" else ""
        failure = failures.failure_of(last) if last is not None and state != "ready" else None
        if state == "starting" and failure is not None:
            reason = failures.retrying(restarts + 1, failure)
        if (state, reason, url, restarts, last_failure, failure) != (
            record.state,
            record.reason,
            record.url,
            record.restarts,
            record.last_failure,
            record.failure,
        ):
            changed = msgspec.structs.replace(
                record,
                state=state,
                reason=reason,
                url=url,
                restarts=restarts,
                last_failure=last_failure,
                failure=failure,
                since=record.since if state == record.state and record.since else now(),
                updated_at=now(),
            )
            if state == record.state:
                await self._save_replica(changed)
                return
            # A change of state continues the replica's trace (from `ctl deploy` through its
            # placement and its shards' starts), so its `ready` is not a trace of its own.
            spec = self.shards.get(record.shards[0]) if record.shards else None
            with tracer.start_as_current_span(
                f"replica {record.deployment}/{record.replica} {state}",
                context=context_from(spec.traceparent if spec is not None else ""),
                attributes={"llmgw.deployment": record.deployment, "llmgw.replica": record.replica},
            ):
                await self._save_replica(changed)

    # --- writes -------------------------------------------------------------------

    async def _next_replica_id(self, dep: str, wanted: int = 1) -> str:
        """A replica id never used before in this deployment, across failovers, restarts and
        leaders: numbers are reserved in the leases bucket by compare-and-set, a block at a
        time, the block as big as the `wanted` replicas still to place (up to ID_BLOCK_MAX):
        10,000 new replicas cost a few reservations, not one per 64."""
        number, end = self._ids.get(dep, (0, 0))
        if number >= end:
            number, end = await self._reserve_ids(dep, min(max(ID_BLOCK, wanted), ID_BLOCK_MAX))
        self._ids[dep] = (number, end)
        return f"r{number}"

    async def _reserve_ids(self, dep: str, size: int) -> tuple[int, int]:
        bucket, key = self.bus.names.leases_bucket, f"replica-ids.{dep}"
        if dep in self._ids:
            used = self._ids[dep][0]  # every replica held was numbered below it
        else:  # the first block of this leader: the replicas it loaded
            used = max(
                (
                    int(m.group(1)) + 1
                    for r in self.replicas.values()
                    if r.deployment == dep
                    if (m := _REPLICA_NUMBER.match(r.replica))
                ),
                default=0,
            )
        while True:
            current = await self.bus.get(bucket, key, ReplicaIds)
            start = max(used, current[0].next if current else 0, self._ids.get(dep, (0, 0))[0])
            block = ReplicaIds(deployment=dep, next=start + size)
            if current is None:
                written = await self.bus.create(bucket, key, block)
            else:
                written = await self.bus.update(bucket, key, block, last=current[1])
            if written is not None:
                return start, start + size

    async def _place(self, dep: Deployment, profile: Profile, fp: str, wanted: int = 1) -> bool:
        # Nothing a refusal depends on moved since the last one: it still holds, and
        # deciding again would cost a pass over every node for the same answer.
        refused = self._refused.get(dep.name)
        if refused == (self._index_id, self._index.generation, fp, dep.pool, dep.strategy):
            return False
        fabric_hcas = {name: fc.hcas for name, fc in self.config.fabrics.items()}
        started = time.perf_counter()
        decision = decide(
            dep, profile, self._index, fabric_hcas=fabric_hcas, port_range=self.config.dist_port_range
        )
        if self.metrics is not None:
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
        # The id the replica gets if it is placed; a refusal names it too, without using it up.
        replica = await self._next_replica_id(dep.name, wanted)
        if isinstance(decision, Refusal):
            self._refused[dep.name] = (self._index_id, self._index.generation, fp, dep.pool, dep.strategy)
            await self._refuse(dep, replica, decision)
            return False
        self._refused.pop(dep.name, None)
        await self._commit(dep, profile, fp, replica, decision)
        return True

    async def _fenced(self) -> None:
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

    async def _commit(self, dep: Deployment, profile: Profile, fp: str, replica: str, p: Placement) -> None:
        # One trace from `ctl deploy` to the engines: the deployment carries its
        # trace context, this span continues it, and the shard specs carry it on.
        with tracer.start_as_current_span(
            f"place {dep.name}/{replica}", context=context_from(dep.traceparent)
        ):
            self._plan(dep, profile, fp, replica, p)
        if len(self._batch) >= BATCH_MAX:
            await self.flush()

    def _plan(self, dep: Deployment, profile: Profile, fp: str, replica: str, p: Placement) -> None:
        """Take the placement in memory now (the next decision sees its GPUs taken), and queue
        its writes for `flush`."""
        traceparent = current_traceparent()
        members = (
            tuple(Member(node=a.node, addr=a.addr, port=a.port) for a in p.members)
            if len(p.members) > 1
            else ()
        )
        specs = [
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
        ]
        record = ReplicaRecord(
            deployment=dep.name,
            replica=replica,
            profile=profile.name,
            profile_fp=fp,
            state="placing",
            engine=profile.engine,
            members=tuple(Member(node=a.node, addr=a.addr, port=a.port) for a in p.members),
            shards=tuple(self.bus.names.shard_key(s.node, s.shard) for s in specs),
            fabric=p.fabric,
            pool=dep.pool,
            created_at=now(),
            updated_at=now(),
            since=now(),
        )
        number, end = self._ids[dep.name]
        self._ids[dep.name] = (number + 1, end)
        self.replicas[_key(record)] = record
        for spec in specs:
            self.shards[self.bus.names.shard_key(spec.node, spec.shard)] = spec
            # Only the chosen nodes' views change: update them in the index.
            self._usage_all.add(spec)
            self._reindex(spec.node)
        decision = PlacementDecision(
            deployment=dep.name,
            replica=replica,
            outcome="placed",
            nodes=tuple(a.node for a in p.members),
            at=now(),
        )
        self.decisions[dep.name] = decision
        log.info("placed %s/%s on %s", dep.name, replica, ", ".join(decision.nodes))
        self._batch.append((record, specs, decision, traceparent))

    async def flush(self) -> None:
        """Write every queued removal, then every queued placement, then every replica's
        change of state, after one proof of the lease: each as one commit per stream (an
        atomic batch where the server takes them), its events after it.

        Removals go first: a placement may reuse GPUs a removal freed. Placements whose
        writes fail stay `placing` in memory, and the next step removes them and places
        them again; removals that fail are remembered again and retried; changes of state
        that fail are taken back, and the next step observes them again.
        Any failure costs this step (BusError).
        """
        removals, self._removals = self._removals, []
        # A placement removed since it was queued (its node was lost meanwhile) is not written.
        batch = [b for b in self._batch if self.replicas.get(_key(b[0])) is b[0]]
        self._batch = []
        saves, self._saves = self._saves, []
        if not removals and not batch and not saves:
            return
        try:
            await self._fenced()
        except BaseException:
            self._undo(removals, saves)
            self._keep_unwritten(batch)
            raise
        names = self.bus.names
        if removals:
            kv, events = Writes(), Writes()
            for record, _, why, state in removals:
                for key in record.shards:
                    kv.delete(names.shards_bucket, key)
                kv.delete(names.replicas_bucket, _key(record))
                events.publish(
                    names.replica_event(record.deployment, record.replica),
                    ReplicaStatus(
                        deployment=record.deployment,
                        replica=record.replica,
                        state=state,
                        reason=why,
                        at=now(),
                    ),
                )
            await self._write(kv, removals, saves)
            await self._publish(events)
        if batch:
            kv, events = Writes(), Writes()
            started: list[tuple[ReplicaRecord, ReplicaRecord]] = []
            # Shards before records: a record never names shards that were not written.
            for _, specs, _, _ in batch:
                for spec in specs:
                    kv.put(names.shards_bucket, names.shard_key(spec.node, spec.shard), spec)
            for record, _, decision, traceparent in batch:
                starting = msgspec.structs.replace(record, state="starting", updated_at=now(), since=now())
                started.append((record, starting))
                kv.put(names.replicas_bucket, _key(record), starting)
                events.publish(
                    names.replica_event(record.deployment, record.replica),
                    ReplicaStatus(
                        deployment=record.deployment, replica=record.replica, state="starting", at=now()
                    ),
                    traceparent=traceparent,
                )
                events.publish(names.placement_event(record.deployment), decision, traceparent=traceparent)
            with tracer.start_as_current_span(f"commit {len(batch)} placements"):
                try:
                    await self._write(kv, [], saves)
                except BaseException:
                    self._keep_unwritten(batch)
                    raise
            for record, starting in started:
                if self.replicas.get(_key(record)) is record:
                    self.replicas[_key(record)] = starting
            await self._publish(events)
        # Changes of state of replicas still held (one removed since is not written back).
        saves = [(old, new, tp) for old, new, tp in saves if self.replicas.get(_key(new)) is new]
        if saves:
            kv, events = Writes(), Writes()
            for old, new, traceparent in saves:
                kv.put(names.replicas_bucket, _key(new), new)
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
                        traceparent=traceparent,
                    )
            await self._write(kv, [], saves)
            await self._publish(events)

    async def _write(
        self,
        kv: Writes,
        removals: list[tuple[ReplicaRecord, dict[str, ShardSpec], str, ReplicaState]],
        saves: list[tuple[ReplicaRecord | None, ReplicaRecord, str]],
    ) -> None:
        """Commit `kv`; if it does not land, undo `removals` and `saves` in memory and raise."""
        try:
            await self.bus.commit(kv)
        except BaseException:
            self._undo(removals, saves)
            raise
        self.writes += len(kv)

    def _keep_unwritten(
        self, batch: list[tuple[ReplicaRecord, list[ShardSpec], PlacementDecision, str]]
    ) -> None:
        """Placements whose writes did not land: the next step writes them again (see `step`)."""
        for planned in batch:
            self._unwritten[_key(planned[0])] = planned

    def _undo(
        self,
        removals: list[tuple[ReplicaRecord, dict[str, ShardSpec], str, ReplicaState]],
        saves: list[tuple[ReplicaRecord | None, ReplicaRecord, str]],
    ) -> None:
        """Writes that did not land: removals are remembered again, changes of state taken back."""
        for record, specs, _, _ in removals:
            self._unremove(record, specs)
        for old, new, _ in reversed(saves):
            key = _key(new)
            if self.replicas.get(key) is new:
                if old is None:
                    del self.replicas[key]
                else:
                    self.replicas[key] = old

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

    async def _refuse(self, dep: Deployment, replica: str, refusal: Refusal) -> None:
        reasons = refusal.reasons
        decision = PlacementDecision(
            deployment=dep.name,
            replica=replica,
            outcome="refused",
            reasons=tuple(NodeReason(node=n, reason=r) for n, r in reasons),
            at=now(),
        )
        previous = self.decisions.get(dep.name)
        self.decisions[dep.name] = decision
        if previous is None or previous.outcome != "refused" or previous.reasons != decision.reasons:
            # Every node's reason goes to the event; the log says it in one line.
            log.warning("cannot place %s: %s", dep.name, refusal.summary())
            await self._event(self.bus.names.placement_event(dep.name), decision)
            if replica != "-":
                # The replica that could not be: no record (it holds nothing), but its state is told.
                await self._event(
                    self.bus.names.replica_event(dep.name, replica),
                    ReplicaStatus(
                        deployment=dep.name,
                        replica=replica,
                        state="unplaceable",
                        reason=refusal.text(),
                        at=now(),
                    ),
                )

    async def _remove_replica(
        self, record: ReplicaRecord, why: str, state: ReplicaState = "stopping"
    ) -> None:
        """Forget the replica now (its GPUs are free for the next decision) and queue its
        deletes; `flush` writes them before any placement of the same step."""
        log.info("removing %s/%s: %s", record.deployment, record.replica, why)
        key = _key(record)
        self.replicas.pop(key, None)
        specs = {k: spec for k in record.shards if (spec := self.shards.pop(k, None)) is not None}
        for spec in specs.values():
            self._usage_all.remove(spec)
            self._reindex(spec.node)
        self._removals.append((record, specs, why, state))
        if len(self._removals) >= BATCH_MAX:
            await self.flush()

    def _unremove(self, record: ReplicaRecord, specs: dict[str, ShardSpec]) -> None:
        """A removal whose deletes failed: remembered again, so the next step removes it again."""
        self.replicas.setdefault(_key(record), record)
        for key, spec in specs.items():
            if key not in self.shards:
                self.shards[key] = spec
                self._usage_all.add(spec)
                self._reindex(spec.node)

    async def _delete_shard(self, key: str) -> None:
        await self.bus.delete(self.bus.names.shards_bucket, key)
        spec = self.shards.pop(key, None)
        if spec is not None:
            self._usage_all.remove(spec)
            self._reindex(spec.node)
        self.writes += 1

    async def _save_replica(self, record: ReplicaRecord) -> None:
        """Take a replica's new record in memory now, and queue its write for `flush`."""
        key = _key(record)
        self._saves.append((self.replicas.get(key), record, current_traceparent()))
        self.replicas[key] = record
        if len(self._saves) >= BATCH_MAX:
            await self.flush()

    async def _event(self, subject: str, msg: msgspec.Struct) -> None:
        try:
            await self.bus.publish(subject, msg)
        except StoreFull:
            pass  # the bus said the episode once
        except BusError as exc:
            log.warning("could not publish to %s: %s", subject, exc)


def _reasons_text(reasons: tuple[NodeReason, ...], limit: int = 5) -> str:
    """`node-a 0 of 2 GPUs free, node-b lost: …` for a few nodes, counted past `limit`."""
    return Refusal(tuple((r.node, r.reason) for r in reasons)).summary(limit) if reasons else "no nodes known"


def _key(record: ReplicaRecord) -> str:
    return Names.replica_key(record.deployment, record.replica)


def _replica_order(record: ReplicaRecord) -> tuple[int, str]:
    m = _REPLICA_NUMBER.match(record.replica)
    return (int(m.group(1)) if m else 1 << 30, record.replica)


def _pick_to_remove(stale: list[ReplicaRecord]) -> ReplicaRecord:
    """A replica that is not ready goes before one that serves; then the oldest."""
    return sorted(stale, key=lambda r: (r.state == "ready", _replica_order(r)))[0]


def _matches(node: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(node, p) for p in patterns)
