"""Decisions from a kept index against a straightforward reference.

A kept NodeIndex answers a multi-node decision from per-profile fabric tables it
updates as views come and go, instead of examining every candidate (and a one-node
binpack decision from its free-GPU buckets). Here a
randomized fleet (several fabrics, GPU classes and kinds, pools, partly used and
lost nodes) is changed step by step as the controller changes its index: replicas
placed and removed, nodes lost and back, GPUs swapped, nodes gone and new. After
every change each decision from the kept index must equal the reference's, which
examines every node the plain way, and the decision given a plain list.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import msgspec
import pytest

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState
from llmgw_placement.decide import (
    Assignment,
    NodeIndex,
    NodeView,
    Placement,
    Refusal,
    choose_gpus,
    decide,
    unfit,
)
from llmgw_placement.gpuclass import gpu_class

H100 = "NVIDIA H100 80GB HBM3"
H100_PCIE = "NVIDIA H100 PCIe 80GB"
A100 = "NVIDIA A100-SXM4-80GB"
VLLM = EngineState(name="vllm", state="configured", version="0.11.1")
SGLANG = EngineState(name="sglang", state="configured", version="0.5.0")
FABRICS = ("ib-a", "ib-b", "ib-c", "ib-d", "ib-e", "")
FABRIC_HCAS = {"ib-a": ("mlx5_0", "mlx5_1"), "ib-b": ("mlx5_2",), "ib-c": ("mlx5_0", "mlx5_3")}
PORTS = (30000, 30040)
MODEL = "/models/big"


def _gpus(rng: random.Random) -> tuple[GPUInfo, ...]:
    kind = rng.choice(["h100", "h100", "h100-old-driver", "h100-mixed", "a100", "h100-4", "none"])
    if kind == "none":
        return ()
    count = 4 if kind == "h100-4" else 8
    out = []
    for i in range(count):
        name, cap = (A100, "8.0") if kind == "a100" else (H100, "9.0")
        if kind == "h100-mixed" and i >= 4:
            # Same class, another name: a group over both kinds is refused by validation.
            name = H100_PCIE
        if kind == "h100-old-driver":
            # Same class, but fp8 is refused on these (a capability below 8.9).
            cap = "8.0"
        out.append(GPUInfo(index=i, name=name, compute_capability=cap, memory_mb=81559))
    return tuple(out)


def _engines(rng: random.Random) -> dict[str, EngineState]:
    roll = rng.random()
    if roll < 0.7:
        return {"vllm": VLLM}
    if roll < 0.8:
        return {"vllm": VLLM, "sglang": SGLANG}
    if roll < 0.9:
        return {"vllm": EngineState(name="vllm", state="installing")}
    return {"sglang": SGLANG}


def _node(rng: random.Random, i: int) -> NodeView:
    gpus = _gpus(rng)
    return NodeView(
        node=f"gpu-{i:03d}",
        alive=rng.random() > 0.1,
        lost_for_s=30.0,
        pools=rng.choice([frozenset({"default"}), frozenset({"batch"}), frozenset({"default", "batch"})]),
        fabric=rng.choice(FABRICS),
        gpus=gpus,
        used_gpus=frozenset(g.index for g in gpus if rng.random() < 0.3),
        engines=_engines(rng),
        hcas=rng.choice([(), ("mlx5_0", "mlx5_1", "mlx5_2"), ("mlx5_3",)]),
        weights=frozenset({MODEL}) if rng.random() < 0.2 else frozenset(),
        mgmt_addr=f"10.0.{i // 250}.{i % 250}",
        shards=rng.randrange(4),
        used_ports=frozenset(rng.sample(range(PORTS[0], PORTS[0] + 6), rng.randrange(3))),
        replicas_of={"chat": rng.randrange(3)} if rng.random() < 0.5 else {},
    )


def _changed(view: NodeView, **changes: object) -> NodeView:
    """A new view of the node (as the controller makes one): the old view's caches stay behind."""
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(view) if not f.name.startswith("_")}
    fields.update(changes)
    return NodeView(**fields)  # type: ignore[arg-type]


def _profile(**kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "big",
        "engine": "vllm",
        "model_path": MODEL,
        "gpu_class": "H100-80G",
        "tp": 8,
        "nodes": 2,
        "gpus_per_node": 4,
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


PROFILES = [
    _profile(),
    _profile(tp=6, nodes=3, gpus_per_node=2),
    _profile(args=["--quantization", "fp8"]),
    _profile(gpu_class="A100-80G", tp=4, gpus_per_node=2),
    _profile(engine="sglang", tp=16, gpus_per_node=8),
    # One-node profiles take another path through the index: checked the same way.
    _profile(tp=4, nodes=1, gpus_per_node=None),
    _profile(gpu_class="A100-80G", tp=2, nodes=1, gpus_per_node=None, args=["--quantization", "fp8"]),
]
DEPLOYMENTS = [
    Deployment(name="chat", profile="big", replicas=1, pool=pool, strategy=strategy)  # type: ignore[arg-type]
    for pool in ("default", "batch", "")
    for strategy in ("binpack", "spread")
]


def _free(view: NodeView, cls: str) -> list[GPUInfo]:
    return [g for g in view.gpus if g.index not in view.used_gpus and gpu_class(g) == cls]


def reference(dep: Deployment, profile: Profile, views: list[NodeView]) -> Placement | None:
    """The rules written plainly. One node: the best-scored fitting node. Many: of the
    fabrics with enough fitting nodes, binpack takes the one with the fewest free GPUs left
    after the replica, spread the most, ties to the lower fabric name; in it the best-scored
    nodes (weights held, then fewest GPUs left or fewest replicas of the deployment, ...),
    each on its contiguous GPUs, on the lowest port free on every member, with the fabric's
    adapters the node has."""
    need = profile.per_node_gpus
    fit = [v for v in views if unfit(v, profile, dep) is None]

    def score(v: NodeView) -> tuple[object, ...]:
        left = len(_free(v, profile.gpu_class)) - need
        if dep.strategy == "spread":
            return (MODEL not in v.weights, v.replicas_of.get(dep.name, 0), -left, v.shards, v.node)
        return (MODEL not in v.weights, left, -v.shards, v.node)

    if profile.nodes == 1:
        if not fit:
            return None
        best = min(fit, key=score)
        gpus = tuple(g.index for g in choose_gpus(_free(best, profile.gpu_class), need))
        return Placement((Assignment(node=best.node, rank=0, gpus=gpus, addr=best.mgmt_addr),))
    options = []
    for fabric in sorted({v.fabric for v in fit}):
        members = [v for v in fit if v.fabric == fabric]
        if len(members) < profile.nodes:
            continue
        left = sum(len(_free(v, profile.gpu_class)) for v in members) - need * profile.nodes
        options.append(((left if dep.strategy == "binpack" else -left, fabric), members))
    if not options:
        return None
    (_, fabric), members = min(options, key=lambda o: o[0])
    chosen = sorted(members, key=score)[: profile.nodes]
    used = set().union(*(v.used_ports for v in chosen))
    port = next(p for p in range(PORTS[0], PORTS[1] + 1) if p not in used)
    return Placement(
        tuple(
            Assignment(
                node=v.node,
                rank=rank,
                gpus=tuple(g.index for g in choose_gpus(_free(v, profile.gpu_class), need)),
                addr=v.mgmt_addr,
                port=port,
                hcas=tuple(h for h in FABRIC_HCAS.get(fabric, ()) if not v.hcas or h in v.hcas),
                mgmt_iface=v.mgmt_iface,
            )
            for rank, v in enumerate(chosen)
        ),
        fabric=fabric,
    )


def _check(index: NodeIndex, views: dict[str, NodeView]) -> tuple[int, int]:
    """Every deployment and profile decided from the kept index, against the reference and a
    plain list; how many were placed and refused (so the test shows it saw both)."""
    placed = refused = 0
    plain = [views[n] for n in sorted(views)]
    for profile in PROFILES:
        for dep in DEPLOYMENTS:
            got = decide(dep, profile, index, fabric_hcas=FABRIC_HCAS, port_range=PORTS)
            want = reference(dep, profile, plain)
            from_list = decide(dep, profile, plain, fabric_hcas=FABRIC_HCAS, port_range=PORTS)
            assert got == from_list, (profile, dep)
            if want is None:
                assert isinstance(got, Refusal), (profile, dep, got)
                refused += 1
            else:
                assert got == want, (profile, dep)
                placed += 1
    return placed, refused


def _step(rng: random.Random, index: NodeIndex, views: dict[str, NodeView], serial: list[int]) -> None:
    """One change to the fleet, applied to the kept index as the controller applies it."""
    roll = rng.random()
    name = rng.choice(sorted(views))
    view = views[name]
    new: NodeView | None
    if roll < 0.35:
        # A replica placed: the chosen nodes' GPUs, shard counts, ports and replica counts.
        profile, dep = rng.choice(PROFILES), rng.choice(DEPLOYMENTS)
        decision = decide(dep, profile, index, fabric_hcas=FABRIC_HCAS, port_range=PORTS)
        if isinstance(decision, Placement):
            for m in decision.members:
                old = views[m.node]
                views[m.node] = _changed(
                    old,
                    used_gpus=old.used_gpus | frozenset(m.gpus),
                    shards=old.shards + 1,
                    used_ports=old.used_ports | {m.port},
                    replicas_of={**old.replicas_of, dep.name: old.replicas_of.get(dep.name, 0) + 1},
                )
                index.add(views[m.node])
        return
    if roll < 0.5:
        # A replica removed: some GPUs free again.
        kept = frozenset(i for i in view.used_gpus if rng.random() < 0.4)
        new = _changed(view, used_gpus=kept, shards=max(0, view.shards - 1))
    elif roll < 0.6:
        new = _changed(view, alive=not view.alive, lost_for_s=12.0)
    elif roll < 0.68:
        new = _changed(view, gpus=_gpus(rng), used_gpus=frozenset())
    elif roll < 0.74:
        new = _changed(view, fabric=rng.choice(FABRICS))
    elif roll < 0.8:
        new = _changed(view, engines=_engines(rng))
    elif roll < 0.85:
        new = _changed(view, pools=rng.choice([frozenset({"default"}), frozenset({"batch"})]))
    elif roll < 0.9:
        new = _changed(view, weights=view.weights ^ {MODEL})
    elif roll < 0.95:
        # A node gone from the cluster.
        del views[name]
        index.remove(name)
        return
    else:
        serial[0] += 1
        new = _node(rng, serial[0])
    views[new.node] = new
    index.add(new)


@pytest.mark.parametrize("seed", range(4))
def test_the_kept_index_decides_as_the_reference_through_every_change(seed: int) -> None:
    rng = random.Random(seed)
    views = {v.node: v for v in (_node(rng, i) for i in range(rng.randrange(40, 90)))}
    serial = [len(views)]
    index = NodeIndex(list(views.values()))
    placed = refused = 0
    for _ in range(30):
        p, r = _check(index, views)
        placed, refused = placed + p, refused + r
        for _ in range(rng.randrange(1, 4)):
            _step(rng, index, views, serial)
    assert placed > 100, placed
    assert refused > 100, refused


def test_evicted_fabric_tables_are_made_again_correctly(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for two tables only, the five profiles and three pools evict each other on
    every pass; a table made again after changes must still decide as the reference."""
    monkeypatch.setattr(importlib.import_module("llmgw_placement.index"), "FABRIC_TABLES", 2)
    rng = random.Random(99)
    views = {v.node: v for v in (_node(rng, i) for i in range(60))}
    serial = [len(views)]
    index = NodeIndex(list(views.values()))
    for _ in range(15):
        _check(index, views)
        assert len(index._fabric_fits) <= 2
        for _ in range(3):
            _step(rng, index, views, serial)


def test_a_spread_decision_over_one_big_fabric_takes_the_emptiest_nodes() -> None:
    """Spread ranks the members of the chosen fabric by the deployment's replicas on them,
    which the table does not keep in order: it must still rank them at decision time."""
    gpus = tuple(GPUInfo(index=i, name=H100, compute_capability="9.0", memory_mb=81559) for i in range(8))
    views = [
        NodeView(
            node=f"gpu-{i:02d}",
            fabric="ib-a",
            gpus=gpus,
            engines={"vllm": VLLM},
            pools=frozenset({"default"}),
            replicas_of={"chat": 0 if i in (7, 3) else 1},
        )
        for i in range(10)
    ]
    index = NodeIndex(views)
    spread = Deployment(name="chat", profile="big", replicas=1, pool="default", strategy="spread")
    decision = decide(spread, _profile(), index)
    assert isinstance(decision, Placement)
    assert [m.node for m in decision.members] == ["gpu-03", "gpu-07"]
    binpack = decide(msgspec.structs.replace(spread, strategy="binpack"), _profile(), index)
    assert isinstance(binpack, Placement)
    assert [m.node for m in binpack.members] == ["gpu-00", "gpu-01"]


@pytest.mark.parametrize("kept", [False, True])
def test_a_view_kept_across_a_strategy_switch_ranks_by_the_new_strategy(kept: bool) -> None:
    """Regression: each view cached its score per (profile, deployment, pool) but not per
    strategy, so after a deployment switched from binpack to spread, views kept from before
    still ranked by binpack's score and spread put the replica where binpack would."""
    gpus = tuple(GPUInfo(index=i, name=H100, compute_capability="9.0", memory_mb=81559) for i in range(8))
    views = [
        NodeView(
            node="gpu-01",
            fabric="ib-a",
            gpus=gpus,
            engines={"vllm": VLLM},
            used_gpus=frozenset({0, 1, 2, 3}),
            replicas_of={"chat": 1},
        ),
        NodeView(node="gpu-02", fabric="ib-a", gpus=gpus, engines={"vllm": VLLM}),
        NodeView(node="gpu-03", fabric="ib-a", gpus=gpus, engines={"vllm": VLLM}),
    ]
    nodes: list[NodeView] | NodeIndex = NodeIndex(views) if kept else views
    binpack = Deployment(name="chat", profile="big", replicas=1)
    first = decide(binpack, _profile(), nodes)
    assert isinstance(first, Placement)
    assert [m.node for m in first.members] == ["gpu-01", "gpu-02"]
    then = decide(msgspec.structs.replace(binpack, strategy="spread"), _profile(), nodes)
    assert isinstance(then, Placement)
    assert [m.node for m in then.members] == ["gpu-02", "gpu-03"]
