"""llmgw with every process on a host of its own (network namespaces, tests/multihost): what an
operator reads about addresses and interfaces is each host's own, never loopback."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from llmgw_core.events import NodeStatus, ReplicaRecord, ShardSpec, ShardStatus
from tests.cluster_support import sim_catalog
from tests.hf_server import hf_hub
from tests.multihost.fleet import Fleet
from tests.multihost.hosts import Hosts, argv_of, environ_of
from tests.waiting import eventually

pytestmark = [pytest.mark.multihost, pytest.mark.anyio, pytest.mark.timeout(180)]

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _ready_replica(fleet: Fleet) -> ReplicaRecord:
    async with fleet.bus() as bus:

        async def ready() -> ReplicaRecord:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
            records = [c.value for c in found.values() if c.value is not None]
            assert records, "no replica yet"
            assert all(r.state == "ready" for r in records), records
            return records[0]

        return await eventually(ready, timeout=90, interval=0.3)


async def test_a_replica_on_host_d_is_served_through_a_gateway_on_host_c_at_host_ds_address(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    net = make_hosts("a", "b", "c", "d")
    fleet = make_fleet(net)
    fleet.start_nats(("a", "b", "c"))
    fleet.start_placement("a", "p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
    fleet.start_placement("b", "p2", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
    fleet.start_gateway("c", "g1")
    fleet.start_gateway("a", "g2")
    fleet.start_node("d", "n1")
    d = net["d"]

    record = await _ready_replica(fleet)
    # What `ctl get replicas` shows: the engine's URL and every member's address are d's.
    assert record.url.startswith(f"http://{d.addr}:"), record
    assert [(m.node, m.addr) for m in record.members] == [("n1", d.addr)]

    async with fleet.bus() as bus:
        nodes = await bus.entries(bus.names.nodes_bucket, NodeStatus)
        shards = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
        # The state is kept by all three servers, one on each of a, b and c.
        info = await bus.js.stream_info(f"KV_{bus.names.replicas_bucket}")
    assert info.config.num_replicas == 3
    assert info.cluster is not None
    assert sorted([info.cluster.leader, *(p.name for p in info.cluster.replicas or [])]) == ["a", "b", "c"]
    status = nodes["n1"].value
    assert status is not None
    assert status.facts.mgmt_addr == d.addr
    assert [s.value.url for s in shards.values() if s.value] == [record.url]

    listed = fleet.ctl("get", "replicas", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert [r["url"] for r in json.loads(listed.stdout)] == [record.url]

    # A client in the root namespace reaches the engine on d through the gateway on c, and
    # through the one on a.
    for name, host in (("g1", "c"), ("g2", "a")):
        gateway = await fleet.gateway_url(name)
        assert gateway == f"http://{net[host].addr}:8000"

        async def answered(gateway: str = gateway) -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(f"{gateway}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            return dict(r.json())

        assert (await eventually(answered, timeout=60, interval=0.3))["choices"]


async def test_each_node_finds_its_own_interface_and_address_and_ctl_and_the_page_work_from_other_hosts(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """Nodes named by their own interface (`enp3s0` on d, `eno1` on e); n2's agent.yaml leaves
    `mgmt_addr` out, so n2 finds its address from its own interfaces, as a fresh node does."""
    net = make_hosts("a", "b", "c", "d", "e")
    d, e = net["d"], net["e"]
    assert (d.iface, e.iface) == ("enp3s0", "eno1")
    fleet = make_fleet(net)
    fleet.start_nats(("a", "b", "c"))
    catalog = {**sim_catalog(), "tp": 2, "nodes": 2, "gpus_per_node": 1}
    fleet.start_placement(
        "a",
        "p1",
        [catalog],
        [{"name": "chat", "profile": "tiny", "replicas": 1}],
        extra={"fabrics": {"lan": {"nodes": ["n*"]}}},
    )
    fleet.start_node("d", "n1", mgmt_addr="")
    fleet.start_node("e", "n2", mgmt_addr=None)
    where = {"n1": d, "n2": e}

    record = await _ready_replica(fleet)
    assert sorted((m.node, m.addr) for m in record.members) == [("n1", d.addr), ("n2", e.addr)]

    async with fleet.bus() as bus:
        nodes = await bus.entries(bus.names.nodes_bucket, NodeStatus)
        specs = await bus.entries(bus.names.shards_bucket, ShardSpec)

        async def ready_shards() -> list[ShardStatus]:
            found = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
            statuses = [c.value for c in found.values() if c.value is not None]
            assert [s.state for s in statuses] == ["ready", "ready"], statuses
            return statuses

        statuses = await eventually(ready_shards, timeout=60, interval=0.3)

    # What each node reports of itself: its own interface, by its own name, holding its address.
    for node, host in where.items():
        status = nodes[node].value
        assert status is not None
        facts = status.facts
        assert (facts.mgmt_addr, facts.mgmt_iface) == (host.addr, host.iface), facts
        [iface] = [i for i in facts.interfaces if i.name == host.iface]
        assert f"{host.addr}/24" in iface.addresses
    # Each rank is told its own node's interface; the worker is pointed at the leader's address.
    assert {s.value.node: s.value.mgmt_iface for s in specs.values() if s.value} == {
        "n1": d.iface,
        "n2": e.iface,
    }
    leader = record.members[0]  # rank 0
    for status in statuses:
        host = where[status.node]
        env = environ_of(status.pids[-1])
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == (host.iface, host.iface)
        argv = argv_of(status.pids[-1])
        if status.node != leader.node:
            assert argv[argv.index("--leader") + 1] == f"{leader.addr}:{leader.port}", argv
        else:
            assert argv[argv.index("--host") + 1] == leader.addr, argv

    # `ctl get nodes` on host b, the placement page from host e: both over the network.
    listed = fleet.ctl("get", "nodes", "-o", "json", host=net["b"])
    assert listed.returncode == 0, listed.stderr
    rows = {row["node"]: row for row in json.loads(listed.stdout)}
    assert {n: (r["state"], r["status"]["facts"]["mgmt_addr"]) for n, r in rows.items()} == {
        "n1": ("alive", d.addr),
        "n2": ("alive", e.addr),
    }
    described = fleet.ctl("describe", "node", "n2", host=net["c"])
    assert described.returncode == 0, described.stderr
    assert f"Address:      {e.addr} (eno1)" in described.stdout.splitlines(), described.stdout
    page_url = await fleet.placement_url("p1")
    assert page_url == f"http://{net['a'].addr}:8080"
    token = f"Authorization: Bearer {fleet.auth.token(read_only=True)}"
    page = e.run(["curl", "-sS", "-m", "10", "-H", token, f"{page_url}/"])
    assert page.returncode == 0, page.stderr
    assert "n1" in page.stdout, page.stdout[:2000]
    assert "n2" in page.stdout, page.stdout[:2000]


MODEL = hashlib.sha256(b"weights").digest() * (1 << 15)  # 1 MiB: an LFS file


async def test_weights_staged_on_host_d_are_fetched_by_host_e_from_d_not_from_the_origin(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """The hub (the origin) answers in the root namespace; n1 on d stages the model from it,
    then n2 on e stages it from n1, over d's address: the origin sends its bytes once."""
    net = make_hosts("a", "b", "c", "d", "e")
    d, e = net["d"], net["e"]
    with hf_hub(net.root_addr) as hub:
        hub.add("org/big", {"m.gguf": MODEL})
        fleet = make_fleet(net)
        fleet.start_nats(("a", "b", "c"))
        profile = {**sim_catalog(), "model": "hf://org/big/m.gguf"}
        # chat on n1 (pool d) first; then chat2 on n2 (pool e), once n1 holds the model.
        deployments = [
            {"name": "chat", "profile": "tiny", "replicas": 1, "pool": "d"},
            {"name": "chat2", "profile": "tiny", "replicas": 0, "pool": "e"},
        ]
        pools = {"pools": {"d": ["n1"], "e": ["n2"]}}
        fleet.start_placement("a", "p1", [profile], deployments, extra=pools)
        env = {"HF_ENDPOINT": hub.url}
        # n1 serves slowly enough (1 MiB in about 5 s) that n2's progress names where it reads;
        # its agent.yaml names no address: it serves, and offers, on the one it finds.
        fleet.start_node("d", "n1", mgmt_addr=None, env=env, extra={"weights_serve_bytes_s": 200_000})
        fleet.start_node("e", "n2", env=env)
        await _ready_replica(fleet)
        assert hub.state.served["m.gguf"] == len(MODEL)

        scaled = fleet.ctl("scale", "chat2", "--replicas", "1")
        assert scaled.returncode == 0, scaled.stderr
        async with fleet.bus() as bus:

            async def progress() -> str:
                found = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
                reasons = [c.value.reason for c in found.values() if c.value and c.value.node == "n2"]
                # The first words may come while n2 still hears the offers ("downloading m.gguf (0%").
                sourced = [r for r in reasons if "downloading m.gguf from" in r]
                assert sourced, reasons
                return sourced[0]

            words = await eventually(progress, timeout=60, interval=0.1)
        label = f"big@{hub.state.repos['org/big'].commit[:6]}"
        assert words.startswith(f"weights {label}: downloading m.gguf from n1 ("), words

        async def both_ready() -> list[ReplicaRecord]:
            async with fleet.bus() as bus:
                found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
            records = [c.value for c in found.values() if c.value is not None]
            assert [r.state for r in records] == ["ready", "ready"], records
            return records

        records = await eventually(both_ready, timeout=90, interval=0.3)
        assert sorted((r.deployment, urlsplit(r.url).hostname) for r in records) == [
            ("chat", d.addr),
            ("chat2", e.addr),
        ]
        assert hub.state.served["m.gguf"] == len(MODEL)
        commit = hub.state.repos["org/big"].commit
        staged = e.state / "n2" / "models" / "hf" / "org" / "big" / commit / "files" / "m.gguf"
        assert staged.read_bytes() == MODEL
