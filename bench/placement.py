"""How long one placement decision takes as the cluster grows, scanning every node vs the index."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import msgspec

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState
from llmgw_placement.decide import NodeIndex, NodeView, Placement, decide

VLLM = {"vllm": EngineState(name="vllm", state="configured", version="0.11.1")}
SGLANG = {"sglang": EngineState(name="sglang", state="configured", version="0.5.0")}

# decisions/s with the prebuilt index at 5,000 nodes (the scale target).
TARGETS = {"TP=4 one node": 10_000, "TP=8 over 2 nodes": 1_000}


def _gpus(name: str) -> tuple[GPUInfo, ...]:
    return tuple(GPUInfo(index=i, name=name, compute_capability="9.0", memory_mb=81559) for i in range(8))


H100, A100 = _gpus("NVIDIA H100 80GB HBM3"), _gpus("NVIDIA A100-SXM4-80GB")


def _nodes(n: int) -> list[NodeView]:
    """A mixed fleet: a quarter H100 nodes with vLLM, the rest A100s or SGLang nodes."""
    out = []
    for i in range(n):
        kind = i % 4
        out.append(
            NodeView(
                node=f"gpu-{i:05d}",
                gpus=H100 if kind in (0, 1) else A100,
                engines=VLLM if kind in (0, 2) else SGLANG,
                used_gpus=frozenset(range(i % 8)),
                pools=frozenset({"default"}),
                fabric=f"ib-{i // 64}",
            )
        )
    return out


def _taken(view: NodeView, gpus: tuple[int, ...]) -> NodeView:
    """The node's view once a shard holds `gpus` on it: a new view, as the controller makes one."""
    return NodeView(
        node=view.node,
        gpus=view.gpus,
        engines=view.engines,
        used_gpus=view.used_gpus | frozenset(gpus),
        pools=view.pools,
        fabric=view.fabric,
        shards=view.shards + 1,
    )


def _time(fn: Callable[[], object], repeat: int) -> float:
    # The garbage of building the fleets collected first: a full collection landing in a
    # short timed loop otherwise adds milliseconds that no decision caused.
    gc.collect()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _placing(
    dep: Deployment, profile: Profile, nodes: list[NodeView], count: int, indexed: bool
) -> tuple[float, float, float, list[object]]:
    """`count` replicas placed one after another, each taking its GPUs before the next decision
    (as in the controller's step). Seconds for the first decision; mean seconds of each later
    decision, and of bringing the views (and index) up to date after it; the decisions."""
    views = {v.node: v for v in nodes}
    index = NodeIndex(nodes) if indexed else None
    decisions: list[object] = []
    deciding: list[float] = []
    updating: list[float] = []
    gc.collect()
    for _ in range(count):
        start = time.perf_counter()
        decision = decide(dep, profile, index if index is not None else list(views.values()))
        decided = time.perf_counter()
        decisions.append(decision)
        if isinstance(decision, Placement):
            for member in decision.members:
                views[member.node] = _taken(views[member.node], member.gpus)
                if index is not None:
                    index.add(views[member.node])
        deciding.append(decided - start)
        updating.append(time.perf_counter() - decided)
    later = max(1, count - 1)
    return deciding[0], sum(deciding[1:]) / later, sum(updating[1:]) / later, decisions


def run(quick: bool = False) -> str:
    dep = Deployment(name="chat", profile="p", replicas=1, pool="default")
    profiles = {
        "TP=4 one node": msgspec.convert(
            {"name": "p", "engine": "vllm", "model_path": "/m", "gpu_class": "H100-80G", "tp": 4}, Profile
        ),
        "TP=8 over 2 nodes": msgspec.convert(
            {
                "name": "p",
                "engine": "vllm",
                "model_path": "/m",
                "gpu_class": "H100-80G",
                "tp": 8,
                "nodes": 2,
                "gpus_per_node": 4,
            },
            Profile,
        ),
    }
    sizes = (100, 1000) if quick else (100, 1000, 5000)
    lines = [
        "## Placement decision time",
        "",
        "`python -m bench`: one `decide()` call for a new replica over N nodes (a quarter of them "
        "H100 nodes running vLLM, the profile's engine and class; fabrics of 64 nodes), mean of "
        "repeated calls. Baseline: the same call given a plain list of views, which it must index "
        "first (every node examined). The controller keeps its index across control steps and "
        "updates it as replicas are placed. Target, with the prebuilt "
        f"index at 5,000 nodes: {TARGETS['TP=4 one node']:,} decisions/s for one-node profiles, "
        f"{TARGETS['TP=8 over 2 nodes']:,} decisions/s for two-node TP=8. *Same*: both ways "
        "decided the same.",
        "",
        "| nodes | profile | plain list (ms) | prebuilt index (ms) | speed-up | prebuilt index "
        "(decisions/s) | target (decisions/s) | same |",
        "|---|---|---|---|---|---|---|---|",
    ]
    placing = [
        "",
        "Placing replicas one after another, as a control step does: after each placement the "
        "new views of its nodes go into the index (or the plain list) before the next decision. "
        "The first decision on a fresh index is shown apart: it fills what the index keeps for "
        "the profile (for a multi-node profile, its fitting nodes by fabric), once per profile "
        "and pool while the index lives. Later decisions and the index updates after them "
        "(making the new views and `NodeIndex.add`, fabric tables included), mean. *Same*: both "
        "ways placed every replica on the same nodes and GPUs.",
        "",
        "| nodes | profile | replicas | first decision, fresh index (ms) | plain list: decision (ms) "
        "| prebuilt index: decision (ms) | speed-up | prebuilt index (decisions/s) "
        "| target (decisions/s) | index update per replica (ms) | same |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        nodes = _nodes(n)
        index = NodeIndex(nodes)
        for label, profile in profiles.items():
            target = f"{TARGETS[label]:,}" if n == 5000 else "-"
            scan = _time(lambda nodes=nodes, p=profile: decide(dep, p, nodes), max(3, 2000 // n))
            first = decide(dep, profile, index)
            indexed = _time(lambda index=index, p=profile: decide(dep, p, index), 500)
            same = "yes" if first == decide(dep, profile, nodes) else "NO"
            lines.append(
                f"| {n} | {label} | {scan * 1000:.3f} | {indexed * 1000:.3f} | {scan / indexed:,.0f}x "
                f"| {1 / indexed:,.0f} | {target} | {same} |"
            )
            # Each replica takes 4 or 8 of the ~1.5 n free H100s: n // 20 of them leave most free.
            count = max(10, n // 20)
            _, scan, _, by_list = _placing(dep, profile, nodes, max(3, min(count, 4000 // n)), indexed=False)
            cold, indexed, update, by_index = _placing(dep, profile, nodes, count, indexed=True)
            same = "yes" if by_index[: len(by_list)] == by_list else "NO"
            placing.append(
                f"| {n} | {label} | {count} | {cold * 1000:.3f} | {scan * 1000:.3f} | {indexed * 1000:.3f} "
                f"| {scan / indexed:,.0f}x | {1 / indexed:,.0f} | {target} | {update * 1000:.3f} | {same} |"
            )
    return "\n".join([*lines, *placing, ""])
