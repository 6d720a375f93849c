"""How long one placement decision takes as the cluster grows, scanning every node vs the index."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState
from llmgw_placement.decide import NodeIndex, NodeView, decide

VLLM = {"vllm": EngineState(name="vllm", state="configured", version="0.11.1")}
SGLANG = {"sglang": EngineState(name="sglang", state="configured", version="0.5.0")}


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


def _time(fn: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


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
        "H100 nodes running vLLM, the profile's engine and class), mean of repeated calls. Baseline: "
        "the same call given a plain list of views, which it must index first (every node examined). "
        "The controller keeps its index across control steps and updates it as replicas are placed.",
        "",
        "| nodes | profile | plain list (ms) | prebuilt index (ms) | speed-up |",
        "|---|---|---|---|---|",
    ]
    for n in sizes:
        nodes = _nodes(n)
        index = NodeIndex(nodes)
        repeat = max(3, 2000 // n)
        for label, profile in profiles.items():
            scan = _time(lambda nodes=nodes, p=profile: decide(dep, p, nodes), repeat) * 1000
            indexed = _time(lambda index=index, p=profile: decide(dep, p, index), repeat) * 1000
            lines.append(f"| {n} | {label} | {scan:.2f} | {indexed:.2f} | {scan / indexed:.1f}x |")
    lines.append("")
    return "\n".join(lines)
