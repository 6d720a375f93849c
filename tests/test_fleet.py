"""Placement over a fleet of 200 simulated nodes on the real protocol: binpack really packs."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from llmgw.fleet import Fleet
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_placement import PlacementService, ServerConfig
from tests.auth_support import session_for
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_a_fleet_of_200_nodes_takes_100_replicas_packed_onto_25(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # On the session's server, the fleet and placement connect as their own identities.
    session = session_for(nats_url)
    if session is None:
        fleet_options = placement_options = BusOptions(url=nats_url, prefix=prefix)
    else:
        auth = session.identities(prefix, tmp_path / "auth")
        fleet_options = BusOptions(url=session.url, prefix=prefix, nkey_seed_file=str(auth.seed("fleet")))
        placement_options = BusOptions(
            url=session.url, prefix=prefix, nkey_seed_file=str(auth.seed("placement"))
        )
    fleet_bus = await Bus.connect(fleet_options, service="llmgw-fleet")
    placement_bus = await Bus.connect(placement_options, service="placement")
    config = msgspec.convert(
        {
            "nats": {"url": nats_url, "prefix": prefix},
            "engines": [],
            "node_timeout_s": 30.0,
            "catalog": [
                {"name": "tp2", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 2}
            ],
        },
        ServerConfig,
    )
    fleet = Fleet(fleet_bus, [f"sim-{i:03d}" for i in range(200)], gpus_per_node=8)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            service = PlacementService(config, placement_bus)
            await tg.start(service.run)
            await eventually(
                lambda: service.controller is not None and len(service.state.nodes) == 200, timeout=30
            )
            await bus.put(
                bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp2", replicas=100)
            )

            async def all_ready() -> list[ReplicaRecord]:
                found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
                ready = [c.value for c in found.values() if c.value and c.value.state == "ready"]
                assert len(ready) == 100, len(ready)
                return ready

            ready = await eventually(all_ready, timeout=120, interval=0.3)
            tg.cancel_scope.cancel()
    finally:
        await fleet_bus.close()
        await placement_bus.close()
    nodes = sorted({r.members[0].node for r in ready})
    assert nodes == [f"sim-{i:03d}" for i in range(25)], "binpack fills whole nodes, in node order"
    assert len(fleet.ready) == 100
    assert fleet_bus.nc.denied_total == placement_bus.nc.denied_total == 0


def test_fleet_shards_split_the_nodes_without_overlap() -> None:
    from llmgw.fleet import shard_of
    from llmgw_core.errors import ConfigError

    names = [f"sim-{i:05d}" for i in range(10)]
    parts = [shard_of(names, f"{i}/3") for i in range(3)]
    assert [len(p) for p in parts] == [4, 4, 2]
    assert [n for p in parts for n in p] == names
    with pytest.raises(ConfigError, match=r"--shard 3/3: expected I/N with 0 <= I < N, e\.g\. 0/4"):
        shard_of(names, "3/3")
