"""The management interface, from the node's probe through placement to every rank's engine.

Regression: `AgentConfig.mgmt_iface` was read by nothing and placement left
`ShardSpec.mgmt_iface` empty, so NCCL and Gloo bootstrapped over the first
interface they found (docker0, an IPoIB port) and the first all-reduce hung.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import GPUInfo, Profile, ShardSpec
from llmgw_core.events import Deployment, EngineState, NodeStatus, ReplicaRecord, ShardStatus
from llmgw_placement.decide import NodeView, Placement, decide
from tests.cluster_support import cluster, sim_catalog
from tests.waiting import eventually

H100 = tuple(GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", memory_mb=81559) for i in range(8))


def test_each_rank_of_a_two_node_placement_carries_its_own_nodes_interface() -> None:
    p = msgspec.convert(
        {
            "name": "llama-70b",
            "engine": "vllm",
            "model_path": "/models/llama-70b",
            "gpu_class": "H100-80G",
            "tp": 8,
            "nodes": 2,
            "gpus_per_node": 4,
        },
        Profile,
    )
    engines = {"vllm": EngineState(name="vllm", state="configured")}
    nodes = [
        NodeView(
            node="gpu-01", gpus=H100, engines=engines, fabric="ib-a", mgmt_addr="10.0.0.1", mgmt_iface="eno1"
        ),
        NodeView(
            node="gpu-02", gpus=H100, engines=engines, fabric="ib-a", mgmt_addr="10.0.0.2", mgmt_iface="ens5"
        ),
    ]
    decision = decide(Deployment(name="chat", profile="llama-70b"), p, nodes, port_range=(30000, 30010))
    assert isinstance(decision, Placement)
    assert [(m.node, m.rank, m.addr, m.mgmt_iface) for m in decision.members] == [
        ("gpu-01", 0, "10.0.0.1", "eno1"),
        ("gpu-02", 1, "10.0.0.2", "ens5"),
    ]
    one = decide(
        Deployment(name="small", profile="x"),
        msgspec.structs.replace(p, nodes=1, gpus_per_node=None),
        nodes[1:],
    )
    assert isinstance(one, Placement)
    assert one.members[0].mgmt_iface == "ens5"


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")
async def test_a_two_node_replica_bootstraps_over_each_nodes_management_interface(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        # node-1's probe finds the interface holding its address (127.0.0.1: lo);
        # node-2's operator names one in agent.yaml.
        for node, iface in (("node-1", ""), ("node-2", "mgmt0")):
            path = c.agent_config(node, gpus=1)
            config = msgspec.yaml.decode(path.read_bytes())
            if iface:
                config["mgmt_iface"] = iface
            path.write_bytes(msgspec.yaml.encode(config))
            c._spawn(f"installer-{node}", [sys.executable, "-m", "llmgw_installer", "--config", str(path)])
            c._spawn(f"launcher-{node}", [sys.executable, "-m", "llmgw_launcher", "--config", str(path)])
        catalog = {**sim_catalog(), "tp": 2, "nodes": 2, "gpus_per_node": 1}
        server = c.server_config("p1", [catalog], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        config = msgspec.yaml.decode(server.read_bytes())
        config["fabrics"] = {"lan": {"nodes": ["node-*"]}}
        server.write_bytes(msgspec.yaml.encode(config))
        c._spawn("placement-p1", [sys.executable, "-m", "llmgw_placement", "--config", str(server)])

        async def ready() -> ReplicaRecord:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
            records = [
                ch.value for ch in found.values() if ch.value is not None and ch.value.state == "ready"
            ]
            assert len(records) == 1, [
                (ch.value.replica, ch.value.state) for ch in found.values() if ch.value
            ]
            return records[0]

        record = await eventually(ready, timeout=90)
        assert sorted(m.node for m in record.members) == ["node-1", "node-2"]

        nodes = await bus.entries(bus.names.nodes_bucket, NodeStatus)
        facts = {k: ch.value.facts for k, ch in nodes.items() if ch.value is not None}
        assert facts["node-1"].mgmt_iface == "lo"
        [lo] = [i for i in facts["node-1"].interfaces if i.name == "lo"]
        assert "127.0.0.1/8" in lo.addresses
        assert facts["node-2"].mgmt_iface == "mgmt0"

        specs = await bus.entries(bus.names.shards_bucket, ShardSpec)
        by_node = {ch.value.node: ch.value for ch in specs.values() if ch.value is not None}
        assert sorted(s.rank for s in by_node.values()) == [0, 1]
        assert {n: s.mgmt_iface for n, s in by_node.items()} == {"node-1": "lo", "node-2": "mgmt0"}

        # What the engines were started with: each rank's own node's interface. Read from
        # the pids the shards report now (a rank restarted under load has a new one).
        async def started_with() -> bool:
            statuses = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
            assert len(statuses) == 2
            for ch in statuses.values():
                status = ch.value
                assert status is not None
                assert status.state == "ready", status
                iface = {"node-1": "lo", "node-2": "mgmt0"}[status.node]
                try:
                    env = environ_of(status.pids[-1])
                except ProcessLookupError as exc:
                    raise AssertionError(f"{status.shard}: pid {status.pids[-1]} is gone") from exc
                assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == (iface, iface)
                assert env["CUDA_VISIBLE_DEVICES"] == "0"
                assert env["NCCL_IB_DISABLE"] == "1"
            return True

        await eventually(started_with, timeout=60, interval=0.5)
