"""The placement decision: a pure function from the cluster's state to a placement or a refusal.

Same input, same output: every choice ends in a tie-break on node id, so a
restarted placement (or a test) computes exactly what the last one did.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain

from sortedcontainers import SortedList

from llmgw_core.engines import GPUInfo, Profile, validate_profile
from llmgw_core.events import Deployment, EngineState

from .gpuclass import gpu_class

# How an operator names each engine, for the refusals that speak of its builds.
ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}


@dataclass(frozen=True)
class NodeView:
    """What placement knows of one node."""

    node: str
    alive: bool = True
    lost_for_s: float = 0.0
    # When the node was last heard, as UTC wall-clock text: a refusal that quotes it
    # stays the same while the node stays lost, so it is published once, not every step.
    lost_since: str = ""
    pools: frozenset[str] = frozenset()
    fabric: str = ""
    gpus: tuple[GPUInfo, ...] = ()
    used_gpus: frozenset[int] = frozenset()
    engines: Mapping[str, EngineState] = field(default_factory=dict)
    install: str = ""
    avx2: bool = True
    hcas: tuple[str, ...] = ()
    weights: frozenset[str] = frozenset()
    mgmt_addr: str = "127.0.0.1"
    shards: int = 0
    used_ports: frozenset[int] = frozenset()
    replicas_of: Mapping[str, int] = field(default_factory=dict)
    mgmt_iface: str = ""
    # `n1 is claimed by two machines: …` while two machines send its heartbeats: nothing
    # more is placed on it (which of them would run it?).
    claimed: str = ""

    # A view never changes once made: what is derived from it is computed once.
    _free: dict[str, list[GPUInfo]] = field(default_factory=dict, compare=False, repr=False)
    _classes: list[frozenset[str]] = field(default_factory=list, compare=False, repr=False)
    _counts: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _chosen: dict[tuple[str, int], list[GPUInfo]] = field(default_factory=dict, compare=False, repr=False)
    # unfit() per (profile fingerprint, deployment name, pool): the many replicas of one
    # deployment placed in a step meet the same unchanged views again and again.
    _unfit: dict[tuple[str, str, str], str | None] = field(default_factory=dict, compare=False, repr=False)
    # _score() per (profile fingerprint, deployment name, strategy).
    _scores: dict[tuple[str, str, str], tuple[object, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def free_gpus(self, cls: str) -> list[GPUInfo]:
        found = self._free.get(cls)
        if found is None:
            found = [g for g in self.gpus if g.index not in self.used_gpus and gpu_class(g) == cls]
            self._free[cls] = found
        return found

    @property
    def classes(self) -> frozenset[str]:
        if not self._classes:
            self._classes.append(frozenset(gpu_class(g) for g in self.gpus))
        return self._classes[0]

    def count_of(self, cls: str) -> int:
        """GPUs of class `cls` on the node, free or not."""
        found = self._counts.get(cls)
        if found is None:
            found = self._counts[cls] = sum(1 for g in self.gpus if gpu_class(g) == cls)
        return found

    def chosen(self, cls: str, n: int) -> list[GPUInfo]:
        """The `n` free GPUs of class `cls` a rank would get (see `choose_gpus`)."""
        found = self._chosen.get((cls, n))
        if found is None:
            found = self._chosen[(cls, n)] = choose_gpus(self.free_gpus(cls), n)
        return found


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
        if not view.alive or view.claimed:
            return []
        return [
            ((engine, cls), len(view.free_gpus(cls)) if cls else 0)
            for engine, state in view.engines.items()
            if state.runs
            # A CPU build of the engine takes CPU profiles only (see unfit).
            for cls in ((*view.classes, "") if not state.cpu_only else ("",))
        ]

    def add(self, view: NodeView) -> None:
        self.remove(view.node)
        self.generation += 1
        self.views[view.node] = view
        keys = self._keys(view)
        for key, free in keys:
            self._sorted.pop(key, None)
            self._buckets[key].add(view.node)
            self._by_free[key][free].add((-view.shards, view.node))
        for path in view.weights:
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
        for path in old.weights:
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
        # node -> (its fabric, its rank key): the key is binpack's score (see _score) with
        # free GPUs for free GPUs left, which orders the same for one profile.
        self._fits: dict[str, tuple[str, tuple[bool, int, int, str]]] = {}
        self._views: dict[str, NodeView] = {}
        self._members: dict[str, SortedList] = {}
        self._free: dict[str, int] = {}
        # (free GPUs, fabric) of the fabrics with enough fitting nodes for a replica.
        self._ready = SortedList()

    def fill(self, views: Sequence[NodeView]) -> None:
        """Every candidate at once into an empty table: each sorted list made once, not grown."""
        ranks: dict[str, list[tuple[bool, int, int, str]]] = defaultdict(list)
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

    def _rank(self, view: NodeView) -> tuple[bool, int, int, str] | None:
        if unfit(view, self.profile, self.deployment, self._memo) is not None:
            return None
        free = len(view.free_gpus(self.profile.gpu_class))
        return (self.profile.weights_key not in view.weights, free, -view.shards, view.node)

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
            key=lambda n: _cached_score(n, self.profile, deployment, fp),
        )
        return fabric, chosen


@dataclass(frozen=True)
class Assignment:
    node: str
    rank: int
    gpus: tuple[int, ...]
    addr: str
    port: int = 0
    hcas: tuple[str, ...] = ()
    mgmt_iface: str = ""


@dataclass(frozen=True)
class Placement:
    members: tuple[Assignment, ...]
    fabric: str = ""


@dataclass(frozen=True)
class Refusal:
    reasons: tuple[tuple[str, str], ...]

    def text(self) -> str:
        if not self.reasons:
            return "no nodes known"
        return "; ".join(f"{node}: {reason}" for node, reason in self.reasons)

    def summary(self, limit: int = 5) -> str:
        """For a log line: every node when a few, else the reasons counted.

        `5000 nodes refused: 4998 x 0 of 8 GPUs free, profile needs 1; 2 x lost: …`"""
        if len(self.reasons) <= limit:
            return self.text()
        counts = Counter(reason for _, reason in self.reasons)
        parts = [f"{n} x {reason}" for reason, n in counts.most_common(limit)]
        rest = len(counts) - limit
        more = f"; and {rest} other reasons" if rest > 0 else ""
        return f"{len(self.reasons)} nodes refused: {'; '.join(parts)}{more}"


Decision = Placement | Refusal


def gpus_needed(profile: Profile) -> int:
    return profile.per_node_gpus if profile.gpu_class else 0


def unfit(
    node: NodeView,
    profile: Profile,
    deployment: Deployment,
    memo: dict[tuple[tuple[str, str, int], ...], list[str]] | None = None,
) -> str | None:
    """Why `node` cannot take one rank of `profile`, in the node's own words where it gave them.

    `memo` keeps the profile's validation per kind of GPU set across the nodes of one
    decision: a fleet has few kinds of GPU, and validating each node's anew is most
    of the cost of a multi-node decision.

    Of the deployment only its pool is read: a NodeIndex keeps one fabric table per
    profile and pool for every deployment of them (reading more would need more in its key)."""
    if not node.alive:
        if node.lost_since:
            return f"lost: no heartbeat since {node.lost_since}"
        return f"lost {int(node.lost_for_s)} s ago"
    if node.claimed:
        return node.claimed
    if deployment.pool and deployment.pool not in node.pools:
        return f"not in pool {deployment.pool}"
    engine = node.engines.get(profile.engine)
    if engine is None:
        return node.install or f"engine {profile.engine} not installed"
    if not engine.runs:
        # The node's own words: the install's progress while it installs, else the detail
        # the installer gave (why it failed, the library a broken build misses).
        words = engine.detail or (
            node.install.removeprefix("installing: ") if engine.state == "installing" else ""
        )
        return (
            f"engine {profile.engine} {engine.state}: {words}"
            if words
            else f"engine {profile.engine} {engine.state}"
        )
    need = gpus_needed(profile)
    if profile.gpu_class and engine.cpu_only:
        # The node installed the CPU build (its driver runs none of the CUDA builds): a GPU
        # profile there would run on the CPU, several times slower, with nothing looking wrong.
        return f"engine {profile.engine} is the CPU build here: {engine.cpu_only}"
    if profile.gpu_class:
        if not node.gpus:
            return f"no GPUs, profile needs {profile.gpu_class}"
        if profile.gpu_class not in node.classes:
            return f"GPU class {', '.join(sorted(node.classes))}, profile needs {profile.gpu_class}"
        free = node.free_gpus(profile.gpu_class)
        if len(free) < need:
            return f"{len(free)} of {node.count_of(profile.gpu_class)} GPUs free, profile needs {need}"
        chosen = node.chosen(profile.gpu_class, need)
        kind = tuple((g.name, g.compute_capability, g.memory_mb) for g in chosen)
        problems = memo.get(kind) if memo is not None else None
        if problems is None:
            problems = validate_profile(profile, chosen)
            if memo is not None:
                memo[kind] = problems
        if problems:
            return problems[0].split(": ", 1)[1]
    elif not node.avx2 and profile.engine != "sim":
        # Refused, not only warned: a CPU replica there looks as healthy as any other
        # and answers several times slower (docs/placement.md, "No AVX2").
        name = ENGINE_NAMES.get(profile.engine, profile.engine)
        return (
            f"no AVX2: {name}'s CPU build would run several times slower here; "
            "place CPU profiles on nodes with AVX2 (`llmgw ctl nodes` marks those without), "
            "or give the profile a gpu_class"
        )
    if profile.nodes > 1 and not node.fabric:
        return f"on no fabric; profile needs {profile.nodes} nodes on one fabric"
    return None


def choose_gpus(free: Sequence[GPUInfo], n: int) -> list[GPUInfo]:
    """The first run of `n` consecutive indices if there is one, else the lowest `n`.

    Contiguous GPUs usually share a PCIe switch or NVLink domain; scattering a
    tensor-parallel group over the machine costs bandwidth.
    """
    if n <= 0:
        return []
    ordered = sorted(free, key=lambda g: g.index)
    for start in range(len(ordered) - n + 1):
        window = ordered[start : start + n]
        if window[-1].index - window[0].index == n - 1:
            return window
    return ordered[:n]


def _score(node: NodeView, profile: Profile, deployment: Deployment) -> tuple[object, ...]:
    has_weights = profile.weights_key in node.weights
    free_after = len(node.free_gpus(profile.gpu_class)) - gpus_needed(profile) if profile.gpu_class else 0
    if deployment.strategy == "spread":
        return (
            not has_weights,
            node.replicas_of.get(deployment.name, 0),
            -free_after,
            node.shards,
            node.node,
        )
    # binpack: the tightest fit first, keeping whole nodes free for big models.
    return (not has_weights, free_after, -node.shards, node.node)


def _cached_score(node: NodeView, profile: Profile, deployment: Deployment, fp: str) -> tuple[object, ...]:
    # The strategy is part of the key: keyed without it, a view kept across a deployment's
    # switch from binpack to spread went on ranking by the binpack score it cached first.
    key = (fp, deployment.name, deployment.strategy)
    found = node._scores.get(key)
    if found is None:
        found = node._scores[key] = _score(node, profile, deployment)
    return found


def _port(nodes: Sequence[NodeView], port_range: tuple[int, int]) -> int:
    used = set().union(*(n.used_ports for n in nodes))
    for port in range(port_range[0], port_range[1] + 1):
        if port not in used:
            return port
    raise ValueError(f"no free port in {port_range[0]}-{port_range[1]} on {', '.join(n.node for n in nodes)}")


def decide(
    deployment: Deployment,
    profile: Profile,
    nodes: Sequence[NodeView] | NodeIndex,
    *,
    fabric_hcas: Mapping[str, tuple[str, ...]] | None = None,
    port_range: tuple[int, int] = (30000, 39999),
) -> Decision:
    """Where one new replica of `deployment` goes, or every node's reason why nowhere.

    Given a NodeIndex, only the candidates (engine running, GPU class present)
    are examined unless the replica cannot be placed, when every node's reason
    is needed anyway; a multi-node profile reads the index's fabric table for
    its profile and pool (`_FabricFit`) and examines the chosen fabric only.
    """
    if isinstance(nodes, NodeIndex) and profile.nodes > 1:
        # A kept index keeps each multi-node profile's fabric table current: the decision
        # reads it instead of examining every candidate. (A plain list is indexed for this
        # one call, so building the table too would only add to its cost.)
        fp = profile.fingerprint()
        found = nodes.fabric_fit(profile, deployment, fp).choose(deployment, fp)
        if found is not None:
            return _assemble(profile, *found, fabric_hcas, port_range)
        return _decide(deployment, profile, nodes.all(), fabric_hcas, port_range)
    index = nodes if isinstance(nodes, NodeIndex) else NodeIndex(nodes)
    if profile.nodes <= 1 and profile.gpu_class and deployment.strategy == "binpack":
        # Binpack's order is (holds the weights, fewest GPUs left, ...): look at the
        # weight holders, then walk the free-GPU buckets upwards; the first bucket
        # with a fitting node holds the answer, so a big fleet is not scanned.
        need = gpus_needed(profile)
        holders = [v for v in index.holding(profile.weights_key) if index.is_candidate(profile, v.node)]
        # In score order, the first node that fits is the best. A weight holder that does
        # not fit here does not fit in its free-GPU bucket either, so the buckets' own order
        # (which ignores weights) picks the same node the full score would.
        ordered = chain(
            sorted(holders, key=lambda v: _score(v, profile, deployment)), index.binpack_order(profile, need)
        )
        memo: dict[tuple[tuple[str, str, int], ...], list[str]] = {}
        # Kept in the view under _decide's key: _decide finds it there for the winner, and
        # the next decision for the deployment finds it for every node walked past.
        cache_key = (profile.fingerprint(), deployment.name, deployment.pool)
        for view in ordered:
            if cache_key not in view._unfit:
                view._unfit[cache_key] = unfit(view, profile, deployment, memo)
            if view._unfit[cache_key] is None:
                return _decide(deployment, profile, [view], fabric_hcas, port_range)
    else:
        decision = _decide(deployment, profile, index.candidates(profile), fabric_hcas, port_range)
        if isinstance(decision, Placement):
            return decision
    return _decide(deployment, profile, index.all(), fabric_hcas, port_range)


def _decide(
    deployment: Deployment,
    profile: Profile,
    nodes: Sequence[NodeView],
    fabric_hcas: Mapping[str, tuple[str, ...]] | None,
    port_range: tuple[int, int],
) -> Decision:
    reasons: dict[str, str] = {}
    fit: list[NodeView] = []
    memo: dict[tuple[tuple[str, str, int], ...], list[str]] = {}
    fp = profile.fingerprint()
    cache_key = (fp, deployment.name, deployment.pool)
    for node in nodes:
        if cache_key in node._unfit:
            why = node._unfit[cache_key]
        else:
            why = node._unfit[cache_key] = unfit(node, profile, deployment, memo)
        if why is None:
            fit.append(node)
        else:
            reasons[node.node] = why
    need = gpus_needed(profile)
    if profile.nodes <= 1:
        if not fit:
            return Refusal(tuple(sorted(reasons.items())))
        best = min(fit, key=lambda n: _score(n, profile, deployment))
        gpus = choose_gpus(best.free_gpus(profile.gpu_class), need) if need else []
        return Placement(
            (
                Assignment(
                    node=best.node,
                    rank=0,
                    gpus=tuple(g.index for g in gpus),
                    addr=best.mgmt_addr,
                    mgmt_iface=best.mgmt_iface,
                ),
            )
        )
    by_fabric: dict[str, list[NodeView]] = defaultdict(list)
    for node in fit:
        by_fabric[node.fabric].append(node)
    # The fabric first (its key names it, so no two tie), then its members: ranking the
    # members of every fabric would cost a sort per fabric for one winner.
    winner: tuple[tuple[int, str], list[NodeView]] | None = None
    for fabric, members in by_fabric.items():
        if len(members) < profile.nodes:
            for node in members:
                reasons[node.node] = (
                    f"fabric {fabric} has {len(members)} fitting node{'s' if len(members) != 1 else ''}, "
                    f"profile needs {profile.nodes}"
                )
            continue
        free_after = sum(len(n.free_gpus(profile.gpu_class)) for n in members) - need * profile.nodes
        key = (free_after, fabric) if deployment.strategy == "binpack" else (-free_after, fabric)
        if winner is None or key < winner[0]:
            winner = (key, members)
    if winner is None:
        return Refusal(tuple(sorted(reasons.items())))
    (_, fabric), members = winner
    chosen = heapq.nsmallest(profile.nodes, members, key=lambda n: _cached_score(n, profile, deployment, fp))
    return _assemble(profile, fabric, chosen, fabric_hcas, port_range)


def _assemble(
    profile: Profile,
    fabric: str,
    chosen: Sequence[NodeView],
    fabric_hcas: Mapping[str, tuple[str, ...]] | None,
    port_range: tuple[int, int],
) -> Placement:
    """A multi-node replica on `chosen` (in rank order) over `fabric`."""
    need = gpus_needed(profile)
    port = _port(chosen, port_range)
    hcas_of_fabric = (fabric_hcas or {}).get(fabric, ())
    members_out = []
    for rank, node in enumerate(chosen):
        gpus = choose_gpus(node.free_gpus(profile.gpu_class), need) if need else []
        # Only the chosen fabric's adapters: see NCCL_IB_HCA in llmgw_core.engines.
        hcas = tuple(h for h in hcas_of_fabric if not node.hcas or h in node.hcas)
        members_out.append(
            Assignment(
                node=node.node,
                rank=rank,
                gpus=tuple(g.index for g in gpus),
                addr=node.mgmt_addr,
                port=port,
                hcas=hcas,
                mgmt_iface=node.mgmt_iface,
            )
        )
    return Placement(tuple(members_out), fabric=fabric)
