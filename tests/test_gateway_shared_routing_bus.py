"""One routing state for every gateway, through the real path: gateways in this process as the
`gateway` identity on one cluster's NATS, replica records written as placement writes them,
real sim engines; each answer read by its `x-llmgw-replica`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import Deployment
from llmgw_core.prefixes import RoutingHeld
from llmgw_gateway import Gateway
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.routing import prompt_blocks
from tests.cluster_support import Cluster, cluster
from tests.test_gateway_api import sim_engines
from tests.test_gateway_hold import engines_up, gateway, record
from tests.test_gateway_routing import chat
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CHAT = "/v1/chat/completions"
# Written to the bucket every 50 ms: the tests wait for a write, never a fixed time.
FAST: dict[str, Any] = {"routing": {"share_interval_s": 0.05}}
CUSTOMERS = range(6)


@contextlib.asynccontextmanager
async def replicas(bus: Bus, tmp_path: Path, nats_url: str, prefix: str) -> AsyncIterator[Cluster]:
    """Deployment `chat` with three ready sim replicas r0, r1, r2."""
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([], [], []) as urls:
        await engines_up(urls)
        three = Deployment(name="chat", profile="tiny", replicas=3)
        await bus.put(bus.names.deployments_bucket, "chat", three)
        for i, url in enumerate(urls):
            await bus.put(bus.names.replicas_bucket, f"chat.r{i}", record(f"r{i}", url))
        yield c


async def served_by(client: httpx.AsyncClient, url: str, customer: int, question: str = "q") -> str:
    """The replica key (`chat.r1`) that answered one request of `customer`'s conversation."""
    body = {"model": "chat", "messages": chat(customer, question), "max_tokens": 1}
    r = await client.post(f"{url}{CHAT}", json=body)
    assert r.status_code == 200, r.text
    deployment, _, replica = r.headers["x-llmgw-replica"].partition("/")
    return f"{deployment}.{replica}"


def blocks(customer: int) -> tuple[int, ...]:
    return prompt_blocks(RoutingConfig(), "chat", CHAT, {"messages": chat(customer, "q")})


def knows(gw: Gateway, customers: range) -> bool:
    """Whether `gw`'s index holds every customer's prefix."""
    assert all(gw.table.prefixes.deepest(blocks(c)) >= 4 for c in customers)
    return True


async def test_two_gateways_send_a_shared_prefix_to_the_same_replica_whichever_receives_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with (
        replicas(bus, tmp_path, nats_url, prefix) as c,
        gateway(c, id="gw-a", **FAST) as (a, _),
        gateway(c, id="gw-b", **FAST) as (b, gw_b),
        httpx.AsyncClient(timeout=30) as client,
    ):
        # Gateway a places six customers' conversations (each to the replica with room for it).
        first = {n: await served_by(client, a, n) for n in CUSTOMERS}
        assert len(set(first.values())) == 3
        await eventually(lambda: knows(gw_b, CUSTOMERS), timeout=10)
        # Their next questions reach gateway b, in another order (alone, b would place them
        # anew by its own counts): each goes where a sent it.
        for n in reversed(CUSTOMERS):
            assert await served_by(client, b, n, "again") == first[n], n
        # And back through a: still the same replica.
        for n in CUSTOMERS:
            assert await served_by(client, a, n, "once more") == first[n], n
        assert gw_b.table.routed_by("prefix") == len(CUSTOMERS)


async def test_a_gateway_started_after_the_traffic_routes_a_known_conversation_to_its_replica(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with replicas(bus, tmp_path, nats_url, prefix) as c, httpx.AsyncClient(timeout=30) as client:
        async with gateway(c, id="gw-a", **FAST) as (a, _):
            first = {n: await served_by(client, a, n) for n in CUSTOMERS}

            async def written() -> bool:
                for key in set(first.values()):
                    found = await bus.get(bus.names.routing_bucket, key, RoutingHeld)
                    assert found is not None, key
                    held = set(found[0].hashes())
                    assert all(blocks(n)[-1] in held for n in CUSTOMERS if first[n] == key), key
                return True

            await eventually(written, timeout=10)
        # Gateway a is gone; gateway c starts and has routed nothing.
        async with gateway(c, id="gw-c", **FAST) as (late, gw_c):
            await eventually(lambda: knows(gw_c, CUSTOMERS), timeout=10)
            for n in reversed(CUSTOMERS):
                assert await served_by(client, late, n, "again") == first[n], n
            assert gw_c.table.routed_by("prefix") == len(CUSTOMERS)


async def test_a_replica_removed_is_forgotten_by_every_gateway_and_by_the_bucket(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with (
        replicas(bus, tmp_path, nats_url, prefix) as c,
        gateway(c, id="gw-a", **FAST) as (a, gw_a),
        gateway(c, id="gw-b", **FAST) as (_, gw_b),
        httpx.AsyncClient(timeout=30) as client,
    ):
        first = {n: await served_by(client, a, n) for n in CUSTOMERS}
        await eventually(lambda: knows(gw_b, CUSTOMERS), timeout=10)
        gone = first[0]
        assert await bus.get(bus.names.routing_bucket, gone, RoutingHeld) is not None
        # Placement removes the replica's record.
        await bus.delete(bus.names.replicas_bucket, gone)

        async def forgotten() -> bool:
            for gw in (gw_a, gw_b):
                assert gw.table.prefixes.size(gone) == 0
                assert gone not in gw.table.prefixes.replicas()
            assert await bus.get(bus.names.routing_bucket, gone, RoutingHeld) is None
            return True

        await eventually(forgotten, timeout=10)
        # Its customers go elsewhere now, and the others stay where they were.
        for n in CUSTOMERS:
            key = await served_by(client, a, n, "after")
            assert key != gone
            if first[n] != gone:
                assert key == first[n], n
        # A gateway started now learns nothing of it.
        async with gateway(c, id="gw-c", **FAST) as (_, gw_c):
            await eventually(lambda: knows(gw_c, range(1, 6)), timeout=10)
            assert gone not in gw_c.table.prefixes.replicas()


async def test_the_shared_state_stays_within_its_bounds_under_a_flood_of_distinct_prompts(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    small = {"routing": {"share_interval_s": 0.05, "replica_blocks": 24, "index_blocks": 48}}
    async with (
        replicas(bus, tmp_path, nats_url, prefix) as c,
        gateway(c, id="gw-a", **small) as (a, gw_a),
        gateway(c, id="gw-b", **small) as (_, gw_b),
        httpx.AsyncClient(timeout=30) as client,
    ):
        # 40 distinct conversations of 17 blocks or more each: 680 blocks, far past the bounds.
        for n in range(100, 140):
            await served_by(client, a, n)

        async def bounded() -> bool:
            stored = await bus.stored(bus.names.routing_bucket)
            assert set(stored) == {"chat.r0", "chat.r1", "chat.r2"}
            for key in stored:
                found = await bus.get(bus.names.routing_bucket, key, RoutingHeld)
                assert found is not None
                held = found[0].hashes()
                # Each replica's value: at most its 24 most recent blocks (the index's bound of
                # 48 in all may have forgotten more of a replica routed to least lately).
                assert 0 < len(held) <= 24, (key, len(held))
                assert len(found[0].blocks) == 8 * len(held)
            last = blocks(139)
            values = [await bus.get(bus.names.routing_bucket, k, RoutingHeld) for k in stored]
            assert any(last[-1] in found[0].hashes() for found in values if found is not None)
            for gw in (gw_a, gw_b):
                index = gw.table.prefixes
                assert len(index) <= 48
                assert all(index.size(k) <= 24 for k in index.replicas())
            return True

        await eventually(bounded, timeout=15)
