"""A node's lifecycle through `llmgw ctl`, on a real cluster (NATS, placement, installer and
launcher processes, sim engines): cordon, drain, uncordon and delete node, as an operator sees
them in ctl's output, exit codes, `get nodes`, `explain` and the events."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.replica_watch import ready_replicas_of
from tests.test_ctl import ctl, ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def ready_on(bus: Bus, deployment: str) -> list[str]:
    """The nodes of the deployment's ready replicas, in replica order."""
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    records = sorted(
        (c.value for c in found.values() if c.value and c.value.deployment == deployment),
        key=lambda r: r.replica,
    )
    return [r.members[0].node for r in records if r.state == "ready"]


def node_state(c: Cluster, node: str) -> str:
    rows = [line for line in ok(c, "get", "nodes").splitlines() if line.startswith(f"{node} ")]
    assert len(rows) == 1, rows
    return rows[0]


async def test_cordon_holds_across_a_placement_restart_and_a_drain_moves_the_replica_never_to_zero_ready(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    deployments = [{"name": "chat", "profile": "tiny", "replicas": 1}]
    async with ready_replicas_of(bus, "chat") as watch:
        with cluster(tmp_path, nats_url, prefix) as c:
            for node in ("node-1", "node-2"):
                c.start_node(node, gpus=1)
            c.start_placement("p1", [sim_catalog()], deployments)
            [first] = await eventually(lambda: _one(ready_on(bus, "chat")), timeout=60)
            other = "node-2" if first == "node-1" else "node-1"
            await eventually(lambda: len(watch.ready) == 1, timeout=10)

            said = ok(c, "cordon", other, "--reason", "rack move")
            assert f"node {other} cordoned by " in said
            assert "rack move" in said
            assert "cordoned by " in node_state(c, other)

            # Another placement takes over: it reads the cordon from where it is kept.
            c.kill("placement-p1")
            c.start_placement("p2", [sim_catalog()], deployments)
            await eventually(lambda: "active placement" in c.log("placement-p2"), timeout=30)

            watch.watching = True
            said = ok(c, "drain", first)
            assert f"node {first} draining by " in said
            # The only other node is cordoned: ctl says so, not that the replica moves.
            assert "its 1 replica is not moved: no other node can take it now" in said, said

            # The only other node is cordoned: the drain waits, stopping nothing, and says why.
            async def blocked() -> str:
                text = ok(c, "explain", "chat")
                assert "1 of 1 ready" in text, text
                assert re.search(rf"^{other} +cordoned by \S+ at .*: rack move$", text, re.M), text
                assert re.search(rf"^{first} +draining by ", text, re.M), text
                return text

            await eventually(blocked, timeout=60, interval=1.0)
            assert "draining (1 replica left) by " in node_state(c, first)
            assert await ready_on(bus, "chat") == [first]

            assert "uncordoned" in ok(c, "uncordon", other)

            async def moved() -> bool:
                assert await ready_on(bus, "chat") == [other]
                found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
                assert len([v for v in found.values() if v.value and v.value.deployment == "chat"]) == 1
                return True

            await eventually(moved, timeout=90, interval=1.0)
            await eventually(lambda: "drained by " in node_state(c, first), timeout=30, interval=1.0)
            assert watch.counts, "replica events were seen during the drain"
            assert min(watch.counts) >= 1, f"ready replicas during the drain: {watch.counts}"

            async def told() -> bool:
                events = ok(c, "events", "--node", first)
                assert "draining (1 replica left) by " in events, events
                assert "drained by " in events, events
                return True

            await eventually(told, timeout=30, interval=1.0)
            # Drained and cordoned still: the replica does not come back.
            assert "drained by " in node_state(c, first)


async def _one(found: object) -> list[str]:
    nodes = await found  # type: ignore[misc]
    assert len(nodes) == 1, nodes
    return nodes  # type: ignore[no-any-return]


async def test_only_a_lost_node_is_deleted_and_then_no_longer_listed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        for node in ("node-1", "node-2"):
            c.start_node(node, gpus=1)
        c.start_placement("p1", [sim_catalog()], [])
        await eventually(
            lambda: "alive" in node_state(c, "node-1") and "alive" in node_state(c, "node-2"),
            timeout=60,
            interval=1.0,
        )

        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=10)
        async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:
            done = await client.post("/api/nodes/node-1/cordon", json={"reason": "bios update", "by": "ops"})
            assert done.status_code == 200, done.text
            assert done.json()["intent"].startswith("cordoned by ops at ")

            async def shown() -> bool:
                rows = {r["node"]: r for r in (await client.get("/api/nodes")).json()}
                assert rows["node-1"]["intent"].endswith(": bios update"), rows["node-1"]
                assert rows["node-2"]["intent"] == ""
                page = (await client.get("/")).text
                assert "cordoned by ops at " in page
                return True

            await eventually(shown, timeout=30)
            assert "cordoned by ops at " in node_state(c, "node-1"), "ctl reads the cordon the API wrote"
            assert (await client.post("/api/nodes/node-1/uncordon")).status_code == 200
            await eventually(lambda: "cordoned" not in node_state(c, "node-1"), timeout=30, interval=1.0)
            if c.api_headers:
                async with httpx.AsyncClient(base_url=api.group(1), timeout=10) as anonymous:
                    bare = await anonymous.post("/api/nodes/node-1/cordon")
                assert bare.status_code in (401, 403), bare.text
            refused = await client.delete("/api/nodes/node-1")
            assert refused.status_code == 409, refused.text
            assert "node node-1 is alive: only a lost node is deleted" in refused.json()["error"]

        alive = ctl(c, "delete", "node", "node-1")
        assert alive.returncode == 4, (alive.returncode, alive.stdout, alive.stderr)
        assert "node node-1 is alive" in alive.stderr
        assert "only a lost node is deleted" in alive.stderr
        missing = ctl(c, "delete", "node", "node-9")
        assert missing.returncode == 3, missing.stderr

        c.kill_node("node-2")
        await eventually(lambda: "lost" in node_state(c, "node-2"), timeout=30, interval=1.0)
        said = ok(c, "delete", "node", "node-2")
        assert "node node-2 deleted" in said
        listed = ok(c, "get", "nodes")
        assert "node-2" not in listed, listed
        assert "node-1" in listed

        async def told() -> bool:
            events = ok(c, "events", "--node", "node-2")
            assert re.search(r"node +node-2 +deleted", events), events
            return True

        await eventually(told, timeout=30, interval=1.0)
        # Placement keeps nothing of it: `ctl nodes` (its liveness joined) no longer names it.
        assert "node-2" not in ok(c, "nodes")
