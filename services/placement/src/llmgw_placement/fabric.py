"""A multi-node profile's fitting candidates by fabric, kept current as the node index changes.

`NodeIndex` (index.py) keeps one `FabricFit` per multi-node profile fingerprint and pool
it decided for, and updates it from `add` and `remove`, so a multi-node decision reads
one fabric's members instead of examining every candidate.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

from sortedcontainers import SortedList

from llmgw_core.engines import Profile
from llmgw_core.events import Deployment

from .feasibility import NodeView, Reason, cached_score, unfit, weights_rank


class FabricFit:
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
        self._memo: dict[tuple[tuple[str, str, int], ...], list[Reason]] = {}
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

    def copy(self) -> FabricFit:
        """A table that changes apart from this one (the memo of fits is shared: it is pure)."""
        twin = FabricFit(self.profile, self.deployment)
        twin._memo = self._memo
        twin._fits = dict(self._fits)
        twin._views = dict(self._views)
        twin._members = {f: members.copy() for f, members in self._members.items()}
        twin._free = dict(self._free)
        twin._ready = self._ready.copy()
        return twin

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
