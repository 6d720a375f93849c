"""What a replica's engine is believed to hold in its prompt cache, as the gateways share it.

The value of `<deployment>.<replica>` in the routing bucket: the hashes of the prompt blocks
the gateways sent that replica lately, least recently routed first, as one gateway knows them
(its own routing and what it read of the others'). Every gateway writes it and reads it;
every value is outside bytes to the reader, bounded here before use: at most
MAX_HELD_BLOCKS hashes, a whole number of them.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal

from msgspec import Meta

from .events import Message
from .limits import Token

# The most block hashes one value holds (8 bytes each): 16,384 x 8 = 128 KiB, about 171 KiB
# base64'd in JSON, under the 1 MiB `max_value_bytes`; the gateways' `replica_blocks` cannot
# ask for more.
MAX_HELD_BLOCKS = 16384
BLOCK_BYTES = 8


class RoutingHeld(Message, frozen=True):
    """One replica's prompt blocks as gateway `gateway` knows them: `blocks`, 64-bit hashes
    packed little-endian, least recently routed first."""

    gateway: Token
    blocks: Annotated[bytes, Meta(max_length=MAX_HELD_BLOCKS * BLOCK_BYTES)] = b""
    at: float = 0.0
    # "engine": written by the replica's launcher from its engine's own KV events (`gateway`
    # then names the launcher): the blocks it holds, hashed by `token_block_hash` over
    # `block_tokens` token ids each, least recently stored first. It replaces what the
    # gateways routed there ("routed", hashes of prompt text).
    source: Literal["routed", "engine"] = "routed"
    block_tokens: Annotated[int, Meta(ge=0, le=1 << 16)] = 0

    def __post_init__(self) -> None:
        if len(self.blocks) % BLOCK_BYTES:
            raise ValueError(
                f"blocks holds {len(self.blocks)} bytes, not a whole number of {BLOCK_BYTES}-byte hashes"
            )

    def hashes(self) -> list[int]:
        """The block hashes, least recently routed first."""
        out = array("Q", self.blocks)
        if sys.byteorder != "little":
            out.byteswap()
        return out.tolist()


def pack(hashes: Iterable[int]) -> bytes:
    """Block hashes (each below 2**64) as `RoutingHeld.blocks` holds them."""
    out = array("Q", hashes)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def token_seed(deployment: str, adapter: str = "") -> int:
    """The chained hash before a prompt's first token block (`token_block_hash`), under LoRA
    adapter `adapter` of the deployment ("" for the base)."""
    seed = b"tokens\0" + prompt_seed(deployment, adapter)
    return zlib.crc32(seed) << 32 | zlib.adler32(seed)


def prompt_seed(deployment: str, adapter: str = "") -> bytes:
    """The bytes every prompt hash of `deployment` starts from, under LoRA adapter `adapter`
    ("" for the base): an engine keys a block computed under an adapter apart from the base's
    (vLLM hashes the LoRA name into it; llama.cpp applies the adapter to every token), so a
    request for one matched by the base's blocks went to a replica that held nothing of it.

    The base's is the name and a NUL, as before adapters were hashed: gateways of an older
    release share the routing state. An adapter's puts \1 where the base has its NUL, so no
    seed is a prefix of another's (names hold neither byte) and no prompt text after one seed
    can make it equal another's."""
    name = deployment.encode("utf-8", "surrogatepass")
    if not adapter:
        return name + b"\0"
    return name + b"\1" + adapter.encode("utf-8", "surrogatepass") + b"\0"


def token_block_hash(prev: int, token_ids: Sequence[int]) -> int:
    """The hash of a block of token ids (each below 2**32) following the blocks whose hash is
    `prev`: the CRC-32 and Adler-32 of every token before and in it, little-endian uint32s,
    carried on (as the gateways hash prompt text), the same in every process."""
    data = array("I", token_ids)
    if sys.byteorder != "little":
        data.byteswap()
    raw = data.tobytes()
    return zlib.crc32(raw, prev >> 32) << 32 | zlib.adler32(raw, prev & 0xFFFFFFFF)
