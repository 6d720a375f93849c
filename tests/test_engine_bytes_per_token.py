"""An engine match weighed in the request's own bytes a token: the gateway asks a replica's
`/tokenize` for the prompt's ids (over an HTTP transport that answers as an engine whose tokens
are 1 or 8 bytes of this prompt), and the depth its engine holds counts, against
`min_match_blocks` and load, as the length of prompt text it stands for."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace

from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import ApiKey
from llmgw_gateway import Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.engine_tokens import EngineTokens
from llmgw_gateway.engine_view import (
    BYTES_PER_TOKEN,
    MAX_BYTES_PER_TOKEN,
    MIN_BYTES_PER_TOKEN,
    EngineHeld,
    EnginePrompt,
    as_text_blocks,
    engine_prompt,
    measured_bytes_per_token,
)
from llmgw_gateway.names import ServedNames
from llmgw_gateway.routed import Routed
from llmgw_gateway.routing import prompt_text_bytes

COMPLETIONS = "/v1/completions"
BLOCK_TOKENS = 16
# 1,279 bytes and the text index's closing NUL: 1,280 bytes of prompt as the text index reads it.
TEXT = "x" * 1279


def engine(bytes_per_token: int) -> httpx.MockTransport:
    """An engine whose `/tokenize` cuts TEXT into tokens of `bytes_per_token` bytes each."""
    ids = list(range(100, 100 + 1280 // bytes_per_token))

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        assert request.url.path == "/tokenize", request.url
        assert json.loads(request.content)["prompt"] == TEXT
        return httpx.Response(200, json={"count": len(ids), "tokens": ids, "max_model_len": 4096})

    return httpx.MockTransport(answer)


def table() -> Table:
    t = Table(routing=RoutingConfig())
    for r in ("r0", "r1"):
        record = ReplicaRecord(
            deployment="chat", replica=r, profile="tiny", profile_fp="x", state="ready", url=f"http://{r}"
        )
        t.set_replica(f"chat.{r}", record)
        t.engine[f"chat.{r}"] = EngineHeld(BLOCK_TOKENS, frozenset())
    return t


def routed(payload: dict[str, Any]) -> Routed:
    body = json.dumps(payload).encode()
    key = ApiKey(name="k", hash="0" * 64)
    # The tokenize step reads the payload, body, deployment, span and adapter alone.
    return Routed(payload, body, "chat", "chat", key, trace.INVALID_SPAN, time.time(), [], (), None)  # type: ignore[arg-type]


async def tokenized(t: Table, bytes_per_token: int) -> EnginePrompt:
    async with httpx.AsyncClient(transport=engine(bytes_per_token)) as client:
        prompt = await EngineTokens(client, t, ServedNames(client)).prompt(
            routed({"model": "chat", "prompt": TEXT, "max_tokens": 1}), COMPLETIONS
        )
    assert prompt is not None
    return prompt


def holds(t: Table, prompt: EnginePrompt, blocks: int) -> None:
    """r1's engine holds the prompt's first `blocks` blocks."""
    t.engine["chat.r1"] = EngineHeld(BLOCK_TOKENS, frozenset(prompt.blocks[:blocks]))


@pytest.mark.anyio
async def test_a_prompt_of_8_bytes_a_token_weighs_its_engine_match_as_that_much_text() -> None:
    # Regression: every token was taken for 4 bytes, so 10 blocks of 16 tokens counted as 2.5
    # text blocks, under min_match_blocks (4), and the replica holding 1,280 bytes of the
    # prompt was passed over for the least busy.
    t = table()
    prompt = await tokenized(t, 8)
    assert prompt.bytes_per_token == 8.0
    assert len(prompt.blocks) == 10
    holds(t, prompt, 10)
    # 10 x 16 tokens x 8 bytes: 1,280 bytes, 5 text blocks of 256; worth one request more.
    assert as_text_blocks(10, BLOCK_TOKENS, 256, prompt.bytes_per_token) == 5.0
    t.outstanding["chat.r1"] = 1
    assert t.pick("chat", engine=prompt) == ("chat.r1", t.replicas["chat.r1"])
    assert t.reason == "prefix 10 blocks (engine)"
    # Two more than the least busy: 5 blocks are not worth 8 (match_per_load 4 x 2).
    t.outstanding["chat.r1"] = 2
    assert t.pick("chat", engine=prompt) == ("chat.r0", t.replicas["chat.r0"])
    assert t.reason == "least outstanding"


@pytest.mark.anyio
async def test_a_prompt_of_1_byte_a_token_needs_a_deeper_engine_match_to_count() -> None:
    # Regression: at an assumed 4 bytes a token, 20 blocks of 16 one-byte tokens (320 bytes,
    # a block and a quarter of text) counted as 5 text blocks: a match past min_match_blocks.
    t = table()
    prompt = await tokenized(t, 1)
    assert prompt.bytes_per_token == 1.0
    assert len(prompt.blocks) == 80
    holds(t, prompt, 20)
    assert t.pick("chat", engine=prompt) is not None
    assert t.reason == "least outstanding"
    # 64 blocks of 16 one-byte tokens are 1,024 bytes, 4 text blocks: a match, worth one
    # request more, not two.
    holds(t, prompt, 64)
    t.outstanding["chat.r1"] = 1
    assert t.pick("chat", engine=prompt) == ("chat.r1", t.replicas["chat.r1"])
    assert t.reason == "prefix 64 blocks (engine)"
    t.outstanding["chat.r1"] = 2
    assert t.pick("chat", engine=prompt) == ("chat.r0", t.replicas["chat.r0"])


def test_the_measure_is_the_prompts_bytes_over_its_tokens_within_its_bounds() -> None:
    assert measured_bytes_per_token(1280, 160) == 8.0
    assert measured_bytes_per_token(1280, 1280) == 1.0
    # A chat template's tokens outnumbering a short prompt's bytes: one a byte, not fewer.
    assert measured_bytes_per_token(10, 300) == MIN_BYTES_PER_TOKEN
    # One id for a long prompt (an engine answering wrong): sixteen, not the whole prompt.
    assert measured_bytes_per_token(100_000, 1) == MAX_BYTES_PER_TOKEN
    # Nothing measured: the assumed figure.
    assert measured_bytes_per_token(0, 50) == measured_bytes_per_token(50, 0) == BYTES_PER_TOKEN
    assert engine_prompt("chat", list(range(64)), BLOCK_TOKENS, 128).bytes_per_token == BYTES_PER_TOKEN
    assert engine_prompt("chat", list(range(64)), BLOCK_TOKENS, 128, prompt_bytes=320).bytes_per_token == 5.0
    # The prompt's bytes are those the text index reads: a chat's keys and values, each
    # followed by a NUL, the request's other fields left out.
    chat = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hello"}]}
    assert prompt_text_bytes(chat, 1000) == len(b"content\0hello\0role\0user\0")
    assert prompt_text_bytes(chat, 10) == 10


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=-(2**70), max_value=2**70), st.integers(min_value=-(2**70), max_value=2**70))
def test_any_measure_stays_within_its_bounds(prompt_bytes: int, tokens: int) -> None:
    measured = measured_bytes_per_token(prompt_bytes, tokens)
    assert MIN_BYTES_PER_TOKEN <= measured <= MAX_BYTES_PER_TOKEN


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["system", "instructions", "messages", "prompt", "input", "model", "tools"]), JSON
    ),
    st.integers(min_value=0, max_value=4096),
)
def test_a_prompts_bytes_are_counted_within_the_requests_size_whatever_its_json(
    payload: dict[str, Any], limit: int
) -> None:
    """The payload is a client's JSON: its prompt's bytes are counted up to `limit` (the
    request's size) whatever its shape, and nothing escapes."""
    assert 0 <= prompt_text_bytes(payload, limit) <= limit
