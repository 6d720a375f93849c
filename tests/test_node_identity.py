"""One node id, one machine: real placement, installer, launcher and sim engine processes on the
session's NATS, and a second machine's agents given a node id that is already alive, or that
replace a machine with fewer GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import ctl
from llmgw_core.bus import Bus
from llmgw_core.engines import ShardSpec
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeStatus,
    ReplicaStatus,
    ShardStatus,
)
from tests.cluster_support import cluster, sim_catalog
from tests.control_support import all_ready, replicas
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def last_status(bus: Bus, deployment: str) -> DeploymentStatus:
    found = await bus.history(bus.names.deployment_event(deployment), DeploymentStatus, idle_s=0.3)
    assert found
    return found[-1]


async def shard_status(bus: Bus, key: str) -> ShardStatus:
    found = await bus.get(bus.names.shard_status_bucket, key, ShardStatus)
    assert found is not None, key
    return found[0]


async def test_a_second_machine_with_a_live_node_id_stands_by_is_said_everywhere_and_placed_on_no_more(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a second machine given node n1's id while the first still ran was not
    detected; both ran every shard, and afterwards the replica stayed `ready` at the second
    machine's dead port while the real engine was healthy."""
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("n1", gpus=2)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        (r0,) = (await eventually(lambda: all_ready(bus, 1), timeout=60, interval=0.3)).values()
        engines = c.engine_pids("n1")
        status = await bus.get(bus.names.nodes_bucket, "n1", NodeStatus)
        assert status is not None
        assert len(status[0].facts.gpus) == 2

        c.start_machine("n1", "b", gpus=4)
        pids = {name: c.procs[name].pid for name in c.procs if name.endswith("n1") or name.endswith("n1@b")}
        # The second machine's agents stand by, each saying why.
        for service in ("launcher", "installer"):
            await eventually(
                lambda service=service: (
                    f"this {service} stands by and runs nothing" in c.log(f"{service}-n1@b")
                ),
                timeout=60,
                interval=0.3,
            )

        # Placement says it: in its judgement of the node (`ctl nodes`, the API) ...
        async def claimed() -> str:
            judged = await ctl.liveness(bus)
            assert judged is not None
            live = next(n for n in judged.nodes if n.node == "n1")
            for pid in pids.values():
                assert f" pid {pid}" in live.claimed, (pids, live)
            return live.claimed

        text = await eventually(claimed, timeout=30, interval=0.3)
        # Every agent of a test runs on this one machine; two machines are named as two.
        assert text.startswith("n1 is claimed twice on one machine, "), text
        assert f"launcher pid {pids['launcher-n1@b']} (standing by)" in text
        assert f"launcher pid {pids['launcher-n1']}," in text
        listed = (await ctl.nodes(bus)).splitlines()
        assert listed[1].startswith("n1    claimed twice  "), listed
        assert "n1 is claimed twice on one machine" in listed[1]

        # ... and in the refusal of what would go there now; what runs there runs on.
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny", replicas=2)
        )

        async def refused() -> DeploymentStatus:
            last = await last_status(bus, "chat")
            assert last.summary.startswith(
                "chat: 1 of 2 ready; 1 cannot be placed: n1: n1 is claimed twice on one machine, "
            ), last
            return last

        await eventually(refused, timeout=30, interval=0.3)
        assert (await all_ready(bus, 1)) == {"chat.r0": r0}
        assert c.engine_pids("n1") == engines
        assert c.engine_pids("n1@b") == [], "the second machine ran nothing"
        status = await bus.get(bus.names.nodes_bucket, "n1", NodeStatus)
        assert status is not None
        assert len(status[0].facts.gpus) == 2, "nor did it overwrite the node's status"

        # The second machine goes: the node is one machine's again, and the replica is placed.
        c.kill("launcher-n1@b")
        c.kill("installer-n1@b")
        await eventually(lambda: all_ready(bus, 2), timeout=60, interval=0.3)
        judged = await ctl.liveness(bus)
        assert judged is not None
        assert [n.claimed for n in judged.nodes] == [""]

        # A status a departed machine left (`ready` at a port none of n1's engines holds) is
        # written again by n1's launcher with what it runs.
        key = r0.shards[0]
        mine = await shard_status(bus, key)
        left = ShardStatus(
            node="n1",
            shard=mine.shard,
            replica=mine.replica,
            deployment="chat",
            state="ready",
            port=29999,
            url="http://127.0.0.1:29999",
            pids=(999999,),
            profile_fp=mine.profile_fp,
        )

        async def corrected() -> bool:
            now = await shard_status(bus, key)
            assert (now.port, now.url, now.pids) == (mine.port, mine.url, mine.pids), now
            r = (await replicas(bus))["chat.r0"]
            assert r.state == "ready"
            assert r.url == r0.url
            return True

        # The runner's own write of a new engine load also puts the status back, before the audit
        # sees what was left; the status is left again until the audit is the one to correct it.
        said = "the status bucket says ready at port 29999 (pids 999999)"
        for _ in range(5):
            await bus.put(bus.names.shard_status_bucket, key, left)
            await eventually(corrected, timeout=30, interval=0.2)
            if said in c.log("launcher-n1"):
                break
        assert said in c.log("launcher-n1")


async def test_a_replacement_machine_with_fewer_gpus_gets_its_replicas_placed_again_or_refused(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a replacement machine with one GPU under the id of one that had two left the
    replica on GPU 1 `failed` for good (`GPU 1 not on this node`); now it is removed and placed
    again, here refused for want of room, counted as 1 that cannot be placed."""
    with cluster(tmp_path, nats_url, prefix) as c:
        # The swap takes less than node_timeout: the node is never judged lost.
        c.node_timeout_s = 60.0
        c.start_node("n1", gpus=2)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
        before = await eventually(lambda: all_ready(bus, 2), timeout=60, interval=0.3)
        specs = {
            k: c.value
            for k, c in (await bus.entries(bus.names.shards_bucket, ShardSpec)).items()
            if c.value is not None
        }
        on_gpu = {spec.gpus: f"{spec.deployment}.{spec.replica}" for spec in specs.values()}
        assert sorted(on_gpu) == [(0,), (1,)]

        c.kill_node("n1")  # the old machine goes, its engines with it
        c.start_machine("n1", "new", gpus=1)

        async def replaced() -> DeploymentStatus:
            last = await last_status(bus, "chat")
            assert last.summary == (
                "chat: 1 of 2 ready; 1 cannot be placed: n1: 0 of 1 GPUs free, profile needs 1"
            ), last
            assert (last.desired, last.ready, last.unplaceable) == (2, 1, 1)
            return last

        await eventually(replaced, timeout=90, interval=0.3)
        kept = await all_ready(bus, 1)
        assert set(kept) == {on_gpu[(0,)]}, "the replica on the GPU it still has stays"
        assert set(kept) <= set(before)
        gone = on_gpu[(1,)]
        events = await bus.history(
            bus.names.replica_event("chat", gone.split(".")[1]), ReplicaStatus, idle_s=0.3
        )
        assert ("failed", "GPU 1 is no longer on n1 (it reports 1 GPU: 0)") in [
            (e.state, e.reason) for e in events
        ], events
