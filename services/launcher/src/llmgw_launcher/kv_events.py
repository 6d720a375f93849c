"""What a vLLM replica says its prompt cache holds: its KV events, decoded and kept.

vLLM started with `--kv-events-config` (`llmgw_core.engines.vllm`, a profile's `kv_events`)
publishes on a ZMQ PUB socket, one message of three frames per batch: the topic, an 8-byte
big-endian sequence number, and a msgpack `[ts, events, data_parallel_rank]` whose events are
maps tagged by `type`:

- `BlockStored`: `block_hashes` (the engine's own hash of each new block, bytes or int),
  `parent_block_hash` (the block before the first, None at a prompt's start), `token_ids`
  (`block_size` of them per block), `lora_name`, `extra_keys` (multimodal items, cache salt);
- `BlockRemoved`: `block_hashes` evicted;
- `AllBlocksCleared`: the whole cache reset.

Every message is outside bytes: `decode` bounds the frames, the batch, every list, every
hash and every token id before anything is kept, and raises `KVEventError` (the only error
it raises) for one it refuses; the relay drops and counts it and reads the next.

`EngineBlocks` is one replica's cache as its events say, pure: each stored block is keyed
by llmgw's own hash of its token ids, chained from the prompt's first block
(`llmgw_core.prefixes.token_block_hash`), the same hash a gateway computes from a prompt's
tokens. The engine's own hashes are not used: their algorithm is an engine option
(`--prefix-caching-hash-algo`; sha256 of CBOR by default, xxhash with a per-process random
seed otherwise) and their encoding a detail of each vLLM release. A block
whose parent is unknown (stored before the relay subscribed, or evicted from its memory) has
no known prefix and is dropped, as are blocks with extra keys (an image, a cache salt: the
tokens alone do not name them). A block stored under a LoRA adapter (`lora_name`, which vLLM
also puts first in each block's extra keys) is chained from the adapter's seed
(`token_seed(deployment, lora_name)`), as a gateway seeds a request for that adapter; a
`lora_name` no adapter can have (llmgw's name rule) drops its event alone.

Errors:

    KVEventError   a message refused (what, and where in it)
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from llmgw_core.limits import NAME_MAX
from llmgw_core.prefixes import MAX_HELD_BLOCKS, token_block_hash, token_seed

# One message (its payload frame) at most this long: a batch of a step's events for a few
# long prompts is tens of KiB. ZMQ's own MAXMSGSIZE is set to it too, so a larger frame
# never reaches the relay's memory.
MAX_MESSAGE_BYTES = 4 << 20
# Events in a batch, blocks in an event, tokens in an event, bytes of one engine hash.
MAX_EVENTS = 4096
MAX_BLOCKS = 4096
MAX_TOKENS = 1 << 20
MAX_HASH_BYTES = 64
MAX_BLOCK_SIZE = 4096
MAX_TOPIC_BYTES = 256

TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]
# An int hash: msgpack holds none beyond 64 bits (int64 or uint64), so it is bounded as read.
EngineHash = Annotated[bytes, Meta(max_length=MAX_HASH_BYTES)] | int
Short = Annotated[str, Meta(max_length=256)]


class KVEventError(Exception):
    """A KV event message refused: not vLLM's shape, or past a bound."""


class Event(Struct, tag_field="type", kw_only=True):
    """The base of vLLM's KV events (tagged by class name; unknown fields ignored)."""


class BlockStored(Event, tag="BlockStored", kw_only=True):
    block_hashes: Annotated[list[EngineHash], Meta(max_length=MAX_BLOCKS)]
    parent_block_hash: EngineHash | None = None
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_TOKENS)]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_name: Short | None = None
    extra_keys: Annotated[list[Any], Meta(max_length=MAX_BLOCKS)] | None = None
    medium: Short | None = None


class BlockRemoved(Event, tag="BlockRemoved", kw_only=True):
    block_hashes: Annotated[list[EngineHash], Meta(max_length=MAX_BLOCKS)]
    medium: Short | None = None


class AllBlocksCleared(Event, tag="AllBlocksCleared", kw_only=True):
    pass


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(Struct, array_like=True):
    ts: float
    events: Annotated[list[AnyEvent], Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(Batch)


@dataclass(frozen=True)
class Message:
    seq: int
    batch: Batch


def decode(frames: list[bytes]) -> Message:
    """One ZMQ message (topic, sequence, payload), checked whole before use."""
    if len(frames) != 3:
        raise KVEventError(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
    topic, seq, payload = frames
    if len(topic) > MAX_TOPIC_BYTES:
        raise KVEventError(f"topic of {len(topic)} bytes, at most {MAX_TOPIC_BYTES}")
    if len(seq) != 8:
        raise KVEventError(f"sequence of {len(seq)} bytes, not 8")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise KVEventError(f"payload of {len(payload)} bytes, at most {MAX_MESSAGE_BYTES}")
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        # msgspec lets a string that is not UTF-8 out as Python's own UnicodeDecodeError.
        raise KVEventError(f"payload: {exc}") from exc
    return Message(seq=int.from_bytes(seq, "big", signed=True), batch=batch)


@dataclass
class EngineBlocks:
    """One replica's cache as its KV events say: the engine's block hash -> llmgw's hash of
    the block's tokens (chained from its prompt's start), least recently stored first, at
    most `capacity` blocks (the oldest forgotten first, as a cache evicts)."""

    deployment: str
    capacity: int = MAX_HELD_BLOCKS
    blocks: OrderedDict[bytes | int, int] = field(default_factory=OrderedDict)
    # Blocks not kept, by why (`orphan`: parent unknown; `keyed`: extra keys beyond a LoRA's
    # name; `malformed`: token ids that are not whole blocks, or a LoRA name no adapter has).
    dropped: dict[str, int] = field(default_factory=dict)
    last_seq: int | None = None
    gaps: int = 0
    block_size: int = 0

    def apply(self, message: Message) -> bool:
        """The batch's events in order; whether what the replica holds changed."""
        changed = False
        if self.last_seq is not None and message.seq != self.last_seq + 1:
            if message.seq == 0:
                # The engine started again (its publisher counts from 0): its cache is empty.
                changed = bool(self.blocks)
                self.blocks.clear()
            else:
                # Missed batches: a block stored then is an orphan's parent, one removed is
                # kept until it is evicted from here by age. Counted, never fatal.
                self.gaps += 1
        self.last_seq = message.seq
        for event in message.batch.events:
            changed |= self._apply(event)
        return changed

    def _apply(self, event: AnyEvent) -> bool:
        if isinstance(event, AllBlocksCleared):
            had = bool(self.blocks)
            self.blocks.clear()
            return had
        if isinstance(event, BlockRemoved):
            before = len(self.blocks)
            for h in event.block_hashes:
                self.blocks.pop(h, None)
            return len(self.blocks) != before
        return self._store(event)

    def _store(self, event: BlockStored) -> bool:
        n = len(event.block_hashes)
        if len(event.token_ids) != n * event.block_size:
            # Not vLLM's shape (it stores whole blocks only): this event alone is dropped.
            self._drop("malformed", n)
            return False
        lora = event.lora_name or ""
        if lora and not _ADAPTER_NAME.fullmatch(lora):
            self._drop("malformed", n)
            return False
        if any(not lora_only(keys, lora) for keys in event.extra_keys or ()):
            self._drop("keyed", n)
            return False
        if event.parent_block_hash is None:
            prev = token_seed(self.deployment, lora)
        else:
            found = self.blocks.get(event.parent_block_hash)
            if found is None:
                self._drop("orphan", n)
                return False
            prev = found
        self.block_size = event.block_size
        size = event.block_size
        for i, h in enumerate(event.block_hashes):
            prev = token_block_hash(prev, event.token_ids[i * size : (i + 1) * size])
            self.blocks.pop(h, None)
            self.blocks[h] = prev
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return n > 0

    def _drop(self, why: str, n: int) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + n

    def hashes(self) -> list[int]:
        """llmgw's hashes of the blocks held, least recently stored first."""
        return list(self.blocks.values())


# An adapter's name as llmgw writes one (`llmgw_core.adapters.Adapter.name`): a LoRA name
# past it is none the gateways route to.
_ADAPTER_NAME = re.compile(rf"[A-Za-z0-9_-]{{1,{NAME_MAX}}}")


def lora_only(keys: Any, lora: str) -> bool:
    """Whether one block's extra keys name nothing but its LoRA adapter (vLLM puts the name
    first where the request has one): none, or the name alone."""
    if not keys:
        return True
    return bool(lora) and isinstance(keys, (list, tuple)) and len(keys) == 1 and keys[0] == lora
