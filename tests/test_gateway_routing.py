"""Prefix-aware routing as an operator sees it: requests through a real gateway proxy in front
of several sim engine processes, counted by each engine's own /metrics."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from llmgw_core.config import loads
from llmgw_core.errors import ConfigError
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_gateway import GatewayConfig, Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.routing import prompt_blocks, rendezvous
from tests.gateway_support import proxy_over
from tests.test_gateway import metric
from tests.test_gateway_api import sim_engines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

SYSTEM = "You are the support assistant of Example Corp. Answer briefly and politely. " * 2


def context(customer: int) -> str:
    """A customer's own long context (about 4 KB, 16 blocks of 256 bytes)."""
    return "".join(f"customer {customer} record {i}: order {i * 7919 % 1000} shipped. " for i in range(100))


def chat(customer: int, question: str, *, system: str = SYSTEM) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": context(customer) if customer >= 0 else ""},
        {"role": "user", "content": question},
    ]


@contextlib.asynccontextmanager
async def gateway(urls: list[str], **routing: object) -> AsyncIterator[tuple[str, Table, httpx.AsyncClient]]:
    """The gateway's proxy in this process over replicas r0, r1, … of deployment `chat`."""
    async with proxy_over(urls, routing=RoutingConfig(**routing)) as gw:  # type: ignore[arg-type]
        yield gw.url, gw.table, gw.client


async def served(client: httpx.AsyncClient, urls: list[str]) -> list[int]:
    """Completion requests each engine has served, by its own count."""
    return [int(metric((await client.get(f"{u}/metrics")).text, "llmgw_sim_requests_total")) for u in urls]


async def ask(client: httpx.AsyncClient, base: str, messages: list[dict[str, str]]) -> None:
    r = await client.post(
        f"{base}/v1/chat/completions", json={"model": "chat", "messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


def lead(customer: int, routing: RoutingConfig | None = None) -> int:
    """The hash of a customer's prompt lead (its first min_match_blocks blocks: the system prompt
    and the start of its context, whatever its question), as every gateway process computes it."""
    routing = routing or RoutingConfig()
    blocks = prompt_blocks(routing, "chat", "/v1/chat/completions", {"messages": chat(customer, "q")})
    return blocks[routing.min_match_blocks - 1]


KEYS = ["chat.r0", "chat.r1", "chat.r2"]


async def test_one_customers_long_prefix_lands_on_one_replica_chosen_by_its_lead() -> None:
    with sim_engines([], [], []) as urls:
        async with gateway(urls) as (base, _, client):
            # Each customer's first request matches no replica: the first goes to its lead's
            # rendezvous choice (the same in every gateway process); the second to its lead's
            # choice among the other two (the first's replica holds more than its share of
            # what was routed); the third to the one left with room. The rest follow them.
            first = rendezvous(lead(0), KEYS)
            second = rendezvous(lead(1), [k for k in KEYS if k != first])
            (third,) = set(KEYS) - {first, second}
            expected = [0, 0, 0]
            for customer, replica in enumerate((first, second, third)):
                for q in range(4):
                    await ask(client, base, chat(customer, f"question {q}: where is my order?"))
                expected[KEYS.index(replica)] += 4
                assert await served(client, urls) == expected
            # Back to customer 1: to the replica that holds its prefix.
            await ask(client, base, chat(1, "one more question"))
            expected[KEYS.index(second)] += 1
            assert await served(client, urls) == expected
            # Two first requests went by their lead's hash, the third to the only replica with
            # room, every later one by its prefix: so the operator's scrape says.
            scrape = (await client.get(f"{base}/metrics")).text
            assert metric(scrape, 'llmgw_gateway_routed_total{deployment="chat",how="hash"}') == 2
            assert metric(scrape, 'llmgw_gateway_routed_total{deployment="chat",how="load"}') == 1
            assert metric(scrape, 'llmgw_gateway_routed_total{deployment="chat",how="prefix"}') == 10


async def test_the_load_bound_spills_a_prefix_to_another_replica_when_its_own_is_busy() -> None:
    # Slow tokens: each stream stays open for about 10 s.
    with sim_engines(["--tokens-per-second", "2"], ["--tokens-per-second", "2"]) as urls:
        async with (
            gateway(urls, load_factor=1.0) as (base, table, client),
            contextlib.AsyncExitStack() as open_,
        ):
            chunks: list[AsyncIterator[bytes]] = []
            for q in range(4):
                response = await open_.enter_async_context(
                    client.stream(
                        "POST",
                        f"{base}/v1/chat/completions",
                        json={
                            "model": "chat",
                            "messages": chat(0, f"q{q}"),
                            "max_tokens": 20,
                            "stream": True,
                        },
                    )
                )
                assert response.status_code == 200
                # In flight: its first event has come (the iterator kept: dropped, it closes the stream).
                chunks.append(response.aiter_raw())
                await anext(chunks[-1])
                # Up to r0's third request, r0 (in flight 0, 1, then 2) is within 1.0 x the mean + 1;
                # the fourth finds it at 3 against a bound of 2.5 and goes to r1.
            assert await served(client, urls) == [3, 1]
            assert dict(table.outstanding) == {"chat.r0": 3, "chat.r1": 1}


async def test_a_short_shared_system_prompt_does_not_pin_everything_to_one_replica() -> None:
    with sim_engines([], [], []) as urls:
        async with gateway(urls) as (base, _, client):
            # The same system prompt (under min_match_blocks), then each request its own short question.
            for q in range(6):
                await ask(client, base, chat(-1, f"short question number {q}?"))
            assert await served(client, urls) == [2, 2, 2]


async def test_prefix_aware_off_is_least_outstanding_again() -> None:
    with sim_engines([], [], []) as urls:
        async with gateway(urls, prefix_aware=False) as (base, table, client):
            for q in range(6):
                await ask(client, base, chat(0, f"question {q}"))
            assert await served(client, urls) == [2, 2, 2]
            assert len(table.prefixes) == 0
            # Every choice by load, none by a prefix.
            scrape = (await client.get(f"{base}/metrics")).text
            assert metric(scrape, 'llmgw_gateway_routed_total{deployment="chat",how="load"}') == 6
            assert 'how="prefix"' not in scrape


async def test_a_replica_removed_from_the_table_moves_its_prefixes_elsewhere() -> None:
    with sim_engines([], [], []) as urls:
        async with gateway(urls) as (base, table, client):
            for q in range(2):
                await ask(client, base, chat(0, f"question {q}"))
            first = KEYS.index(rendezvous(lead(0), KEYS))
            assert (await served(client, urls))[first] == 2
            table.set_replica(KEYS[first], None)
            for q in range(3):
                await ask(client, base, chat(0, f"later question {q}"))
            # All three on one other replica, the lead's next choice: the prefix moved there whole.
            rest = [k for k in KEYS if k != KEYS[first]]
            after = await served(client, urls)
            assert after[first] == 2, after
            assert after[KEYS.index(rendezvous(lead(0), rest))] == 3, after


def test_only_a_bounded_lead_of_a_long_prompt_is_hashed_and_quickly() -> None:
    routing = RoutingConfig()
    long = {"model": "chat", "messages": [{"role": "user", "content": "x" * 200_000 + "the question"}]}
    blocks = prompt_blocks(routing, "chat", "/v1/chat/completions", long)
    assert len(blocks) == routing.max_blocks
    # The same lead, another tail: the same blocks (the tail is past the bound).
    other = {"model": "chat", "messages": [{"role": "user", "content": "x" * 200_000 + "another"}]}
    assert prompt_blocks(routing, "chat", "/v1/chat/completions", other) == blocks
    # Embeddings are not prefix-cached; a prompt shorter than a block has no block.
    assert prompt_blocks(routing, "chat", "/v1/embeddings", {"input": "x" * 5000}) == ()
    assert prompt_blocks(routing, "chat", "/v1/completions", {"prompt": "hi"}) == ()
    started = time.perf_counter()
    for _ in range(100):
        prompt_blocks(routing, "chat", "/v1/chat/completions", long)
    per_request = (time.perf_counter() - started) / 100
    assert per_request < 0.01, f"{per_request * 1e3:.2f} ms to hash one prompt's lead"


def test_the_index_forgets_the_least_recently_routed_beyond_its_bound() -> None:
    routing = RoutingConfig(index_blocks=40)
    table = Table(routing=routing)
    for i in range(2):
        table.set_replica(
            f"chat.r{i}",
            ReplicaRecord(
                deployment="chat", replica=f"r{i}", profile="p", profile_fp="x", state="ready", url="u"
            ),
        )
    customers = [
        prompt_blocks(routing, "chat", "/v1/chat/completions", {"messages": chat(c, "q")}) for c in range(6)
    ]
    assert all(len(b) >= routing.min_match_blocks for b in customers)
    for blocks in customers:
        table.pick("chat", blocks=blocks)
    assert len(table.prefixes) == 40
    # The last customer's prompt is still matched whole; the first one's is forgotten.
    assert table.prefixes.deepest(customers[-1]) == len(customers[-1])
    assert table.prefixes.deepest(customers[0]) == 0


def test_routing_settings_out_of_range_are_refused_naming_the_field() -> None:
    assert loads(
        "routing: {prefix_aware: false}\n", GatewayConfig, source="gateway.yaml"
    ).routing == RoutingConfig(prefix_aware=False)
    with pytest.raises(ConfigError, match=r"gateway.yaml.*routing.load_factor"):
        loads("routing: {load_factor: 0.5}\n", GatewayConfig, source="gateway.yaml")


def replicas(table: Table, n: int) -> list[str]:
    for i in range(n):
        table.set_replica(
            f"chat.r{i}",
            ReplicaRecord(
                deployment="chat", replica=f"r{i}", profile="p", profile_fp="x", state="ready", url="u"
            ),
        )
    return [f"chat.r{i}" for i in range(n)]


def customer_blocks(customer: int) -> tuple[int, ...]:
    return prompt_blocks(RoutingConfig(), "chat", "/v1/chat/completions", {"messages": chat(customer, "q")})


def test_a_new_prefix_goes_to_the_same_replica_from_two_tables_that_routed_the_same_prefixes() -> None:
    """Two gateway processes (or workers) that were sent the same customers agree on a new
    customer's replica, whatever else each routed by load (prompts not hashed: embeddings, or
    prefix-aware routing off for them). What each was sent differing, they may differ where a
    replica's share is at the bound (`prefix_balance`)."""
    one, two = Table(), Table()
    keys = replicas(one, 4)
    replicas(two, 4)
    for _ in range(5):
        two.pick("chat")
    first = one.pick("chat", blocks=customer_blocks(0))
    assert first is not None
    assert first[0] == rendezvous(lead(0), keys)
    assert two.pick("chat", blocks=customer_blocks(0)) == first
    for customer in range(1, 20):
        blocks = customer_blocks(customer)
        chosen = one.pick("chat", blocks=blocks)
        assert chosen is not None
        assert chosen == two.pick("chat", blocks=blocks), customer
    # The leads spread over the replicas: 20 customers over 4, none past prefix_balance x 5.
    held = Counter(one.pick("chat", blocks=customer_blocks(c))[0] for c in range(20))  # type: ignore[index]
    assert set(held) == set(keys)
    assert max(held.values()) <= RoutingConfig().prefix_balance * 20 / 4, held


def test_new_prefixes_fill_the_replicas_caches_evenly_even_where_one_is_always_busier() -> None:
    """Four customers on two replicas, one of which always has a request in flight: by load alone
    every new customer would go to the other, and its engine's cache would hold four customers
    while the busier one's held none. Each replica is sent two."""
    table = Table()
    keys = replicas(table, 2)
    table.outstanding[keys[1]] = 1
    for customer in range(4):
        table.pick("chat", blocks=customer_blocks(customer))
    holders = Counter(table.prefixes.holders(lead(c))[0] for c in range(4))
    assert holders == {keys[0]: 2, keys[1]: 2}
    assert table.prefixes.size(keys[0]) == table.prefixes.size(keys[1]) == 2 * len(customer_blocks(0))
    # Their next questions follow their prefixes, whatever the load.
    for customer in range(4):
        chosen = table.pick("chat", blocks=customer_blocks(customer))
        assert chosen is not None
        assert chosen[0] == table.prefixes.holders(lead(customer))[0]
    assert table.routed[("chat", "prefix")] == 4
    # Room never outweighs the load bound: a replica over it takes no new customer.
    table.outstanding[keys[1]] = 5
    for customer in range(10, 20):
        table.prefixes.record(customer_blocks(customer), keys[0])
    chosen = table.pick("chat", blocks=customer_blocks(4))
    assert chosen is not None
    assert chosen[0] == keys[0]


def test_what_each_replica_was_sent_is_counted_as_the_index_learns_and_forgets() -> None:
    routing = RoutingConfig(index_blocks=40)
    table = Table(routing=routing)
    keys = replicas(table, 2)
    blocks = customer_blocks(0)
    index = table.prefixes
    index.record(blocks, keys[0])
    index.record(blocks, keys[0])
    assert (index.size(keys[0]), index.size(keys[1])) == (len(blocks), 0)
    # Sent to the other as well (a spill): both hold it.
    index.record(blocks, keys[1])
    assert (index.size(keys[0]), index.size(keys[1])) == (len(blocks), len(blocks))
    # Forgotten beyond the index's bound: the counts fall with it.
    for c in range(1, 6):
        index.record(customer_blocks(c), keys[0])
    assert len(index) == 40
    assert index.size(keys[0]) + index.size(keys[1]) == sum(len(h) for h in index._held.values())
    assert index.size(keys[1]) == 0  # its blocks were the least recently routed
    # A replica gone is forgotten: its blocks, and its count with them.
    index.record(customer_blocks(6), keys[1])
    table.set_replica(keys[0], None)
    assert index.size(keys[0]) == 0
    assert len(index) == index.size(keys[1]) == len(customer_blocks(6))


def test_a_new_prefix_never_waits_on_a_busy_replica_while_another_is_idle() -> None:
    table = Table()
    keys = replicas(table, 3)
    blocks = customer_blocks(7)
    hashed = rendezvous(lead(7), keys)
    # Its hash's choice busy with one request: the lead is cold everywhere, so it goes to an
    # idle replica, the heaviest of the two idle ones.
    table.outstanding[hashed] = 1
    idle = [k for k in keys if k != hashed]
    assert table.pick("chat", blocks=blocks) == (
        rendezvous(lead(7), idle),
        table.replicas[rendezvous(lead(7), idle)],
    )
    assert table.routed[("chat", "hash")] == 1
    # Only one replica idle: load decides, and says so.
    table = Table()
    replicas(table, 3)
    table.outstanding.update({keys[0]: 1, keys[1]: 1})
    chosen = table.pick("chat", blocks=customer_blocks(8))
    assert chosen is not None
    assert chosen[0] == keys[2]
    assert table.routed == {("chat", "load"): 1}


def test_the_lead_hash_is_the_same_in_every_process() -> None:
    """Python's `hash` of bytes differs per process (PYTHONHASHSEED): the lead's must not."""
    code = (
        "from tests.test_gateway_routing import lead; "
        "from llmgw_gateway.routing import rendezvous; "
        "print(lead(7), rendezvous(lead(7), ['chat.r0', 'chat.r1', 'chat.r2']))"
    )
    said = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        for seed in ("1", "2")
    }
    assert said == {f"{lead(7)} {rendezvous(lead(7), KEYS)}\n"}


def test_a_replica_over_the_load_bound_is_skipped_for_the_next_heaviest() -> None:
    table = Table()
    keys = replicas(table, 3)
    blocks = customer_blocks(0)
    winner = rendezvous(lead(0), keys)
    # 4 in flight at the winner: over 1.25 x the mean (4/3) + 1.
    table.outstanding[winner] = 4
    chosen = table.pick("chat", blocks=blocks)
    assert chosen is not None
    assert chosen[0] == rendezvous(lead(0), [k for k in keys if k != winner])
    assert table.routed[("chat", "hash")] == 1


def test_a_replica_leaving_moves_only_the_prefixes_it_held() -> None:
    """Rendezvous hashing's own promise, with the balance of the caches out of the way (it may
    move a few more, to keep the replicas' shares within prefix_balance)."""
    routing = RoutingConfig(prefix_balance=1000.0)
    before, after = Table(routing=routing), Table(routing=routing)
    keys = replicas(before, 4)
    replicas(after, 4)
    after.set_replica("chat.r2", None)
    moved = 0
    for customer in range(60):
        blocks = customer_blocks(customer)
        was, now = before.pick("chat", blocks=blocks), after.pick("chat", blocks=blocks)
        assert was is not None
        assert now is not None
        if was[0] == "chat.r2":
            moved += 1
            assert now[0] != "chat.r2"
        else:
            assert now[0] == was[0], customer
    # r2 held about a quarter of them; only those moved.
    assert 0 < moved < 30
    assert set(keys) - {"chat.r2"} >= {after.pick("chat", blocks=customer_blocks(c))[0] for c in range(60)}  # type: ignore[index]


def test_a_prompt_too_short_for_a_lead_goes_by_load() -> None:
    table = Table()
    replicas(table, 3)
    short = prompt_blocks(RoutingConfig(), "chat", "/v1/chat/completions", {"messages": chat(-1, "x" * 600)})
    assert 0 < len(short) < RoutingConfig().min_match_blocks
    chosen = [table.pick("chat", blocks=short) for _ in range(3)]
    assert sorted(c[0] for c in chosen if c is not None) == ["chat.r0", "chat.r1", "chat.r2"]
    assert table.routed[("chat", "load")] == 3


def test_the_table_finds_a_deployments_replicas_and_names_among_many_as_it_did_among_few() -> None:
    """The table keeps its records by deployment and its names ready-made: what it answers is
    what it answered reading every record, whatever the order of the changes."""
    table = Table()
    table.set_deployment("b", Deployment(name="b", profile="p", aliases=("shared", "bee")))
    table.set_deployment("a", Deployment(name="a", profile="p", aliases=("shared",)))
    table.set_deployment("shared", None)
    for d in ("a", "b", "orphan"):
        for i in range(3):
            table.set_replica(
                f"{d}.r{i}",
                ReplicaRecord(
                    deployment=d, replica=f"r{i}", profile="p", profile_fp="x", state="ready", url="u"
                ),
            )
    # Names, then aliases (the first deployment by name wins one claimed twice); a deployment
    # with records and no entry in the deployments bucket is known by its name.
    assert [table.resolve(m) for m in ("a", "b", "shared", "bee", "orphan", "none")] == [
        "a",
        "b",
        "a",
        "b",
        "orphan",
        None,
    ]
    assert table.known() == ["a", "b", "orphan"]
    table.known().append("changed")
    assert table.known() == ["a", "b", "orphan"]
    # A deployment's own records only, in key order.
    assert [k for k, _ in table.of("b")] == ["b.r0", "b.r1", "b.r2"]
    # A key whose record names another deployment moves with it.
    table.set_replica(
        "b.r2",
        ReplicaRecord(deployment="orphan", replica="r2", profile="p", profile_fp="x", state="ready", url="u"),
    )
    assert [k for k, _ in table.of("b")] == ["b.r0", "b.r1"]
    assert [k for k, _ in table.of("orphan")] == ["b.r2", "orphan.r0", "orphan.r1", "orphan.r2"]
    # The last record of a deployment not in the bucket gone: no longer known.
    for key in ("b.r2", "orphan.r0", "orphan.r1", "orphan.r2"):
        table.set_replica(key, None)
    assert table.of("orphan") == []
    assert table.known() == ["a", "b"]
    assert table.resolve("orphan") is None
    # An alias changed in the bucket: resolved anew.
    table.set_deployment("b", Deployment(name="b", profile="p", aliases=("shared", "wasp")))
    assert (table.resolve("bee"), table.resolve("wasp"), table.resolve("shared")) == (None, "b", "a")
    table.set_deployment("a", None)
    assert table.resolve("shared") == "b"
    assert table.known() == ["a", "b"]  # a's records are still there
    for i in range(3):
        table.set_replica(f"a.r{i}", None)
    assert table.known() == ["b"]
