"""What a replica's engine says it holds, and a prompt cut as that engine cuts it: pure.

A replica whose launcher relays its engine's KV events (a profile's `kv_events`) has its
cache in the routing bucket as `source: engine`: llmgw's chained hash of each block of token
ids the engine stored (`prefixes.token_block_hash`, `block_tokens` ids a block). A gateway
that has the request's token ids, as the engine's own tokenizer and chat template make them
(`engine_tokens.py`: the engine's `/tokenize`), hashes their whole blocks the same way and
reads, per replica, how many of the prompt's leading blocks its engine holds: an exact
match, not the guess of what was sent there.

A match's depth is weighed against load by `weigh.py`'s rule as a text match is, in the text
index's units: an engine block of `block_tokens` tokens counts as `block_tokens x
bytes_per_token / block_bytes` text blocks, so `min_match_blocks` and `match_per_load` mean
the same length of prompt whichever index matched it. `bytes_per_token` is the request's
own: its prompt's bytes as the text index reads them over the token ids `/tokenize` answered
(`measured_bytes_per_token`, within MIN_BYTES_PER_TOKEN..MAX_BYTES_PER_TOKEN). One assumed
figure (4 bytes a token, about English prose's) made a match of code or of a language whose
tokens are a byte or two weigh twice to four times what it is, and one of long-token text
less. BYTES_PER_TOKEN stands in only where nothing was measured.

The `/tokenize` answer is another process's bytes: `decode_tokens` bounds it (its size
against the request's, every id below 2**32) and raises `TokenizeError`, its only error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from llmgw_core.prefixes import token_block_hash, token_seed

# Bytes of prompt text a token stands for, on average, to weigh an engine match in the text
# index's blocks, where the request's own were not measured.
BYTES_PER_TOKEN = 4
# The bounds of a request's measured bytes a token. Below one: a chat template's own tokens
# (roles, special tokens, a tool list rendered) outnumber a short prompt's bytes, and its
# match would weigh less than the text it holds. Above sixteen: no tokenizer's tokens average
# that over a prompt (its longest merges are runs of spaces or indentation); so few ids for so
# many bytes is an engine answering wrong, and would make a shallow match weigh as the whole
# prompt and pull requests onto a busy replica.
MIN_BYTES_PER_TOKEN = 1.0
MAX_BYTES_PER_TOKEN = 16.0
# Tokens a chat template may add beyond one a byte of the request (roles, special tokens, a
# tool list rendered): a `/tokenize` answer of more ids than the request's bytes plus this is
# refused, whatever the engine.
TEMPLATE_TOKENS = 4096
# The most bytes of one id in the answer (`4294967295,` and a space): bounds the answer's read.
ID_BYTES = 12
# The answer's fixed fields (`count`, `max_model_len`, `token_strs`), generously.
ANSWER_SLACK = 4096

TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]


class TokenizeError(ValueError):
    """A `/tokenize` answer refused: what was wrong with it."""


class _Tokenized(Struct):
    """vLLM's `TokenizeResponse`, the part read (other fields ignored)."""

    tokens: list[TokenId]


_DECODER = msgspec.json.Decoder(_Tokenized)


@dataclass(frozen=True, slots=True)
class EngineHeld:
    """One replica's cache as its engine said: its block size and the blocks' hashes."""

    block_tokens: int
    blocks: frozenset[int]


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """A request's prompt as the engines of block size `block_tokens` cut it: the chained
    hashes of its whole leading blocks, and the bytes of its prompt text a token stands for."""

    block_tokens: int
    blocks: tuple[int, ...]
    bytes_per_token: float = BYTES_PER_TOKEN


def most_tokens(request_bytes: int) -> int:
    """The most token ids a `/tokenize` answer for a request of `request_bytes` may hold."""
    return request_bytes + TEMPLATE_TOKENS


def most_answer_bytes(request_bytes: int) -> int:
    """The most bytes of a `/tokenize` answer read for a request of `request_bytes`."""
    return most_tokens(request_bytes) * ID_BYTES + ANSWER_SLACK


def decode_tokens(raw: bytes, request_bytes: int) -> list[int]:
    """The token ids of a `/tokenize` answer (`{"tokens": [...], ...}`), each below 2**32, at
    most `most_tokens(request_bytes)`; TokenizeError for any other answer."""
    if len(raw) > most_answer_bytes(request_bytes):
        raise TokenizeError(f"the answer is {len(raw)} bytes, over {most_answer_bytes(request_bytes)}")
    try:
        ids = _DECODER.decode(raw).tokens
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise TokenizeError(f"the answer is not a tokenize answer: {exc}") from exc
    if len(ids) > most_tokens(request_bytes):
        raise TokenizeError(
            f"the answer holds {len(ids)} token ids for a request of {request_bytes} bytes "
            f"(at most {most_tokens(request_bytes)})"
        )
    return ids


def measured_bytes_per_token(prompt_bytes: int, tokens: int) -> float:
    """The bytes of prompt text a token of this request stands for: `prompt_bytes` (its prompt
    as the text index reads it) over the `tokens` ids `/tokenize` answered for it, within
    MIN_BYTES_PER_TOKEN..MAX_BYTES_PER_TOKEN; BYTES_PER_TOKEN where either is none."""
    if prompt_bytes <= 0 or tokens <= 0:
        return BYTES_PER_TOKEN
    return min(max(prompt_bytes / tokens, MIN_BYTES_PER_TOKEN), MAX_BYTES_PER_TOKEN)


def engine_prompt(
    deployment: str,
    ids: Sequence[int],
    block_tokens: int,
    max_blocks: int,
    adapter: str = "",
    *,
    prompt_bytes: int = 0,
) -> EnginePrompt:
    """The chained hashes of the first `max_blocks` whole blocks of `ids`, as the launcher's
    relay hashes the blocks the engine stored (`kv_events.EngineBlocks`), under LoRA `adapter`;
    weighed at `prompt_bytes` (the prompt's, as the text index reads it) over the ids."""
    prev = token_seed(deployment, adapter)
    blocks = []
    for start in range(0, min(len(ids) // block_tokens, max_blocks) * block_tokens, block_tokens):
        prev = token_block_hash(prev, ids[start : start + block_tokens])
        blocks.append(prev)
    return EnginePrompt(block_tokens, tuple(blocks), measured_bytes_per_token(prompt_bytes, len(ids)))


def held_depth(prompt: EnginePrompt, held: EngineHeld) -> int:
    """How many of the prompt's leading blocks the engine holds (0 where its block size is
    another: its blocks are other cuts of the tokens)."""
    if held.block_tokens != prompt.block_tokens:
        return 0
    n = 0
    for block in prompt.blocks:
        if block not in held.blocks:
            break
        n += 1
    return n


def as_text_blocks(
    blocks: int, block_tokens: int, block_bytes: int, bytes_per_token: float = BYTES_PER_TOKEN
) -> float:
    """An engine match of `blocks` blocks in the text index's blocks, a token standing for
    `bytes_per_token` bytes of prompt text (the request's own, `EnginePrompt.bytes_per_token`)."""
    return blocks * block_tokens * bytes_per_token / block_bytes
