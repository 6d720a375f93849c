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

import copy
import fnmatch
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import Deployment, ModelShape

from .config import ServerConfig
from .fabric import FabricFit
from .feasibility import NodeView, stale_marked, unusable_view
from .liveness import Liveness
from .state import ClusterState

log = logging.getLogger("llmgw.placement")


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
        self._fabric_fits: dict[tuple[str, str], FabricFit] = {}
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

    def copy(self) -> NodeIndex:
        """An index that changes apart from this one (the views themselves are shared: a view
        is never changed, only replaced)."""
        twin = NodeIndex()
        twin.views = dict(self.views)
        twin._buckets.update((k, set(nodes)) for k, nodes in self._buckets.items())
        for k, by_free in self._by_free.items():
            twin._by_free[k].update((free, nodes.copy()) for free, nodes in by_free.items())
        twin._by_weights.update((k, set(nodes)) for k, nodes in self._by_weights.items())
        twin.generation = self.generation
        twin._sorted = dict(self._sorted)  # each list is replaced, never changed
        twin._fabric_fits = {k: table.copy() for k, table in self._fabric_fits.items()}
        return twin

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

    def fabric_fit(self, profile: Profile, deployment: Deployment, fp: str) -> FabricFit:
        """The fabric table of a multi-node `profile` in the deployment's pool (`fp` is the
        profile's fingerprint), made from the candidates if there is none yet."""
        key = (fp, deployment.pool)
        table = self._fabric_fits.pop(key, None)
        if table is None:
            table = FabricFit(profile, deployment)
            table.fill([self.views[n] for n in self._buckets.get(table.bucket, set())])
            while len(self._fabric_fits) >= FABRIC_TABLES:
                del self._fabric_fits[next(iter(self._fabric_fits))]
        # Last in the dict is the most recently used.
        self._fabric_fits[key] = table
        return table


# Fabric tables a NodeIndex keeps (one per multi-node profile and pool decided): each
# costs an unfit() per changed candidate node, so tables of profiles since edited go.
FABRIC_TABLES = 32


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
    # A fork's nodes whose sets it copied already (None: it owns every one; see `fork`).
    owned: set[str] | None = field(default=None, compare=False, repr=False)

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

    def fork(self) -> Usage:
        """A copy that changes apart from this one, made by copying the per-node tables only:
        a node's own sets are copied when the fork first changes them (`_own`), so a step's
        fork costs a few dict copies, not a set per node."""
        return Usage(
            defaultdict(set, self.gpus),
            defaultdict(set, self.ports),
            Counter(self.shards),
            defaultdict(Counter, self.replicas_of),
            defaultdict(Counter, self.weights),
            owned=set(),
        )

    def _own(self, node: str) -> None:
        if self.owned is None or node in self.owned:
            return
        self.owned.add(node)
        gpus, ports = self.gpus.get(node), self.ports.get(node)
        self.gpus[node] = set(gpus) if gpus else set()
        self.ports[node] = set(ports) if ports else set()
        of, weights = self.replicas_of.get(node), self.weights.get(node)
        self.replicas_of[node] = of.copy() if of else Counter()
        self.weights[node] = weights.copy() if weights else Counter()

    def add(self, spec: ShardSpec) -> None:
        port = spec.members[spec.rank].port if spec.members else None
        self.take(spec.node, spec.gpus, port, spec.deployment, spec.profile.staged_key)

    def remove(self, spec: ShardSpec) -> None:
        port = spec.members[spec.rank].port if spec.members else None
        self.give_back(spec.node, spec.gpus, port, spec.deployment, spec.profile.staged_key)

    def take(
        self, node: str, gpus: Iterable[int], port: int | None, deployment: str, weights: str = ""
    ) -> None:
        self._own(node)
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
        self._own(node)
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
    they touch (`add`, `remove`, `take`), so a step costs O(changes), not O(nodes).
    (Computing who is alive is the one pass over every node.) A step decides on a
    `fork` of it, which it `adopt`s once the step's writes all landed."""

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
        # The nodes whose installer was silent (their install progress stale) then.
        self._stale: frozenset[str] = frozenset()
        # What every held shard takes, this step's placements included.
        self.usage = Usage()
        self.at = 0.0
        # Nodes whose status was deleted since the controller last took them (`ctl delete node`).
        self.gone: set[str] = set()
        # Every model shape the nodes reported, by weights key, and each node's part of it.
        self.shapes: dict[str, ModelShape] = {}
        self._shapes_of: dict[str, dict[str, ModelShape]] = {}

    def fork(self) -> KeptIndex:
        """A copy for one control step to decide on: what the step takes and frees changes the
        copy only, so this index keeps what the store says until the step's writes landed."""
        twin = copy.copy(self)
        twin.usage = self.usage.fork()
        twin.index = self.index.copy()
        return twin

    def adopt(self, fork: KeptIndex) -> None:
        """A fork whose every change was written: it becomes this index (and owns its sets:
        nothing else holds the ones it shared)."""
        self.index, self.usage = fork.index, fork.usage
        self.usage.owned = None

    def reset(self, specs: Iterable[ShardSpec]) -> None:
        """What the held shards take, from scratch (after loading the buckets)."""
        self.usage = Usage.of(specs)

    def refresh(self, at: float) -> frozenset[str]:
        """Bring every node's view up to date for a step at `at`; the nodes alive then."""
        self.at = at
        alive = self.liveness.alive_nodes(at)
        claimed = frozenset(self.state.claims.contested(at))
        stale = frozenset(n for n in self.state.with_installer if self.liveness.installer_stale(n, at))
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
            flipped = (alive ^ self.alive) | (claimed ^ self._claimed) | (stale ^ self._stale)
            for node in sorted(dirty | flipped):
                if node in self.state.nodes:
                    self.index.add(self.view(node, at))
                else:
                    self.index.remove(node)
                    self.gone.add(node)
        self.alive = alive
        self._claimed = claimed
        self._stale = stale
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
            install=stale_marked(status.install, name, self.liveness.installer_stale(name, at)),
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
