"""A llama.cpp replica split over two hosts (tests/multihost): rank 1's rpc-server on its own
host's address, rank 0's llama-server reaching it there over `--rpc`, a chat answered through
a gateway on a third host to a client in the root namespace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from llmgw_core.events import ReplicaRecord, ShardStatus
from tests.multihost.fleet import Fleet
from tests.multihost.hosts import Hosts, argv_of
from tests.test_launcher_llamacpp import llama_bin, tiny_model
from tests.waiting import eventually

pytestmark = [pytest.mark.multihost, pytest.mark.llama, pytest.mark.anyio, pytest.mark.timeout(240)]

__all__ = ["llama_bin", "tiny_model"]


async def test_a_llama_cpp_replica_split_over_two_hosts_answers_through_a_gateway_on_a_third(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet], llama_bin: str, tiny_model: Path
) -> None:
    net = make_hosts("a", "b", "c", "d", "e")
    fleet = make_fleet(net)
    fleet.start_nats(("a", "b", "c"))
    profile = {
        "name": "tiny-llama",
        "engine": "llamacpp",
        "model_path": str(tiny_model),
        "gpu_class": "H100-80G",
        "nodes": 2,
        "gpus_per_node": 1,
        "pp": 2,
        "args": ["-c", "512", "-t", "1"],
        "health_timeout_s": 90.0,
    }
    fleet.start_placement(
        "a",
        "p1",
        [profile],
        [{"name": "chat", "profile": "tiny-llama", "replicas": 1}],
        extra={"fabrics": {"lan": {"nodes": ["n*"]}}},
    )
    fleet.start_gateway("c", "g1")
    engines = {"llamacpp": {"path": llama_bin}}
    fleet.start_node("d", "n1", extra={"engines": engines})
    fleet.start_node("e", "n2", mgmt_addr=None, extra={"engines": engines})
    where = {"n1": net["d"], "n2": net["e"]}

    async with fleet.bus() as bus:

        async def ready() -> tuple[ReplicaRecord, list[ShardStatus]]:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
            records = [c.value for c in found.values() if c.value is not None]
            assert [r.state for r in records] == ["ready"], [(r.state, r.reason) for r in records]
            shards = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
            statuses = [c.value for c in shards.values() if c.value is not None]
            return records[0], statuses

        record, statuses = await eventually(ready, timeout=150, interval=0.5)

    leader, worker = record.members
    assert {(m.node, m.addr) for m in record.members} == {(n, h.addr) for n, h in where.items()}
    by_node = {s.node: s for s in statuses}
    # The worker's RPC server listens on its own host's address, never on every interface;
    # the leader, on the other host, reaches it there.
    rpc = argv_of(by_node[worker.node].pids[-1])
    assert rpc[rpc.index("--host") + 1] == where[worker.node].addr, rpc
    server = argv_of(by_node[leader.node].pids[-1])
    assert server[server.index("--rpc") + 1] == f"{where[worker.node].addr}:{worker.port}", server
    assert record.url.startswith(f"http://{where[leader.node].addr}:"), record

    gateway = await fleet.gateway_url("g1")
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

    async def answered() -> dict[str, object]:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(f"{gateway}/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        return dict(r.json())

    body = await eventually(answered, timeout=60, interval=0.5)
    assert body["choices"]
