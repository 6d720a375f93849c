"""A control step whose writes NATS refuses part-way: placement's memory is what the store says.

Placement decides against its memory with the step's plan over it, and takes into memory
only the writes NATS acknowledged. Regression: a step took its decisions in memory at once
and undid them when a write failed; a placement named and refused stayed in memory as
`placing` with its GPUs held, which the store did not say."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.engines import GPUInfo, Profile, ShardSpec
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, EngineState, NodeFacts, NodeStatus, ReplicaRecord
from llmgw_placement import controller as controller_module
from llmgw_placement.controller import ClusterState, Controller, Usage
from tests.control_support import TP1, server_config

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NOW = 1000.0
H100 = "NVIDIA H100 80GB HBM3"
# A profile whose shard spec is over the shards bucket's value limit: its write is refused.
BIG = {**TP1, "name": "big", "args": ["--pad", "x" * 40_000]}


def _cluster(nodes: int) -> ClusterState:
    state = ClusterState.empty()
    for i in range(nodes):
        name = f"n{i}"
        gpu = GPUInfo(index=0, name=H100, compute_capability="9.0", memory_mb=81559)
        facts = NodeFacts(node=name, gpus=(gpu,))
        engines = (EngineState(name="sim", state="configured", version="1"),)
        state.nodes[name] = NodeStatus(node=name, facts=facts, engines=engines)
        state.last_seen[name] = NOW
        state.dirty_nodes.add(name)
    for raw in (TP1, BIG):
        profile = msgspec.convert(raw, Profile)
        state.catalog[profile.name] = profile
    return state


async def _stored(bus: Bus) -> tuple[dict[str, ReplicaRecord], dict[str, ShardSpec]]:
    names = bus.names
    records = await bus.entries(names.replicas_bucket, ReplicaRecord)
    specs = await bus.entries(names.shards_bucket, ShardSpec)
    return (
        {k: e.value for k, e in records.items() if e.value is not None},
        {k: e.value for k, e in specs.items() if e.value is not None},
    )


async def _memory_is_the_store(controller: Controller, bus: Bus) -> dict[str, Any]:
    """Placement's replicas, shards and the GPUs its index counts taken are the store's."""
    records, specs = await _stored(bus)
    assert controller.held.replicas == records
    assert controller.held.shards == specs
    taken = Usage.of(specs.values())
    index = controller.index
    for node, view in index.index.views.items():
        assert view.used_gpus == frozenset(taken.gpus.get(node, ())), node
        assert index.usage.shards[node] == taken.shards[node], node
    return {"replicas": sorted(records), "shards": sorted(specs)}


async def test_a_write_refused_mid_step_leaves_memory_as_the_store_says(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One write per batch: the step's removal lands before its placement is refused.
    monkeypatch.setattr(controller_module, "BATCH_MAX", 1)
    bus = await Bus.connect(
        BusOptions(url=nats_url, prefix=prefix, max_value_bytes=16 * 1024), service="placement"
    )
    try:
        await bus.ensure()
        state = _cluster(3)
        state.deployments["a"] = Deployment(name="a", profile="tp1", replicas=2)
        controller = Controller(server_config(nats_url, prefix), bus, state, clock=lambda: NOW)
        await controller.load()
        await controller.step()
        assert await _memory_is_the_store(controller, bus) == {
            "replicas": ["a.r0", "a.r1"],
            "shards": ["n0.a-r0-0", "n1.a-r1-0"],
        }

        # a scales down (r1, starting, goes at once: its deletes land), then b's placement on
        # the GPU r1 freed is refused by NATS.
        state.deployments["a"] = Deployment(name="a", profile="tp1", replicas=1)
        state.deployments["b"] = Deployment(name="b", profile="big", replicas=1)
        with pytest.raises(BusError, match="shards"):
            await controller.step()
        assert await _memory_is_the_store(controller, bus) == {
            "replicas": ["a.r0"],
            "shards": ["n0.a-r0-0"],
        }, "r1's GPU is free, b's is not held"
        [(k, unwritten)] = controller.held.unwritten.items()
        assert (k, unwritten.record.state) == ("b.r0", "placing"), "kept to be written again, same id"

        # b deleted: its placement is never written, and nothing of it is held.
        del state.deployments["b"]
        await controller.step()
        assert await _memory_is_the_store(controller, bus) == {
            "replicas": ["a.r0"],
            "shards": ["n0.a-r0-0"],
        }
        assert controller.held.unwritten == {}
    finally:
        await bus.close()
