"""Where each answer was served and why, and cache weighed against load: every routed answer
names its replica (`x-llmgw-replica`) on both request paths, streams too, and the request's
span says why that replica was chosen; the rule that lets a hot prefix spill, as a pure function."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw_core.bus.deadletter import DecodeFailure, decode
from llmgw_core.events import EngineLoad, ReplicaRecord, ShardStatus, encode
from llmgw_core.prefixes import MAX_HELD_BLOCKS, RoutingHeld, pack
from llmgw_gateway import Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.prefix_index import PrefixIndex
from llmgw_gateway.prefix_share import PENDING_MAX, STALE_S, Sharing
from llmgw_gateway.weigh import bound, load_of, worth
from tests.test_gateway_lane import lane

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@contextlib.asynccontextmanager
async def traced_lane(
    replicas: tuple[str, ...] = ("r7",),
) -> AsyncIterator[tuple[str, list[str], InMemorySpanExporter]]:
    """`test_gateway_lane.lane` over `replicas`, its spans kept: its URL, the routed requests its
    ASGI app saw, the spans."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    async with lane(replicas=replicas, tracer=provider.get_tracer("test")) as served:
        yield served.url, served.asgi, spans


async def test_every_answer_names_its_replica_on_both_paths_and_its_span_says_why() -> None:
    async with traced_lane() as (url, asgi, spans), httpx.AsyncClient(base_url=url) as client:
        chat = {"model": "chat", "prompt": "hello"}
        # The first goes by the ASGI path (the replica's model name is read, a connection
        # opened); the second by the express lane, which never reaches the ASGI app.
        first = await client.post("/v1/completions", json=chat)
        second = await client.post("/v1/completions", json=chat)
        assert asgi == ["/v1/completions"]
        # Server-sent events: the ASGI path's, passed on as they come.
        async with client.stream("POST", "/v1/completions", json={**chat, "prompt": "events"}) as stream:
            events = b"".join([chunk async for chunk in stream.aiter_raw()])
        assert asgi == ["/v1/completions"] * 2
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert b"data:" in events
        for r in (first, second, stream):
            assert r.status_code == 200
            assert r.headers.get_list("x-llmgw-replica") == ["chat/r7"]
    # One replica: chosen by load, as each request's span says.
    routed = [s for s in spans.get_finished_spans() if s.attributes and "llmgw.route" in s.attributes]
    assert len(routed) == 3
    assert {s.attributes["llmgw.route"] for s in routed if s.attributes} == {"least outstanding"}


async def test_a_span_says_how_deep_the_prefix_match_went() -> None:
    long = {"model": "chat", "prompt": "customer 7 file: " + "order shipped. " * 200}
    async with traced_lane(("r7", "r8")) as (url, _, spans), httpx.AsyncClient(base_url=url) as client:
        first = await client.post("/v1/completions", json=long)
        again = await client.post("/v1/completions", json={**long, "prompt": long["prompt"] + " more?"})
    assert first.status_code == again.status_code == 200
    # The same replica both times: the second by its prefix, every whole block of the first.
    assert first.headers["x-llmgw-replica"] == again.headers["x-llmgw-replica"]
    reasons = [s.attributes["llmgw.route"] for s in spans.get_finished_spans() if s.attributes]
    assert reasons == ["new prefix", "prefix 11 blocks"]


def ready(table: Table, n: int) -> list[str]:
    for i in range(n):
        table.set_replica(
            f"chat.r{i}",
            ReplicaRecord(
                deployment="chat",
                replica=f"r{i}",
                profile="p",
                profile_fp="x",
                state="ready",
                url=f"http://r{i}",
                shards=(f"n{i}.s{i}",),
            ),
        )
    return [f"chat.r{i}" for i in range(n)]


def prompt(i: int) -> tuple[int, ...]:
    """A prompt's blocks, 16 of them: the same for every `i` up to the last (a shared prefix)."""
    return (*range(1000, 1015), i)


def test_a_prefix_match_says_how_deep_it_went_in_the_reason() -> None:
    table = Table()
    keys = ready(table, 2)
    table.prefixes.record(prompt(0), keys[1])
    assert table.pick("chat", blocks=prompt(1)) == (keys[1], table.replicas[keys[1]])
    assert table.reason == "prefix 15 blocks"
    assert table.pick("chat", blocks=()) is not None
    assert table.reason == "least outstanding"


def test_cache_is_weighed_against_load() -> None:
    # A replica's load: this gateway's in flight there, or its engine's counts where more.
    assert load_of(3, None) == 3
    assert load_of(3, 1) == 3
    assert load_of(0, 7) == 7
    # A match of 16 blocks outweighs 4 requests more than the least busy replica at 4 blocks a
    # request; not 5.
    assert worth(16, 5, 1, 4.0)
    assert not worth(16, 6, 1, 4.0)
    # A shallow match outweighs one request more, not two; a deep one many; 0 a request:
    # cache only.
    assert worth(4, 2, 1, 4.0)
    assert not worth(4, 3, 1, 4.0)
    assert worth(128, 30, 0, 4.0)
    assert worth(4, 100, 0, 0.0)
    # The load bound: load_factor x the mean + 1.
    assert bound([0, 2, 4], 1.25) == pytest.approx(3.5)


def test_a_hot_prefix_spills_once_its_replica_is_busier_by_what_the_match_is_worth() -> None:
    table = Table(routing=RoutingConfig(load_factor=100.0))
    keys = ready(table, 2)
    table.prefixes.record(prompt(0), keys[0])
    # Every request shares 15 blocks: r0 takes them while it has at most 3 more in flight
    # (15 >= 4 x 3), and the fifth goes to r1, which then holds the prefix too.
    chosen = []
    for i in range(1, 6):
        key, _ = table.pick("chat", blocks=prompt(i))  # type: ignore[misc]
        table.outstanding[key] += 1
        chosen.append(key)
    assert chosen == [keys[0]] * 4 + [keys[1]]
    assert table.prefixes.holders(prompt(0)[14]) == [keys[0], keys[1]]


def test_the_engines_own_counts_weigh_what_other_gateways_sent() -> None:
    # Nothing in flight from this gateway; r0's engine runs and queues 6 requests that other
    # gateways sent: the prefix goes to the least busy, r1, which then holds it too. Once r0's
    # queue is gone and r1's engine is the busier, the prefix goes back to r0.
    table = Table(routing=RoutingConfig(load_factor=100.0))
    keys = ready(table, 3)
    table.prefixes.record(prompt(0), keys[0])
    busy = ShardStatus(
        node="n0", shard="s0", replica="r0", state="ready", load=EngineLoad(running=2, waiting=4)
    )
    table.set_shard_status("n0.s0", busy)
    assert table.pick("chat", blocks=prompt(1))[0] == keys[1]  # type: ignore[index]
    assert table.reason == "least outstanding"
    table.set_shard_status("n0.s0", msgspec.structs.replace(busy, load=EngineLoad(running=1)))
    table.set_shard_status("n1.s1", msgspec.structs.replace(busy, load=EngineLoad(running=3)))
    assert table.pick("chat", blocks=prompt(2))[0] == keys[0]  # type: ignore[index]
    assert table.reason == "prefix 15 blocks"
    # A shard no longer ready says nothing of its load.
    table.set_shard_status("n0.s0", msgspec.structs.replace(busy, state="failed"))
    assert table.engine_loads == {"n1.s1": 3}


def test_a_replicas_blocks_are_bounded_and_forgotten_least_recently_routed_first() -> None:
    index = PrefixIndex(capacity=100, per_replica=10)
    index.record(tuple(range(8)), "chat.r0")
    index.record(tuple(range(100, 108)), "chat.r0")
    # Ten of r0's most recent: the second prompt whole, and the shallowest two of the first
    # (a prompt's deep blocks go first, its shared lead last).
    assert index.size("chat.r0") == 10
    assert set(index.recent("chat.r0")) == {*range(100, 108), 0, 1}
    assert index.deepest(tuple(range(100, 108))) == 8
    assert index.deepest(tuple(range(8))) == 2
    # What another gateway says r1 holds, least recently routed first: learned in that order
    # under the same bound.
    index.learn("chat.r1", range(200, 215))
    assert index.recent("chat.r1") == list(range(205, 215))
    assert index.holders(214) == ["chat.r1"]
    index.forget("chat.r1")
    assert index.holders(214) == []
    assert len(index) == 10


def sharing(keys: int = 2, **routing: object) -> Sharing:
    table = Table(routing=RoutingConfig(**routing))  # type: ignore[arg-type]
    ready(table, keys)
    return Sharing(table, "gw-a")


def test_the_writer_batches_each_replica_into_one_value_and_deletes_the_gone() -> None:
    state = sharing(3, replica_blocks=8)
    table = state.table
    for i in range(5):
        table.pick("chat", blocks=(*range(10 * i, 10 * i + 6),))
    puts, deletes = state.writes(now=1.0)
    # However many requests, one value per replica routed to, each its newest 8 blocks.
    routed = {k for k in table.prefixes.replicas() if table.prefixes.size(k)}
    assert sorted(k for k, _ in puts) == sorted(routed)
    assert all(len(v.hashes()) <= 8 and v.gateway == "gw-a" and v.at == 1.0 for _, v in puts)
    assert deletes == []
    # Nothing routed since: nothing to write.
    assert state.writes(now=2.0) == ([], [])
    # Its own value read back is not learned again; another gateway's is.
    key, value = puts[0]
    assert state.read(key, value, now=2.0) == "own"
    other = RoutingHeld(gateway="gw-b", blocks=pack([7, 8, 9]), at=2.0)
    assert state.read("chat.r2", other, now=2.0) == "learned"
    assert table.prefixes.holders(9)[-1] == "chat.r2"
    # A replica gone: its key is deleted at the next write, and nothing more is written of it.
    table.set_replica("chat.r2", None)
    assert state.writes(now=3.0) == ([], ["chat.r2"])


def test_a_value_for_a_replica_not_yet_known_waits_for_it_then_is_deleted_if_it_never_comes() -> None:
    state = sharing(1)
    value = RoutingHeld(gateway="gw-b", blocks=pack([1, 2, 3]), at=1.0)
    assert state.read("chat.r5", value, now=10.0) == "pending"
    assert state.read("chat.r6", value, now=10.0) == "pending"
    ready(state.table, 6)
    state.known("chat.r5")
    assert state.table.prefixes.holders(3) == ["chat.r5"]
    # r6 never comes (it went while no gateway ran); r9's value is read later.
    assert state.read("chat.r9", value, now=10.0) == "pending"
    assert state.writes(now=10.0 + STALE_S - 1) == ([], [])
    assert state.writes(now=10.0 + STALE_S)[1] == ["chat.r6", "chat.r9"]
    assert not state.pending
    # Never more than PENDING_MAX held aside, the newest kept.
    for i in range(PENDING_MAX + 5):
        state.read(f"chat.x{i}", value, now=20.0)
    assert len(state.pending) == PENDING_MAX
    assert f"chat.x{PENDING_MAX + 4}" in state.pending


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda gw, raw, at: json.dumps(
                {"kind": "RoutingHeld", "gateway": gw, "blocks": base64.b64encode(raw).decode(), "at": at}
            ).encode(),
            st.text(max_size=80),
            st.binary(max_size=200),
            st.one_of(st.floats(allow_nan=False), st.integers(), st.text(max_size=5)),
        ),
    )
)
def test_a_routing_value_from_another_gateway_is_decoded_within_bounds_or_refused(data: bytes) -> None:
    # Whatever the bytes: the bus's decode gives a value or its own named error, and a value
    # learned adds at most `replica_blocks` blocks.
    state = sharing(1, replica_blocks=16)
    try:
        value = decode(RoutingHeld, "$KV.llmgw-routing.chat.r0", data)
    except DecodeFailure as exc:
        refused = exc.error
    else:
        refused = ""
    if refused:
        assert len(refused) <= 512
        return
    assert len(value.blocks) % 8 == 0
    assert len(value.blocks) <= MAX_HELD_BLOCKS * 8
    assert state.read("chat.r0", value, now=1.0) in ("learned", "own")
    assert state.table.prefixes.size("chat.r0") <= 16
    assert len(state.table.prefixes) <= 16


def test_a_value_of_the_most_hashes_is_refused_past_it() -> None:
    most = RoutingHeld(gateway="gw-b", blocks=bytes(8 * MAX_HELD_BLOCKS))
    assert len(decode(RoutingHeld, "s", encode(most)).hashes()) == MAX_HELD_BLOCKS
    too_many = encode(most).replace(b'"blocks":"', b'"blocks":"AAAAAAAAAAA', 1)
    with pytest.raises(DecodeFailure, match=r"\$\.blocks"):
        decode(RoutingHeld, "s", too_many)
