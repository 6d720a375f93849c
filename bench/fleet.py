"""Placement at scale over a real NATS server: a fleet of simulated nodes, replicas until ready."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import anyio
import msgspec

from llmgw.fleet import Fleet
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_placement import PlacementService, ServerConfig


async def _run(url: str, nodes: int, replicas: int) -> dict[str, float]:
    prefix = f"fleet{nodes}"
    # This server runs without authentication: what is measured is placement, not permission checks.
    options = BusOptions(url=url, prefix=prefix, insecure=True)
    fleet_bus = await Bus.connect(options, service="fleet")
    placement_bus = await Bus.connect(options, service="placement")
    watch_bus = await Bus.connect(options, service="bench")
    await watch_bus.ensure()
    config = msgspec.convert(
        {
            "nats": {"url": url, "prefix": prefix, "insecure": True},
            "engines": [],
            "catalog": [
                {"name": "tp2", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 2}
            ],
            "node_timeout_s": 30.0,
        },
        ServerConfig,
    )
    fleet = Fleet(fleet_bus, [f"sim-{i:05d}" for i in range(nodes)], gpus_per_node=8)
    figures: dict[str, float] = {}
    try:
        async with anyio.create_task_group() as tg:
            start = time.perf_counter()
            await tg.start(fleet.run)
            figures["register_s"] = time.perf_counter() - start
            service = PlacementService(config, placement_bus)
            await tg.start(service.run)
            with anyio.fail_after(60):
                while service.controller is None or len(service.state.nodes) < nodes:
                    await anyio.sleep(0.05)
            start = time.perf_counter()
            await watch_bus.put(
                watch_bus.names.deployments_bucket,
                "chat",
                Deployment(name="chat", profile="tp2", replicas=replicas),
            )
            with anyio.fail_after(600):
                while True:
                    found = await watch_bus.entries(watch_bus.names.replicas_bucket, ReplicaRecord)
                    if sum(1 for c in found.values() if c.value and c.value.state == "ready") == replicas:
                        break
                    await anyio.sleep(0.2)
            figures["all_ready_s"] = time.perf_counter() - start
            tg.cancel_scope.cancel()
    finally:
        for b in (fleet_bus, placement_bus, watch_bus):
            await b.close()
    return figures


def run(quick: bool = False) -> str:
    sizes = ((100, 200), (500, 1000)) if quick else ((100, 200), (1000, 2000))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        server = NatsServer(store_dir=Path(d))
        server.start()
        try:
            results = [(n, r, anyio.run(_run, server.url, n, r)) for n, r in sizes]
        finally:
            server.stop()
    base = results[0][2]["all_ready_s"] / results[0][1]
    for n, r, f in results:
        per = f["all_ready_s"] / r
        rows.append(
            f"| {n} | {r} | {f['register_s']:.1f} | {f['all_ready_s']:.1f} | {per * 1000:.1f} | "
            f"{per / base:.1f}x |"
        )
    return "\n".join(
        [
            "## Placement at scale (simulated fleet, real NATS)",
            "",
            "`python -m bench`: `llmgw fleet` nodes (8 simulated H100s each, the sim engine) "
            "register and heartbeat over a local nats-server (`sync_interval: always`); one "
            "deployment of TP=2 replicas is created and timed until placement has written every "
            "replica, each shard was reported ready, and placement marked every replica ready. "
            "The first row is the baseline for the per-replica figure.",
            "",
            "| nodes | replicas | register (s) | all ready (s) | per replica (ms) | vs baseline |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
