"""Multi-node placement decisions from a kept index and from a plain list."""

from __future__ import annotations

import msgspec
import pytest

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState
from llmgw_placement.decide import NodeIndex, NodeView, Placement, decide

H100 = "NVIDIA H100 80GB HBM3"
VLLM = EngineState(name="vllm", state="configured", version="0.11.1")
MODEL = "/models/big"


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
