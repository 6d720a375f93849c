"""One routing state that no two writers lose: each gateway's write of a replica's value is a
compare-and-set against the revision it last heard; a write refused reads what came between,
learns it and writes the merged snapshot again. Through a real NATS as the `gateway` identity
(writers in this process, a real gateway after them over real sim engines), and as plain data."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.config import NatsConfig
from llmgw_core.events import ReplicaRecord, decoder, encode
from llmgw_core.lifecycle import connect_service
from llmgw_core.prefixes import MAX_HELD_BLOCKS, RoutingHeld, pack
from llmgw_core.retry import Retry
from llmgw_gateway import Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.prefix_share import PrefixShare, Sharing
from tests.cluster_support import Cluster, cluster
from tests.test_gateway_hold import gateway, record
from tests.test_gateway_shared_routing_bus import FAST, blocks, knows, replicas, served_by
from tests.waiting import eventually

log = logging.getLogger("test")
ONE = "chat.r1"
# The replicas a writer's routing leaves out, so that both conversations go to ONE.
NOT_ONE = frozenset({"chat.r0", "chat.r2"})


@contextlib.asynccontextmanager
async def writer(c: Cluster, bus: Bus, name: str) -> AsyncIterator[PrefixShare]:
    """A gateway's sharing of the routing bucket, on a connection of its own as the `gateway`
    identity, its table holding the cluster's replica records (as its replicas watch would)."""
    config = msgspec.convert(c.nats("gateway"), NatsConfig)
    own = await connect_service(config, "gateway", ensure=False)
    async with own:
        table = Table(routing=RoutingConfig(share_interval_s=0.05))
        for key, change in (await bus.entries(bus.names.replicas_bucket, ReplicaRecord)).items():
            table.set_replica(key, change.value)
        yield PrefixShare(own, table, name)


def route(share: PrefixShare, customer: int) -> None:
    """The writer's gateway routes `customer`'s conversation to ONE."""
    chosen = share.state.table.pick("chat", exclude=NOT_ONE, blocks=blocks(customer))
    assert chosen is not None
    assert chosen[0] == ONE


async def stored(bus: Bus, key: str = ONE) -> RoutingHeld:
    found = await bus.get(bus.names.routing_bucket, key, RoutingHeld)
    assert found is not None, key
    return found[0]


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_two_gateways_writing_one_replica_in_one_interval_both_keep_their_newest_blocks(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # Regression: each gateway put its whole snapshot, and the later put overwrote the earlier;
    # the bucket lost one gateway's newest blocks, and a gateway started then routed that
    # conversation as a new prefix.
    async with replicas(bus, tmp_path, nats_url, prefix) as c:
        async with writer(c, bus, "gw-a") as a, writer(c, bus, "gw-b") as b, anyio.create_task_group() as tg:
            for share in (a, b):
                tg.start_soon(share.follow, Retry(log, "following the routing bucket", base_s=0.1, cap_s=0.5))
            # Each routes a conversation of its own to r1 within one interval, neither having
            # heard the other; both write at once.
            route(a, 1)
            route(b, 2)
            async with anyio.create_task_group() as writes:
                writes.start_soon(a.write)
                writes.start_soon(b.write)
            held = set((await stored(bus)).hashes())
            assert blocks(1)[-1] in held
            assert blocks(2)[-1] in held
            # Nothing is left to write: both landed, one of them after learning the other's.
            assert not a.state.dirty
            assert not b.state.dirty
            tg.cancel_scope.cancel()
        # Both gateways are gone; one started now routes both conversations by their prefix.
        async with gateway(c, id="gw-c", **FAST) as (late, gw_c), httpx.AsyncClient(timeout=30) as client:
            await eventually(lambda: knows(gw_c, range(1, 3)), timeout=10)
            for customer in (1, 2):
                assert await served_by(client, late, customer, "again") == ONE, customer
            assert gw_c.table.routed_by("prefix") == 2


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_three_gateways_writing_one_replica_at_once_all_land_within_the_tries(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        for i in range(3):
            await bus.put(
                bus.names.replicas_bucket, f"chat.r{i}", record(f"r{i}", f"http://127.0.0.1:1/r{i}")
            )
        async with writer(c, bus, "gw-a") as a, writer(c, bus, "gw-b") as b, writer(c, bus, "gw-d") as d:
            for share, customer in ((a, 1), (b, 2), (d, 3)):
                route(share, customer)
            async with anyio.create_task_group() as writes:
                for share in (a, b, d):
                    writes.start_soon(share.write)
            # One created the key, one was refused once, the last twice: each landed, the
            # last value holding all three conversations' newest blocks.
            held = set((await stored(bus)).hashes())
            assert {blocks(n)[-1] for n in (1, 2, 3)} <= held
            assert [share.state.dirty for share in (a, b, d)] == [set(), set(), set()]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_gateway_that_has_not_heard_the_engines_value_yet_never_writes_over_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # Regression: a gateway started after the launcher wrote its engine's view put its routed
    # guess over it at its first interval, before its watch had read the engine's value.
    engine = RoutingHeld(
        gateway="launcher-n1", blocks=pack([11, 12, 13]), at=1.0, source="engine", block_tokens=16
    )
    async with replicas(bus, tmp_path, nats_url, prefix) as c, writer(c, bus, "gw-a") as a:
        await bus.put(bus.names.routing_bucket, ONE, engine)
        route(a, 1)
        await a.write()
        assert await stored(bus) == engine
        # It learned the engine's view from the refused write, and writes none of its own.
        assert a.state.table.engine[ONE].blocks == frozenset({11, 12, 13})
        assert not a.state.dirty
        assert a.state.writes(now=2.0) == ([], [])


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_value_that_does_not_decode_costs_one_interval_then_is_replaced(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    bucket = bus.names.routing_bucket
    async with replicas(bus, tmp_path, nats_url, prefix) as c, writer(c, bus, "gw-a") as a:
        bad = await (await bus.kv(bucket)).put(ONE, b'{"kind": "RoutingHeld", "blocks": 7}')
        route(a, 1)
        # Refused, and the value there cannot be read: that interval's write is lost, nothing
        # escapes, and the replica is written again at the next.
        await a.write()
        assert a.state.dirty == {ONE}
        assert (await bus.revisions(bucket, ONE))[0][0] == bad
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.follow, Retry(log, "following the routing bucket", base_s=0.1, cap_s=0.5))

            def heard() -> bool:
                assert a.state.revisions.get(ONE) == bad
                return True

            await eventually(heard, timeout=10)
            tg.cancel_scope.cancel()
        await a.write()
        value = await stored(bus)
        assert value.gateway == "gw-a"
        assert blocks(1)[-1] in value.hashes()
        assert not a.state.dirty


# --- plain data ----------------------------------------------------------------------------------


def sharing(name: str) -> Sharing:
    table = Table(routing=RoutingConfig())
    for i in range(3):
        record = ReplicaRecord(
            deployment="chat", replica=f"r{i}", profile="p", profile_fp="x", state="ready", url=f"http://r{i}"
        )
        table.set_replica(f"chat.r{i}", record)
    return Sharing(table, name)


def test_a_refused_write_learns_what_came_between_and_writes_both_gateways_blocks() -> None:
    a, b = sharing("gw-a"), sharing("gw-b")
    a.table.pick("chat", exclude=NOT_ONE, blocks=blocks(1))
    b.table.pick("chat", exclude=NOT_ONE, blocks=blocks(2))
    [(_, mine)] = a.writes(now=1.0)[0]
    a.wrote(ONE, 5)
    [(_, theirs)] = b.writes(now=1.0)[0]
    assert blocks(1)[-1] not in theirs.hashes()
    # b's create is refused: a's value at revision 5 is read, learned, and b writes again
    # against revision 5 a snapshot holding both.
    b.refused(ONE, (mine, 5), now=1.0)
    assert b.revisions[ONE] == 5
    merged = b.snapshot(ONE, now=1.0)
    assert merged is not None
    assert {blocks(1)[-1], blocks(2)[-1]} <= set(merged.hashes())
    # a reads b's merged value (revision 6) from its watch and learns b's blocks.
    assert a.read(ONE, merged, now=1.1, revision=6) == "learned"
    assert a.table.prefixes.deepest(blocks(2)) == len(blocks(2))
    assert a.revisions[ONE] == 6


def test_the_revision_written_against_is_the_newest_heard_and_starts_again_with_a_new_bucket() -> None:
    state = sharing("gw-a")
    state.wrote(ONE, 9)
    # The watch may still deliver an older revision than this gateway's own write.
    state.heard(ONE, 8)
    assert state.revisions[ONE] == 9
    state.heard(ONE, 10)
    assert state.revisions[ONE] == 10
    # A bucket made anew (its revisions start again): the watch says 0, then the new ones.
    state.read(ONE, None, now=1.0, revision=0)
    assert ONE not in state.revisions
    state.heard(ONE, 1)
    assert state.revisions[ONE] == 1
    # A read after a refused write is the key's revision now, whatever was heard.
    state.wrote(ONE, 40)
    state.refused(ONE, (RoutingHeld(gateway="gw-b", blocks=pack([1])), 2), now=1.0)
    assert state.revisions[ONE] == 2
    state.refused(ONE, None, now=1.0)  # deleted meanwhile: a create next
    assert ONE not in state.revisions
    # A replica gone: nothing of it is kept.
    state.wrote(ONE, 3)
    state.table.set_replica(ONE, None)
    assert ONE not in state.revisions
    # Keys of replicas this gateway does not know, however many: no revision kept for them.
    for i in range(5000):
        state.read(f"chat.x{i}", RoutingHeld(gateway="gw-b"), now=1.0, revision=i + 1)
    assert state.revisions == {}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=400),
        st.builds(
            lambda held, source, tokens: encode(
                RoutingHeld(gateway="gw-b", blocks=pack(held), source=source, block_tokens=tokens)
            ),
            st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=40),
            st.sampled_from(["routed", "engine"]),
            st.integers(min_value=0, max_value=1 << 16),
        ),
    ),
    st.integers(min_value=1, max_value=2**40),
)
def test_a_value_read_after_a_refused_write_is_decoded_or_refused_by_name_and_learned_within_bounds(
    raw: bytes, revision: int
) -> None:
    """What a refused write reads is another process's bytes: the bus's `get` decodes them with
    `decoder(RoutingHeld)`, which raises msgspec's DecodeError (ValidationError is one) alone,
    the one error the writer catches; a value learned adds at most `replica_blocks` blocks."""
    state = Sharing(Table(routing=RoutingConfig(replica_blocks=16, index_blocks=32)), "gw-a")
    record = ReplicaRecord(
        deployment="chat", replica="r1", profile="p", profile_fp="x", state="ready", url="http://r1"
    )
    state.table.set_replica(ONE, record)
    try:
        value = decoder(RoutingHeld).decode(raw)
    except msgspec.DecodeError:
        return
    assert len(value.hashes()) <= MAX_HELD_BLOCKS
    state.refused(ONE, (value, revision), now=1.0)
    assert state.revisions[ONE] == revision
    assert state.table.prefixes.size(ONE) <= 16
    assert len(state.table.prefixes) <= 32
    held = state.table.engine.get(ONE)
    assert held is None or len(held.blocks) <= 16
