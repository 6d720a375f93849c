"""A LoRA adapter is part of a prompt's prefix: an engine caches a prompt under an adapter apart
from the base's (vLLM keys its block hashes with the LoRA name), so the gateways' prompt hashes,
the launcher's hashes of an engine's KV events and the gateway's hashes of a request's tokens
are all seeded by the adapter a request names, and a request naming none hashes as before."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.adapters import ServedAdapter
from llmgw_core.events import ShardStatus
from llmgw_core.prefixes import prompt_seed, token_block_hash, token_seed
from llmgw_core.sim._kv import BLOCK_TOKENS, KVCache, chat_ids
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.engine_view import engine_prompt
from llmgw_gateway.routing import _prompt_text, lead_hash, prompt_blocks
from llmgw_launcher.kv_events import EngineBlocks, KVEventError, decode
from tests.adapters_support import write_peft_lora
from tests.gateway_support import proxy_over
from tests.test_gateway_api import sim_engines

CHAT = "/v1/chat/completions"
# What msgpack holds of an integer.
INT64 = st.integers(-(2**63), 2**63 - 1)


def body(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


LONG = "the quarterly filing says " * 120


def _before(routing: RoutingConfig, deployment: str, payload: dict[str, Any]) -> tuple[int, ...]:
    """`prompt_blocks` as the release before adapters were hashed wrote it."""
    size = routing.block_bytes
    text = _prompt_text(payload, size * routing.max_blocks)
    lead = routing.min_match_blocks * size
    seed = deployment.encode() + b"\0"
    crc, adler = zlib.crc32(seed), zlib.adler32(seed)
    out = []
    for start in range(0, len(text) - size + 1, size):
        block = text[start : start + size]
        crc, adler = zlib.crc32(block, crc), zlib.adler32(block, adler)
        if start + size == lead:
            h = hashlib.blake2b(deployment.encode(), digest_size=8)
            h.update(b"\0")
            h.update(text[:lead])
            out.append(int.from_bytes(h.digest(), "little"))
        else:
            out.append(crc << 32 | adler)
    return tuple(out)


def test_a_request_naming_no_adapter_hashes_as_before_adapters_counted() -> None:
    """Gateways of the previous release share the routing state (and launchers of it the
    engines' views): a request naming no adapter hashes as they hash it, byte for byte."""
    routing = RoutingConfig()
    payload = body("chat", LONG)
    blocks = prompt_blocks(routing, "chat", CHAT, payload)
    assert len(blocks) > routing.min_match_blocks
    assert blocks == _before(routing, "chat", payload)
    old = b"tokens\0chat\0"
    assert token_seed("chat") == zlib.crc32(old) << 32 | zlib.adler32(old)


def test_an_adapter_seeds_every_hash_apart_from_its_base_and_from_other_adapters() -> None:
    routing = RoutingConfig()
    base = prompt_blocks(routing, "chat", CHAT, body("chat", LONG))
    legal = prompt_blocks(routing, "chat", CHAT, body("legal", LONG), "legal")
    finance = prompt_blocks(routing, "chat", CHAT, body("finance", LONG), "finance")
    assert len(base) == len(legal) == len(finance)
    assert not set(base) & set(legal)
    assert not set(legal) & set(finance)
    # The body's `model` is no part of the prompt: the adapter named is.
    assert prompt_blocks(routing, "chat", CHAT, body("chat", LONG), "legal") == legal
    assert lead_hash("chat", b"x", "legal") not in (lead_hash("chat", b"x"), lead_hash("chat", b"x", "tax"))
    assert token_seed("chat", "legal") not in (token_seed("chat"), token_seed("chat", "tax"))


@settings(max_examples=200, deadline=None)
@given(
    st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_-]{0,12}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_-]{0,12}", fullmatch=True),
    st.binary(max_size=16),
)
def test_no_seed_followed_by_any_text_is_another_seed(
    d1: str, a1: str, d2: str, a2: str, text: bytes
) -> None:
    """A prompt cannot be written to hash as another adapter's: no seed is a prefix of another
    seed, so no text after one makes it the other (crafted text in the base request included)."""
    if (d1, a1) == (d2, a2):
        return
    one, other = prompt_seed(d1, a1), prompt_seed(d2, a2)
    assert one + text != other
    assert not other.startswith(one)


def _events(cache_events: list[list[dict[str, Any]]], seq: int = 0) -> list[bytes]:
    events = [e for batch in cache_events for e in batch]
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])]


class _Captured:
    """The sim's publisher seam: the events it would send, kept."""

    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def publish(self, events: list[dict[str, Any]]) -> None:
        self.batches.append(events)


def test_an_engines_blocks_under_an_adapter_match_that_adapters_requests_only() -> None:
    """The sim stores a prompt under a loaded adapter as vLLM does (`lora_name`, and the name
    first in each block's extra keys); the launcher keeps those blocks chained from the
    adapter's seed, and the gateway's hash of the same tokens for that adapter finds them."""
    ids = chat_ids([{"role": "user", "content": LONG}])
    captured = _Captured()
    cache = KVCache(1024, captured)  # type: ignore[arg-type]
    cache.store(ids, "legal")
    [stored] = captured.batches[0]
    assert stored["lora_name"] == "legal"
    assert stored["extra_keys"] == [["legal"]] * len(stored["block_hashes"])
    held = EngineBlocks("chat")
    assert held.apply(decode(_events(captured.batches)))
    assert held.dropped == {}
    n = len(ids) // BLOCK_TOKENS
    assert held.hashes() == list(engine_prompt("chat", ids, BLOCK_TOKENS, n, "legal").blocks)
    assert not set(held.hashes()) & set(engine_prompt("chat", ids, BLOCK_TOKENS, n).blocks)
    # The base's blocks of the same prompt: cached apart, and matched by base requests.
    cache.store(ids)
    assert held.apply(decode(_events(captured.batches[1:], seq=1)))
    assert held.hashes()[n:] == list(engine_prompt("chat", ids, BLOCK_TOKENS, n).blocks)


@pytest.mark.parametrize(
    ("lora", "extra", "dropped"),
    [
        # A name no adapter can have (llmgw's name rule): its event alone.
        ("a.b", None, "malformed"),
        ("x" * 64, None, "malformed"),
        # Extra keys beyond the LoRA's name (an image, a cache salt): not named by tokens.
        ("legal", [["legal", "salt"]], "keyed"),
        ("legal", [["tax"]], "keyed"),
        (None, [["legal"]], "keyed"),
    ],
)
def test_a_lora_block_past_the_rules_drops_its_event_alone(
    lora: str | None, extra: list[list[str]] | None, dropped: str
) -> None:
    held = EngineBlocks("chat")
    event = {
        "type": "BlockStored",
        "block_hashes": [b"a"],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_name": lora,
        "extra_keys": extra,
    }
    good = {**event, "block_hashes": [b"b"], "lora_name": None, "extra_keys": None}
    held.apply(decode([b"kv", bytes(8), msgspec.msgpack.encode([1.0, [event, good], 0])]))
    assert held.dropped == {dropped: 1}
    assert held.hashes() == [token_block_hash(token_seed("chat"), [1, 2, 3, 4])]


@settings(max_examples=100, deadline=None)
@given(
    lora=st.one_of(st.none(), st.text(max_size=80)),
    extra=st.one_of(
        st.none(),
        st.lists(st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=8), INT64), max_size=3))),
    ),
)
def test_any_lora_name_and_extra_keys_are_kept_or_dropped_never_raised(lora: Any, extra: Any) -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [b"a"],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_name": lora,
        "extra_keys": extra,
    }
    held = EngineBlocks("chat")
    try:
        message = decode([b"kv", bytes(8), msgspec.msgpack.encode([1.0, [event], 0])])
    except KVEventError:
        return
    held.apply(message)
    assert len(held.hashes()) + sum(held.dropped.values()) == 1


def _statuses(adapter: str) -> list[tuple[str, ShardStatus]]:
    return [
        (
            f"n{i}.chat-r{i}-0",
            ShardStatus(
                node=f"n{i}",
                shard=f"chat-r{i}-0",
                replica=f"r{i}",
                deployment="chat",
                state="ready",
                adapters=(ServedAdapter(name=adapter),),
                adapters_loadable=(adapter,),
            ),
        )
        for i in range(2)
    ]


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_an_adapter_request_is_not_routed_by_the_bases_cached_prefix_but_by_its_own(
    tmp_path: Path,
) -> None:
    """Through the gateway over two sim replicas that both hold adapter `legal`: a base
    request's long prompt goes to one replica; the same prompt for `legal` is a new prefix
    there (cached apart by the engine), so it goes to the other (the one sent fewer blocks);
    `legal` again goes where `legal` went, the base again where the base went."""
    write_peft_lora(tmp_path / "legal")
    with sim_engines(["--max-loras", "2"], ["--max-loras", "2"]) as urls:
        async with httpx.AsyncClient(timeout=30) as raw:
            for url in urls:
                load = {"lora_name": "legal", "lora_path": str(tmp_path / "legal")}
                assert (await raw.post(f"{url}/v1/load_lora_adapter", json=load)).status_code == 200
        async with proxy_over(urls) as gw:
            for key, status in _statuses("legal"):
                gw.table.set_shard_status(key, status)

            async def served(model: str) -> str:
                r = await gw.client.post(f"{gw.url}{CHAT}", content=json.dumps(body(model, LONG)))
                assert r.status_code == 200, r.text
                return r.headers["x-llmgw-replica"]

            base = await served("chat")
            legal = await served("legal")
            assert legal != base
            assert await served("legal") == legal
            assert await served("chat") == base
