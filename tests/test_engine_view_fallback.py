"""Routing beside what engines say they hold: where no engine holds the prompt, the text index of
what was routed where decides, as without views: a repeat the engine has not said it stored yet
follows its first, and one whose context the engine evicted goes back where it was asked before,
not to the least busy (which spread a conversation over every replica's cache: vLLM counted 45%
of prompt tokens from cache against the text index's 64%, `python -m bench.routing_vllm`)."""

from __future__ import annotations

import time

from llmgw_core.events import ReplicaRecord
from llmgw_core.prefixes import RoutingHeld, pack
from llmgw_gateway import Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.engine_view import EngineHeld, engine_prompt
from llmgw_gateway.prefix_share import Sharing
from llmgw_gateway.routing import prompt_blocks

COMPLETIONS = "/v1/completions"
BLOCK_TOKENS = 16
PAYLOAD = {"model": "chat", "prompt": "a customer's long context. " * 80, "max_tokens": 1}
# The prompt as an engine cuts it: 2,160 bytes at 4 bytes a token.
IDS = list(range(1000, 1540))


def table() -> Table:
    t = Table(routing=RoutingConfig())
    for r in ("r0", "r1"):
        record = ReplicaRecord(
            deployment="chat", replica=r, profile="tiny", profile_fp="x", state="ready", url=f"http://{r}"
        )
        t.set_replica(f"chat.{r}", record)
        t.engine[f"chat.{r}"] = EngineHeld(BLOCK_TOKENS, frozenset())
    return t


def said(sharing: Sharing, key: str, *blocks: int) -> None:
    """Replica `key`'s engine says it holds `blocks`, as its launcher's relay writes it."""
    value = RoutingHeld(
        gateway="launcher-n1", blocks=pack(blocks), at=time.time(), source="engine", block_tokens=BLOCK_TOKENS
    )
    sharing.learn(key, value)


def test_a_repeat_before_the_engines_next_word_follows_its_first() -> None:
    t = table()
    sharing = Sharing(t, writer="gw-a")
    blocks = prompt_blocks(t.routing, "chat", COMPLETIONS, PAYLOAD)
    prompt = engine_prompt("chat", IDS, BLOCK_TOKENS, t.routing.max_blocks, prompt_bytes=2160)
    first = t.pick("chat", blocks=blocks, engine=prompt)
    assert first is not None
    assert t.reason == "new prefix"
    # The engine has not said it stored the prompt yet; the first request is still in flight.
    t.outstanding[first[0]] = 1
    again = t.pick("chat", blocks=blocks, engine=prompt)
    assert again == first
    assert t.reason.startswith("prefix "), t.reason
    assert "(engine)" not in t.reason
    # Its engine's word replaces the guess: it says it holds the prompt, matched as such.
    said(sharing, first[0], *prompt.blocks)
    t.outstanding[first[0]] = 0
    assert t.pick("chat", blocks=blocks, engine=prompt) == first
    assert t.reason == f"prefix {len(prompt.blocks)} blocks (engine)"


def test_a_prompt_the_engine_evicted_goes_back_where_it_was_asked_not_to_the_least_busy() -> None:
    t = table()
    sharing = Sharing(t, writer="gw-a")
    blocks = prompt_blocks(t.routing, "chat", COMPLETIONS, PAYLOAD)
    prompt = engine_prompt("chat", IDS, BLOCK_TOKENS, t.routing.max_blocks, prompt_bytes=2160)
    first = t.pick("chat", blocks=blocks, engine=prompt)
    assert first is not None
    other = next(k for k in t.replicas if k != first[0])
    # The engines speak: neither holds the prompt (the first evicted it for other customers').
    said(sharing, first[0])
    said(sharing, other)
    # One more in flight there: the customer still goes back, where its next repeat will hit.
    t.outstanding[first[0]] = 1
    assert t.pick("chat", blocks=blocks, engine=prompt) == first
    assert t.reason == f"prefix {len(blocks)} blocks", t.reason
