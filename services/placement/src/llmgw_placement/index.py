"""The node views placement decides over, bucketed so a decision looks at candidates only.

`NodeIndex` holds one `NodeView` per node (made by `node_view` from the node's
status, this placement's config and what the placed shards take, `Usage`);
`KeptIndex` keeps one current across control steps: only nodes whose status,
liveness or claim changed, and the nodes a placement or removal touched, are
viewed again.

A node whose status cannot be viewed or indexed (a GPU reporting 10**400 MB, whose
class cannot be told) is kept as an unusable view (`unusable_view`): refused in words
for every profile, while every other node is placed on as before.
"""

from __future__ import annotations

import fnmatch
import heapq
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import Deployment, ModelShape

from .config import ServerConfig
from .feasibility import NodeView, cached_score, fault_words, unfit, weights_rank
from .liveness import Liveness
from .state import ClusterState

log = logging.getLogger("llmgw.placement")


def unusable_view(view: NodeView, exc: Exception) -> NodeView:
    """The view of a node whose status placement cannot use: no GPUs, engines or weights of its
    own, only why (logged with the traceback once, when the view is made)."""
    log.exception("node %s: its status cannot be used for placement", view.node)
    return NodeView(
        node=view.node,
        alive=view.alive,
        lost_for_s=view.lost_for_s,
        lost_since=view.lost_since,
        unusable=f"node status cannot be used: {fault_words(exc)}",
    )


class NodeIndex:
    """Node views bucketed by (engine that runs, GPU class), so a placement looks at candidates only.

    A CPU profile (no GPU class) is bucketed under class "". Every node is still
    kept for refusals, which must name every node and its reason.
    """

    def __init__(self, views: Sequence[NodeView] = ()) -> None:
        self.views: dict[str, NodeView] = {}
        self._buckets: dict[tuple[str, str], set[str]] = defaultdict(set)
        # (engine, GPU class) -> free GPUs of that class -> nodes in binpack order within
        # the bucket ((-shards, node)): binpack walks the buckets upwards and takes the first
        # node that fits, without sorting a big fleet for every decision.
        self._by_free: dict[tuple[str, str], dict[int, SortedList]] = defaultdict(
            lambda: defaultdict(SortedList)
        )
        self._by_weights: dict[str, set[str]] = defaultdict(set)
        # Moves on every change: a refusal computed at one generation holds until it moves.
        self.generation = 0
        # Candidates per (engine, class) in node order, made again only after that set changed.
        self._sorted: dict[tuple[str, str], list[NodeView]] = {}
        # Per (multi-node profile fingerprint, pool): its fitting candidates by fabric, made on
        # the first decision for it and kept current by add() and remove() from then on. The
        # least recently used goes beyond FABRIC_TABLES, so an edited profile's old table does
        # not cost every later update.
        self._fabric_fits: dict[tuple[str, str], _FabricFit] = {}
        for view in views:
            self.add(view)

    def _keys(self, view: NodeView) -> list[tuple[tuple[str, str], int]]:
        if not view.alive or view.claimed or view.cordoned or view.unusable:
            return []
        return [
            ((engine, cls), len(view.free_gpus(cls)) if cls else 0)
            for engine, state in view.engines.items()
            if state.runs
            # A CPU build of the engine takes CPU profiles only (see unfit).
            for cls in ((*view.classes, "") if not state.cpu_only else ("",))
        ]

    def add(self, view: NodeView) -> None:
        try:
            # Computed before anything changes: a view whose GPUs cannot be classed (a hostile
            # status) must not leave the index half-updated.
            keys = self._keys(view)
        except Exception as exc:
            view = unusable_view(view, exc)
            keys = []
        self.remove(view.node)
        self.generation += 1
        self.views[view.node] = view
        for key, free in keys:
            self._sorted.pop(key, None)
            self._buckets[key].add(view.node)
            self._by_free[key][free].add((-view.shards, view.node))
        # A node staging a profile's weights is ranked with those that hold them (after them).
        for path in view.weights | view.coming:
            self._by_weights[path].add(view.node)
        if keys:
            buckets = {key for key, _ in keys}
            for table in self._fabric_fits.values():
                if table.bucket in buckets:
                    table.add(view)

    def remove(self, node: str) -> None:
        old = self.views.pop(node, None)
        if old is None:
            return
        self.generation += 1
        for key, free in self._keys(old):
            self._sorted.pop(key, None)
            self._buckets[key].discard(node)
            self._by_free[key][free].discard((-old.shards, node))
        for path in old.weights | old.coming:
            self._by_weights[path].discard(node)
        for table in self._fabric_fits.values():
            table.remove(node)

    def is_candidate(self, profile: Profile, node: str) -> bool:
        return node in self._buckets.get((profile.engine, profile.gpu_class), set())

    def holding(self, path: str) -> list[NodeView]:
        return [self.views[n] for n in sorted(self._by_weights.get(path, set()))]

    def binpack_order(self, profile: Profile, at_least: int) -> Iterator[NodeView]:
        """Candidates with at least `at_least` free GPUs of the profile's class, in binpack order
        (fewest free first, then most shards, then node id), produced lazily."""
        buckets = self._by_free.get((profile.engine, profile.gpu_class), {})
        for free in sorted(buckets):
            if free >= at_least:
                for _, node in buckets[free]:
                    yield self.views[node]

    def candidates(self, profile: Profile) -> list[NodeView]:
        key = (profile.engine, profile.gpu_class)
        found = self._sorted.get(key)
        if found is None:
            names = self._buckets.get(key, set())
            found = self._sorted[key] = [self.views[n] for n in sorted(names)]
        return found

    def all(self) -> list[NodeView]:
        return [self.views[n] for n in sorted(self.views)]

    def fabric_fit(self, profile: Profile, deployment: Deployment, fp: str) -> _FabricFit:
        """The fabric table of a multi-node `profile` in the deployment's pool (`fp` is the
        profile's fingerprint), made from the candidates if there is none yet."""
        key = (fp, deployment.pool)
        table = self._fabric_fits.pop(key, None)
        if table is None:
            table = _FabricFit(profile, deployment)
            table.fill([self.views[n] for n in self._buckets.get(table.bucket, set())])
            while len(self._fabric_fits) >= FABRIC_TABLES:
                del self._fabric_fits[next(iter(self._fabric_fits))]
        # Last in the dict is the most recently used.
        self._fabric_fits[key] = table
        return table


# Fabric tables a NodeIndex keeps (one per multi-node profile and pool decided): each
# costs an unfit() per changed candidate node, so tables of profiles since edited go.
FABRIC_TABLES = 32


class _FabricFit:
    """The candidates that fit one rank of a multi-node profile in one pool, by fabric.

    A multi-node decision picks the fabric from each fabric's totals (fitting nodes,
    their free GPUs), then the members within it. Examining every candidate for
    that costs a pass over the fleet per decision; this table is updated per node
    as the index changes instead, so a decision reads one fabric's members.
    Fit is `unfit(...) is None`, exactly as a full decision would judge it.
    """

    def __init__(self, profile: Profile, deployment: Deployment) -> None:
        self.profile = profile
        # unfit() reads only the deployment's pool, the same for every deployment sharing this.
        self.deployment = deployment
        self.bucket = (profile.engine, profile.gpu_class)
        self._memo: dict[tuple[tuple[str, str, int], ...], list[str]] = {}
        # node -> (its fabric, its rank key): the key is binpack's score (see `score`) with
        # free GPUs for free GPUs left, which orders the same for one profile.
        self._fits: dict[str, tuple[str, tuple[int, int, int, str]]] = {}
        self._views: dict[str, NodeView] = {}
        self._members: dict[str, SortedList] = {}
        self._free: dict[str, int] = {}
        # (free GPUs, fabric) of the fabrics with enough fitting nodes for a replica.
        self._ready = SortedList()

    def fill(self, views: Sequence[NodeView]) -> None:
        """Every candidate at once into an empty table: each sorted list made once, not grown."""
        ranks: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)
        for view in views:
            rank = self._rank(view)
            if rank is not None:
                self._fits[view.node] = (view.fabric, rank)
                self._views[view.node] = view
                ranks[view.fabric].append(rank)
        for fabric, found in ranks.items():
            self._members[fabric] = SortedList(found)
            self._free[fabric] = sum(rank[1] for rank in found)
        self._ready = SortedList(
            (self._free[f], f) for f, members in self._members.items() if len(members) >= self.profile.nodes
        )

    def _rank(self, view: NodeView) -> tuple[int, int, int, str] | None:
        if unfit(view, self.profile, self.deployment, self._memo) is not None:
            return None
        free = len(view.free_gpus(self.profile.gpu_class))
        return (weights_rank(view, self.profile.weights_key), free, -view.shards, view.node)

    def add(self, view: NodeView) -> None:
        """Take `view` in if one rank fits on it; the index removed its old view first."""
        rank = self._rank(view)
        if rank is None:
            return
        fabric, free = view.fabric, rank[1]
        self._unready(fabric)
        self._fits[view.node] = (fabric, rank)
        self._views[view.node] = view
        self._members.setdefault(fabric, SortedList()).add(rank)
        self._free[fabric] = self._free.get(fabric, 0) + free
        self._make_ready(fabric)

    def remove(self, node: str) -> None:
        found = self._fits.pop(node, None)
        if found is None:
            return
        fabric, rank = found
        del self._views[node]
        self._unready(fabric)
        members = self._members[fabric]
        members.remove(rank)
        if members:
            self._free[fabric] -= rank[1]
            self._make_ready(fabric)
        else:
            del self._members[fabric], self._free[fabric]

    def _unready(self, fabric: str) -> None:
        if len(self._members.get(fabric, ())) >= self.profile.nodes:
            self._ready.remove((self._free[fabric], fabric))

    def _make_ready(self, fabric: str) -> None:
        if len(self._members[fabric]) >= self.profile.nodes:
            self._ready.add((self._free[fabric], fabric))

    def choose(self, deployment: Deployment, fp: str) -> tuple[str, list[NodeView]] | None:
        """The fabric and members in rank order a full decision would pick, or None where none fits.

        Binpack takes the fabric with the fewest free GPUs left, spread the most; ties go
        to the lower fabric name either way (the key `_decide` compares)."""
        if not self._ready:
            return None
        nodes = self.profile.nodes
        if deployment.strategy == "binpack":
            fabric = self._ready[0][1]
            chosen = [self._views[rank[-1]] for rank in self._members[fabric][:nodes]]
            return fabric, chosen
        most = self._ready[-1][0]
        fabric = self._ready[self._ready.bisect_left((most, ""))][1]
        chosen = heapq.nsmallest(
            nodes,
            (self._views[rank[-1]] for rank in self._members[fabric]),
            key=lambda n: cached_score(n, self.profile, deployment, fp),
        )
        return fabric, chosen


@dataclass
class Usage:
    """What the placed shards take on each node."""

    gpus: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    ports: defaultdict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    shards: Counter[str] = field(default_factory=Counter)
    replicas_of: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    # Per node, the weights keys of its shards that the node stages itself (`Profile.staged_key`):
    # it holds them, or is staging them.
    weights: defaultdict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))

    @classmethod
    def of(cls, specs: Iterable[ShardSpec]) -> Usage:
        usage = cls()
        for spec in specs:
            usage.add(spec)
        return usage

    def copy(self) -> Usage:
        return Usage(
            defaultdict(set, {n: set(g) for n, g in self.gpus.items()}),
            defaultdict(set, {n: set(p) for n, p in self.ports.items()}),
            Counter(self.shards),
            defaultdict(Counter, {n: Counter(c) for n, c in self.replicas_of.items()}),
            defaultdict(Counter, {n: Counter(c) for n, c in self.weights.items()}),
        )

    def add(self, spec: ShardSpec) -> None:
        port = spec.members[spec.rank].port if spec.members else None
        self.take(spec.node, spec.gpus, port, spec.deployment, spec.profile.staged_key)

    def remove(self, spec: ShardSpec) -> None:
        port = spec.members[spec.rank].port if spec.members else None
        self.give_back(spec.node, spec.gpus, port, spec.deployment, spec.profile.staged_key)

    def take(
        self, node: str, gpus: Iterable[int], port: int | None, deployment: str, weights: str = ""
    ) -> None:
        self.gpus[node].update(gpus)
        self.shards[node] += 1
        self.replicas_of[node][deployment] += 1
        if port is not None:
            self.ports[node].add(port)
        if weights:
            self.weights[node][weights] += 1

    def give_back(
        self, node: str, gpus: Iterable[int], port: int | None, deployment: str, weights: str = ""
    ) -> None:
        self.gpus[node].difference_update(gpus)
        self.shards[node] -= 1
        self.replicas_of[node][deployment] -= 1
        if port is not None:
            self.ports[node].discard(port)
        if weights:
            self.weights[node][weights] -= 1


def _matches(node: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(node, p) for p in patterns)


class KeptIndex:
    """The NodeIndex of the active placement, kept current across its steps.

    `refresh` views again only the nodes whose status changed (`state.dirty_nodes`)
    or whose liveness or claim flipped, and placements and removals update the nodes
    they touch (`take`, `give_back`), so a step costs O(changes), not O(nodes).
    (Computing who is alive is the one pass over every node.)"""

    def __init__(self, config: ServerConfig, state: ClusterState, liveness: Liveness) -> None:
        self.config = config
        self.state = state
        self.liveness = liveness
        self.index = NodeIndex()
        # Bumped whenever the index is made anew (its generation restarts then).
        self.id = 0
        # Who was alive when the index was last brought up to date (None: never built).
        self.alive: frozenset[str] | None = None
        # The nodes claimed by two machines when the index was last brought up to date.
        self._claimed: frozenset[str] = frozenset()
        # What every held shard takes, this step's placements included.
        self.usage = Usage()
        self.at = 0.0
        # Nodes whose status was deleted since the controller last took them (`ctl delete node`).
        self.gone: set[str] = set()
        # Every model shape the nodes reported, by weights key, and each node's part of it.
        self.shapes: dict[str, ModelShape] = {}
        self._shapes_of: dict[str, dict[str, ModelShape]] = {}

    def reset(self, specs: Iterable[ShardSpec]) -> None:
        """What the held shards take, from scratch (after loading the buckets)."""
        self.usage = Usage.of(specs)

    def refresh(self, at: float) -> frozenset[str]:
        """Bring every node's view up to date for a step at `at`; the nodes alive then."""
        self.at = at
        alive = self.liveness.alive_nodes(at)
        claimed = frozenset(self.state.claims.contested(at))
        dirty = self.state.dirty_nodes
        self.state.dirty_nodes = set()
        if self._shapes_changed(dirty):
            # Every view is fitted with the cluster's shapes: a model one node reported for the
            # first time changes what fits on every node (a rare event: once per model staged).
            self.alive = None
        if self.alive is None:
            self.index = NodeIndex([self.view(n, at) for n in sorted(self.state.nodes)])
            self.id += 1
        else:
            for node in sorted(dirty | (alive ^ self.alive) | (claimed ^ self._claimed)):
                if node in self.state.nodes:
                    self.index.add(self.view(node, at))
                else:
                    self.index.remove(node)
                    self.gone.add(node)
        self.alive = alive
        self._claimed = claimed
        return alive

    def _shapes_changed(self, dirty: set[str]) -> bool:
        """Take the shapes the `dirty` nodes report now (all of them on the first step); whether
        the cluster's shapes changed."""
        names = set(self.state.nodes) | set(self._shapes_of) if self.alive is None else dirty
        moved = False
        for name in names:
            status = self.state.nodes.get(name)
            mine = dict(status.facts.shapes) if status is not None else {}
            if self._shapes_of.get(name, {}) != mine:
                moved = True
                if mine:
                    self._shapes_of[name] = mine
                else:
                    self._shapes_of.pop(name, None)
        if not moved:
            return False
        shapes: dict[str, ModelShape] = {}
        for name in sorted(self._shapes_of, reverse=True):  # the lowest node id's, where two differ
            shapes.update(self._shapes_of[name])
        if shapes == self.shapes:
            return False
        self.shapes = shapes
        return True

    def views(self, at: float, usage: Usage | None = None) -> list[NodeView]:
        return [self.view(name, at, usage) for name in sorted(self.state.nodes)]

    def view(self, name: str, at: float, usage: Usage | None = None) -> NodeView:
        """The node's view, or an unusable one where its status cannot be viewed."""
        try:
            return self._view(name, at, usage)
        except Exception as exc:
            return unusable_view(NodeView(node=name, alive=False), exc)

    def _view(self, name: str, at: float, usage: Usage | None) -> NodeView:
        usage = self.usage if usage is None else usage
        status = self.state.nodes[name]
        alive, since = self.liveness.alive(name, at)
        facts = status.facts
        lost_since = ""
        if not alive:
            wall = self.state.last_seen_wall.get(name)
            lost_since = (
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wall))
                if wall
                else "this placement started"
            )
        config = self.config
        held = frozenset(p for p, fp in facts.weights.items() if fp)
        return NodeView(
            node=name,
            alive=alive,
            lost_for_s=since,
            lost_since=lost_since,
            pools=frozenset(p for p, pats in config.pools.items() if _matches(name, pats)),
            fabric=next((f for f, fc in sorted(config.fabrics.items()) if _matches(name, fc.nodes)), ""),
            gpus=facts.gpus,
            used_gpus=frozenset(usage.gpus[name]),
            engines={e.name: e for e in status.engines},
            install=status.install,
            avx2=facts.has_avx2,
            hcas=facts.hcas,
            weights=held,
            mgmt_addr=facts.mgmt_addr or "127.0.0.1",
            shards=usage.shards[name],
            used_ports=frozenset(usage.ports[name]),
            replicas_of=dict(usage.replicas_of[name]),
            mgmt_iface=facts.mgmt_iface,
            claimed=self.state.claims.claimed(name, at) or "",
            cordoned=intent.words() if (intent := self.state.intents.get(name)) is not None else "",
            missing_models=self.state.missing_models.get(name, frozenset()),
            shapes=self.shapes,
            memory_mb=facts.memory_mb,
            coming=frozenset(k for k, n in usage.weights[name].items() if n > 0) - held,
        )

    def reindex(self, node: str) -> None:
        if node in self.state.nodes:
            self.index.add(self.view(node, self.at))

    def add(self, spec: ShardSpec) -> None:
        """A held shard taken: only its node's view changes."""
        self.usage.add(spec)
        self.reindex(spec.node)

    def remove(self, spec: ShardSpec) -> None:
        self.usage.remove(spec)
        self.reindex(spec.node)

    def take(
        self, node: str, gpus: Iterable[int], port: int | None, deployment: str, weights: str = ""
    ) -> None:
        """A rank decided and not yet named: its GPUs (and port) are taken for the next decision."""
        self.usage.take(node, gpus, port, deployment, weights)
        self.reindex(node)

    def give_back(
        self, node: str, gpus: Iterable[int], port: int | None, deployment: str, weights: str = ""
    ) -> None:
        self.usage.give_back(node, gpus, port, deployment, weights)
        self.reindex(node)
