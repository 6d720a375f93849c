"""Routing on what the engines say they hold: the gateway asks a replica's engine for a request's
tokens, hashes their blocks as the launcher's relay hashes the blocks the engine stored, and
sends the request to the replica whose engine holds the deepest prefix, weighed against load.

Through the real path: sim engines started by the sim adapter's own command (the flags the vLLM
adapter passes, `--kv-events-config`), publishing vLLM's KV events over ZMQ to the launcher's
relay, which writes the routing bucket on a real NATS; two gateways in this process read it,
each answer read by its `x-llmgw-replica` and each span by its `llmgw.route`."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from llmgw_core.bus import Bus
from llmgw_core.engines import Sim
from llmgw_core.events import Deployment, Profile, ShardSpec
from llmgw_core.lifecycle import connect_service
from llmgw_core.sim._app import SimEngine, parse_args
from llmgw_core.sim._kv import BLOCK_TOKENS, KVCache, chat_ids
from llmgw_gateway import Gateway, GatewayConfig, Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.engine_tokens import TOKENIZE_ATTRIBUTE, tokenize_request
from llmgw_gateway.engine_view import (
    EngineHeld,
    TokenizeError,
    decode_tokens,
    engine_prompt,
    most_answer_bytes,
)
from llmgw_launcher.kv_events import EngineBlocks, decode
from llmgw_launcher.kv_relay import KVRelay
from tests.cluster_support import Cluster, cluster
from tests.test_gateway_api import _wait_healthy
from tests.test_gateway_hold import record
from tests.waiting import eventually

CHAT = "/v1/chat/completions"
# A customer's long context (about 400 words: 25 blocks of the sim's 16 tokens).
CONTEXT = "customer 7 file: " + "order shipped. " * 200


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{CONTEXT} {question}"}]


# --- plain data ------------------------------------------------------------------------------


class _Heard:
    """The sim cache's publisher, as the relay would hear it: each batch's frames."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []

    def publish(self, events: list[dict[str, Any]]) -> None:
        payload = msgspec.msgpack.encode([1.0, events, 0])
        self.frames.append([b"kv-events", len(self.frames).to_bytes(8, "big"), payload])


def test_a_prompts_blocks_hash_alike_in_the_gateway_and_in_the_relay_of_what_the_engine_stored() -> None:
    heard = _Heard()
    cache = KVCache(256, heard)  # type: ignore[arg-type]
    ids = chat_ids(messages("when?"))
    cache.store(ids)
    kept = EngineBlocks("chat")
    for frames in heard.frames:
        kept.apply(decode(frames))
    cut = engine_prompt("chat", ids, BLOCK_TOKENS, 128)
    assert len(cut.blocks) == len(ids) // BLOCK_TOKENS >= 20
    assert kept.hashes() == list(cut.blocks)
    # Another deployment's blocks are others: the seed is the deployment's.
    assert engine_prompt("other", ids, BLOCK_TOKENS, 128).blocks[0] != cut.blocks[0]
    # At most max_blocks hashed, whatever the prompt's length.
    assert len(engine_prompt("chat", ids, BLOCK_TOKENS, 3).blocks) == 3


def _table(*replicas: str) -> Table:
    table = Table(routing=RoutingConfig())
    for r in replicas:
        table.set_replica(f"chat.{r}", record(r, f"http://127.0.0.1:1/{r}"))
    return table


def test_the_replica_whose_engine_holds_the_prefix_takes_it_weighed_against_load() -> None:
    table = _table("r0", "r1")
    prompt = engine_prompt("chat", chat_ids(messages("when?")), BLOCK_TOKENS, 128)
    # r1's engine holds the first 20 blocks; r0's holds nothing.
    table.engine["chat.r1"] = EngineHeld(BLOCK_TOKENS, frozenset(prompt.blocks[:20]))
    table.engine["chat.r0"] = EngineHeld(BLOCK_TOKENS, frozenset())
    chosen = table.pick("chat", engine=prompt)
    assert chosen is not None
    assert chosen[0] == "chat.r1"
    assert table.reason == "prefix 20 blocks (engine)"
    # Busier than the match is worth (20 blocks of 16 tokens: 5 text blocks, worth one request
    # more): the least busy takes it.
    table.outstanding["chat.r1"] = 2
    chosen = table.pick("chat", engine=prompt)
    assert chosen is not None
    assert chosen[0] == "chat.r0"
    table.outstanding["chat.r1"] = 0
    # An engine of another block size cut the tokens otherwise: no match.
    table.engine["chat.r1"] = EngineHeld(32, frozenset(prompt.blocks))
    table.pick("chat", engine=prompt)
    assert "(engine)" not in table.reason
    # Held by both: it tells nothing.
    table.engine["chat.r0"] = table.engine["chat.r1"] = EngineHeld(BLOCK_TOKENS, frozenset(prompt.blocks))
    table.pick("chat", engine=prompt)
    assert table.reason == "least outstanding"
    # A match shorter than min_match_blocks (in text blocks: 12 of 16 tokens is 3) is none.
    table.engine["chat.r0"] = EngineHeld(BLOCK_TOKENS, frozenset())
    table.engine["chat.r1"] = EngineHeld(BLOCK_TOKENS, frozenset(prompt.blocks[:12]))
    table.pick("chat", engine=prompt)
    assert "(engine)" not in table.reason


def test_the_tokenize_request_is_vllms_for_chat_and_completions() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "temperature": 0}
    assert tokenize_request(chat, CHAT, "m") == {"messages": chat["messages"], "tools": [], "model": "m"}
    continued = {**chat, "continue_final_message": True}
    asked = tokenize_request(continued, CHAT, None)
    assert asked is not None
    assert asked["add_generation_prompt"] is False
    assert tokenize_request({"prompt": "hi"}, "/v1/completions", "m") == {"prompt": "hi", "model": "m"}
    # Several prompts, token ids, no chat, another path: not tokenized.
    assert tokenize_request({"prompt": ["a", "b"]}, "/v1/completions", "m") is None
    assert tokenize_request({"messages": []}, CHAT, "m") is None
    assert tokenize_request({"input": "hi"}, "/v1/responses", "m") is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=4096),
        st.builds(
            lambda ids, extra: msgspec.json.encode({"count": len(ids), "tokens": ids, **extra}),
            st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=300),
            st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
        ),
    ),
    st.integers(min_value=0, max_value=64),
)
def test_a_tokenize_answer_decodes_within_bounds_or_is_refused_by_name(
    raw: bytes, request_bytes: int
) -> None:
    """The answer is the engine's bytes: ids each below 2**32, at most the request's bytes plus
    a template's, or TokenizeError; nothing else escapes."""
    try:
        ids = decode_tokens(raw, request_bytes)
    except TokenizeError:
        return
    assert len(raw) <= most_answer_bytes(request_bytes)
    assert all(0 <= i < 2**32 for i in ids)


def test_an_answer_of_too_many_tokens_for_its_request_is_refused() -> None:
    with pytest.raises(TokenizeError, match="token ids for a request of 10 bytes"):
        decode_tokens(msgspec.json.encode({"tokens": [1] * 5000}), 10)
    with pytest.raises(TokenizeError, match="bytes, over"):
        decode_tokens(b" " * (most_answer_bytes(10) + 1), 10)


def test_the_sim_tokenizes_as_it_caches_and_a_reset_empties_its_cache() -> None:
    engine = SimEngine(parse_args(["--model", "tiny"]))
    with TestClient(engine.app()) as sim:
        chat = {"model": "tiny", "messages": messages("when?")}
        r = sim.post("/tokenize", json=chat)
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids == chat_ids(messages("when?")) == decode_tokens(r.content, len(msgspec.json.encode(chat)))
        assert r.json()["count"] == len(ids)
        # Without the generation prompt: one token less (the template's `<|assistant|>`).
        bare = sim.post("/tokenize", json={**chat, "add_generation_prompt": False}).json()["tokens"]
        assert bare == ids[:-1]
        # A completion's prompt is led by BOS, as vLLM's tokenizer adds its special tokens.
        assert sim.post("/tokenize", json={"prompt": "a b"}).json()["tokens"][0] == 1
        assert sim.post("/tokenize", json={"input": "a"}).status_code == 400
        # Answering the chat caches its whole blocks, the ones /tokenize gave.
        assert sim.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).status_code == 200
        assert len(engine.kv.cache.blocks) == len(ids) // BLOCK_TOKENS
        assert sim.post("/reset_prefix_cache").status_code == 200
        assert not engine.kv.cache.blocks


# --- the real path -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shard(replica: str, *args: str) -> ShardSpec:
    profile = Profile(name="tiny", engine="sim", served_model_name="tiny", kv_events=True, args=args)
    return ShardSpec(
        replica=replica,
        shard=f"chat-{replica}-0",
        node="n1",
        profile=profile,
        deployment="chat",
        host="127.0.0.1",
        port=free_port(),
        extra_ports=(free_port(),),
    )


@contextlib.contextmanager
def sims(specs: list[ShardSpec]) -> Iterator[list[str]]:
    """Each shard's sim, started by the sim adapter's own command; their URLs."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for spec in specs:
            [command] = Sim().commands(spec)
            assert "--kv-events-config" in command.args
            procs.append(
                subprocess.Popen(
                    [command.path, *command.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        urls = [f"http://127.0.0.1:{spec.port}" for spec in specs]
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.asynccontextmanager
async def traced_gateway(c: Cluster, id: str) -> AsyncIterator[tuple[str, Gateway, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    full = {
        "id": id,
        "nats": c.nats("gateway"),
        "http": {"port": 0, "require_api_key": False},
        "routing": {"share_interval_s": 0.05},
    }
    config = msgspec.convert(full, GatewayConfig)
    bus = await connect_service(config.nats, "gateway", ensure=False)
    async with bus, anyio.create_task_group() as tg:
        gw = Gateway(config, bus, tracer=provider.get_tracer("test"))
        port = await tg.start(gw.run)
        try:
            yield f"http://127.0.0.1:{port}", gw, spans
        finally:
            tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def engines(bus: Bus, tmp_path: Path, nats_url: str, prefix: str, *args: str) -> AsyncIterator[Cluster]:
    """Deployment `chat`: two sim replicas r0 and r1 whose KV events the launcher relays."""
    specs = [shard("r0", *args), shard("r1", *args)]
    relay = KVRelay(bus, "launcher-n1", lambda: {s.shard: s for s in specs}, interval_s=0.05)
    with cluster(tmp_path, nats_url, prefix) as c:
        async with anyio.create_task_group() as tg:
            await tg.start(relay.run)
            with sims(specs) as urls:
                await bus.put(
                    bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny", replicas=2)
                )
                for spec, url in zip(specs, urls, strict=True):
                    await bus.put(
                        bus.names.replicas_bucket, f"chat.{spec.replica}", record(spec.replica, url)
                    )
                yield c
            tg.cancel_scope.cancel()


async def ask(client: httpx.AsyncClient, url: str, question: str) -> tuple[str, float]:
    """Where one question of the customer's conversation was served (`chat.r1`), and in how long."""
    began = time.monotonic()
    body = {"model": "chat", "messages": messages(question), "max_tokens": 1}
    r = await client.post(f"{url}{CHAT}", json=body)
    assert r.status_code == 200, r.text
    deployment, _, replica = r.headers["x-llmgw-replica"].partition("/")
    return f"{deployment}.{replica}", time.monotonic() - began


async def nth_span(spans: InMemorySpanExporter, n: int) -> dict[str, Any]:
    """The attributes of the `n`th routed request's span (from 1), once it ended."""

    async def ended() -> dict[str, Any]:
        routed = [dict(s.attributes or {}) for s in spans.get_finished_spans()]
        routed = [a for a in routed if "llmgw.route" in a]
        assert len(routed) >= n, f"{len(routed)} routed spans ended, not {n} yet"
        return routed[n - 1]

    return await eventually(ended, timeout=5)


def holds(gateways: list[Gateway], key: str, blocks: int) -> bool:
    for gw in gateways:
        held = gw.table.engine.get(key)
        assert held is not None, f"{gw.id} has no view of {key}"
        assert len(held.blocks) >= blocks, (gw.id, len(held.blocks))
    return True


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_shared_prefix_goes_where_the_engine_holds_it_through_either_gateway_until_it_clears(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with (
        engines(bus, tmp_path, nats_url, prefix) as c,
        traced_gateway(c, "gw-a") as (a, gw_a, spans_a),
        traced_gateway(c, "gw-b") as (b, gw_b, spans_b),
        httpx.AsyncClient(timeout=30) as client,
    ):
        # No engine has said anything yet: the first question is placed as any new prefix.
        first, _ = await ask(client, a, "where is my parcel?")
        # Its engine cached the prompt's 25 whole blocks; the relay says so to both gateways.
        await eventually(lambda: holds([gw_a, gw_b], first, 25), timeout=15, interval=0.05)
        for url, spans, n in ((b, spans_b, 1), (a, spans_a, 2), (b, spans_b, 2)):
            served, _ = await ask(client, url, "and when will it come?")
            assert served == first
            span = await nth_span(spans, n)
            assert span["llmgw.route"] == "prefix 25 blocks (engine)", span
            assert span[TOKENIZE_ATTRIBUTE].endswith(f"tokens from {first}"), span
        # The engine's cache reset: it says so (AllBlocksCleared), and the next question goes by
        # the text index back where the customer was asked before (and is computed again where
        # it will be asked for again), no engine holding it.
        async with httpx.AsyncClient(base_url=str(gw_a.table.replicas[first].url)) as engine:
            assert (await engine.post("/reset_prefix_cache")).status_code == 200

        def cleared() -> bool:
            assert all(not gw.table.engine[first].blocks for gw in (gw_a, gw_b))
            return True

        await eventually(cleared, timeout=15, interval=0.05)
        served, _ = await ask(client, b, "is it lost?")
        assert served == first
        route = (await nth_span(spans_b, 3))["llmgw.route"]
        assert route.startswith("prefix "), route
        assert "(engine)" not in route, route


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_engine_slow_to_tokenize_costs_its_requests_the_match_not_the_answer(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with (
        engines(bus, tmp_path, nats_url, prefix, "--tokenize-delay", "5") as c,
        traced_gateway(c, "gw-a") as (a, gw_a, spans),
        httpx.AsyncClient(timeout=30) as client,
    ):
        first, _ = await ask(client, a, "where is my parcel?")
        await eventually(lambda: holds([gw_a], first, 25), timeout=15, interval=0.05)
        served, took = await ask(client, a, "and when will it come?")
        # Within the tokenize timeout (0.5 s), not the engine's 5 s: by the gateway's own index.
        assert took < 4, took
        assert served == first
        span = await nth_span(spans, 2)
        assert "did not answer within 0.5s: routed by the text index" in span[TOKENIZE_ATTRIBUTE], span
        assert span["llmgw.route"].startswith("prefix "), span
        assert "(engine)" not in span["llmgw.route"], span
