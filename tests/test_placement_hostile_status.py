"""A node status carrying an impossible model shape or GPU is refused where placement reads it.

`ModelShape`'s figures are bounded on the wire type: a status with a shape of 10**400 bytes
does not decode, is named in placement's warnings with msgspec's path, dead-lettered, and
left out, while every other node is placed on as before (a real NATS server, in-process
placements over a simulated fleet)."""

from __future__ import annotations

import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import Deployment
from tests.control_support import control_plane, dlq, ready_replicas
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SHAPE = {
    "format": "gguf",
    "weight_bytes": 10**400,
    "n_layer": 2,
    "n_head_kv": 2,
    "head_dim_k": 16,
    "head_dim_v": 16,
    "context_length": 512,
}


@pytest.mark.parametrize(
    ("facts", "refusal"),
    [
        (
            {"shapes": {"hf://evil/bomb/bomb.gguf@main": SHAPE}},
            "Expected `int` <= 1125899906842624 - at `$.facts.shapes[...].weight_bytes`",
        ),
        (
            {"gpus": [{"index": 0, "name": "NVIDIA X", "memory_mb": 10**400}]},
            "Expected `int` <= 1073741824 - at `$.facts.gpus[0].memory_mb`",
        ),
    ],
    ids=["model-shape", "gpu-memory"],
)
async def test_a_status_with_a_figure_of_10_400_is_refused_named_and_the_rest_used(
    bus: Bus, nats_url: str, prefix: str, facts: dict[str, object], refusal: str
) -> None:
    names = bus.names
    evil = msgspec.json.encode({"kind": "NodeStatus", "node": "evil", "facts": {"node": "evil", **facts}})
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=2)
        placement = await cp.start_placement("a")
        await eventually(lambda: len(cp.leaders()) == 1, timeout=30)
        rev = await (await bus.kv(names.nodes_bucket)).put("evil", evil)
        await bus.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2))

        async def two_ready() -> list[str]:
            ready = await ready_replicas(bus, "chat")
            assert len(ready) == 2, ready
            return ready

        ready: list[str] = await eventually(two_ready, timeout=60, interval=0.3)
        assert len(ready) == 2
        assert [w for w in placement.service.warnings() if "/evil" in w] == [
            f"{names.nodes_bucket}/evil: revision {rev} is refused ({refusal}); it has no earlier good "
            "value, so placement leaves the key out; write a good value or delete the key"
        ]
        assert "evil" not in placement.service.state.nodes
        dead = {m.headers.get("Llmgw-Subject") for m in await dlq(bus) if m.headers}
        assert f"$KV.{names.nodes_bucket}.evil" in dead
        assert cp.crashes() == []
