"""`/api/nodes` is built from each node's report encoded once: it must still say exactly what
encoding every row afresh says, and follow each new report, each node that leaves and each
node whose heartbeats stop."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.claims import Claimant
from llmgw_core.engines import GPUInfo
from llmgw_core.events import Heartbeat, NodeFacts, NodeStatus, now
from llmgw_core.web import serve
from llmgw_placement import PlacementService, ServerConfig
from llmgw_placement.api import Api
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def status(node: str, install: str = "") -> NodeStatus:
    gpus = tuple(GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", memory_mb=81559) for i in range(2))
    return NodeStatus(node=node, facts=NodeFacts(node=node, gpus=gpus), install=install, updated_at=now())


async def test_api_nodes_says_what_encoding_every_row_says_and_follows_changes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = msgspec.convert(
        {
            "nats": {"url": nats_url, "prefix": prefix},
            "engines": [],
            "http": {"port": 0, "insecure": True},
            "heartbeat_interval_s": 0.2,
            "node_timeout_s": 1.0,
        },
        ServerConfig,
    )
    service = PlacementService(config, bus)
    api = Api(service)
    names = bus.names

    async def heartbeats(node: str, stop: anyio.Event) -> None:
        # The node's launcher and its installer (one that is silent is said: not here).
        while not stop.is_set():
            for service in ("launcher", "installer"):
                await bus.publish_core(
                    names.heartbeat(node, service), Heartbeat(node=node, service=service, at=now())
                )
            await anyio.sleep(0.1)

    async with anyio.create_task_group() as tg:
        await tg.start(service.run)
        port = await tg.start(serve, api.app(), "127.0.0.1", 0)
        silent = anyio.Event()
        for node in ("gpu-1", "gpu-2", "gpu-3"):
            await bus.put(names.nodes_bucket, node, status(node))
            tg.start_soon(heartbeats, node, silent if node == "gpu-2" else anyio.Event())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def listed() -> list[dict[str, object]]:
                r = await client.get("/api/nodes")
                assert r.status_code == 200
                assert r.headers["content-type"] == "application/json"
                return r.json()  # type: ignore[no-any-return]

            async def all_alive() -> list[dict[str, object]]:
                rows = await listed()
                assert [(r["node"], r["alive"]) for r in rows] == [
                    ("gpu-1", True),
                    ("gpu-2", True),
                    ("gpu-3", True),
                ]
                # Alive and heard: a node just read is alive for a timeout before its first beat.
                assert all(r["seen_s_ago"] >= 0 for r in rows), rows  # type: ignore[operator]
                return rows

            rows = await eventually(all_alive, timeout=10)
            assert len(rows[0]["gpus"]) == 2  # type: ignore[arg-type]
            # What encoding `nodes()` (every row afresh) writes: the same fields in the same order,
            # the same values but for the age of the last heartbeat, taken a moment apart.
            cached = msgspec.json.decode(api.nodes_json())
            fresh = msgspec.json.decode(msgspec.json.encode(api.nodes()))
            assert [list(r) for r in cached] == [list(r) for r in fresh]
            for row in (*cached, *fresh):
                assert 0 <= row.pop("seen_s_ago") < 1.0
            assert cached == fresh
            # A new report shows; a node that leaves goes; a node that falls silent is lost.
            await bus.put(names.nodes_bucket, "gpu-1", status("gpu-1", install="installing: sim"))
            await bus.delete(names.nodes_bucket, "gpu-3")
            silent.set()

            async def changed() -> bool:
                rows = await listed()
                assert [(r["node"], r["alive"], r["install"]) for r in rows] == [
                    ("gpu-1", True, "installing: sim"),
                    ("gpu-2", False, ""),
                ]
                assert float(rows[1]["seen_s_ago"]) >= 1.0  # type: ignore[arg-type]
                return True

            await eventually(changed, timeout=10)

            # Two machines beat for gpu-1 (beats that name their sender): said in the row, encoded
            # either way alike.
            for host, pid in (("host-a", 4141), ("host-b", 4242)):
                who = Claimant(host=host, boot_id="5e6f7a8b", pid=pid, instance=host, started_at=pid)
                tg.start_soon(
                    bus.heartbeat, "gpu-1", "launcher", 0.1, lambda who=who: who.beat("gpu-1", "launcher")
                )

            async def claimed() -> str:
                rows = await listed()
                text = str(rows[0]["claimed"])
                assert text.startswith("gpu-1 is claimed by two machines: "), rows[0]
                assert text.endswith(
                    "host-a (boot 5e6f7a8b) with launcher pid 4141, and host-b (boot 5e6f7a8b) with "
                    "launcher pid 4242"
                ), text
                assert rows[1]["claimed"] == ""
                return text

            await eventually(claimed, timeout=10)
            cached = msgspec.json.decode(api.nodes_json())
            fresh = msgspec.json.decode(msgspec.json.encode(api.nodes()))
            assert [list(r) for r in cached] == [list(r) for r in fresh]
            assert [r["claimed"] for r in cached] == [r["claimed"] for r in fresh]
        tg.cancel_scope.cancel()
