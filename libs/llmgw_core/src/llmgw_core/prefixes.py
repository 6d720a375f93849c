"""What a replica's engine is believed to hold in its prompt cache, as the gateways share it.

The value of `<deployment>.<replica>` in the routing bucket: the hashes of the prompt blocks
the gateways sent that replica lately, least recently routed first, as one gateway knows them
(its own routing and what it read of the others'). Every gateway writes it and reads it;
every value is outside bytes to the reader, bounded here before use: at most
MAX_HELD_BLOCKS hashes, a whole number of them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Annotated

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
