"""The simulator's prompt cache and tokenizer, spoken as vLLM speaks them.

- **Tokens**: a prompt's ids are its whitespace-separated words, each the CRC-32 of its UTF-8
  bytes; a chat is rendered by a fixed template first (`<|role|>` before each message's
  content, `<|assistant|>` after the last where a generation prompt is added), a completion's
  prompt led by BOS. `POST /tokenize` answers vLLM's `TokenizeResponse` for vLLM's request
  (`{"model", "messages", "add_generation_prompt"}` or `{"model", "prompt",
  "add_special_tokens"}`), and the chat and completions endpoints cache the same ids.
- **Cache**: the whole BLOCK_TOKENS-token blocks of each prompt answered, an LRU of
  `--kv-blocks` blocks, each keyed by a chained SHA-256 of its tokens (as vLLM's default
  hash: the sim's own, never the gateways'), a prompt's first block seeded by the LoRA adapter
  its request named where one is loaded (vLLM keys an adapter's blocks apart too, and names it
  in the event: `lora_name`, and first in each block's `extra_keys`). `POST
  /reset_prefix_cache` empties it.
- **Events**: with `--kv-events-config` (the JSON the vLLM adapter passes, `endpoint` and
  `topic` read), each change is published as vLLM does: a PUB socket that connects to the
  endpoint, one message of three frames (topic, 8-byte big-endian sequence, msgpack
  `[ts, events, 0]`) of `BlockStored`, `BlockRemoved` and `AllBlocksCleared` maps. An XPUB
  socket, so that what is stored before the launcher's subscription arrives is held (at most
  HELD_BATCHES) and sent once it does, not dropped as a plain PUB drops it: a block whose
  parent the relay never heard is dropped there, and a sim's cache is small.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Container
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..web import json_response
from ._body import json_object

# Tokens in a block: vLLM's default block size.
BLOCK_TOKENS = 16
BOS = 1
# How long a publish waits for the launcher's subscription while none has come.
JOIN_WAIT_S = 1.0
# Event batches held while no subscriber has joined.
HELD_BATCHES = 1024


def word_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in text.split()]


def _content(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def chat_ids(messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
    """A chat's ids as the sim's template renders it."""
    ids: list[int] = []
    for m in messages:
        role = m.get("role", "user") if isinstance(m, dict) else "user"
        content = m.get("content", "") if isinstance(m, dict) else m
        ids += word_ids(f"<|{role}|> {_content(content)}")
    if add_generation_prompt:
        ids += word_ids("<|assistant|>")
    return ids


def prompt_ids(prompt: str, add_special_tokens: bool = True) -> list[int]:
    return ([BOS] if add_special_tokens else []) + word_ids(prompt)


def request_ids(body: dict[str, Any], chat: bool) -> list[int] | None:
    """The ids of a chat (`messages`) or completion (`prompt`) request's prompt, as /tokenize
    and the cache make them; None where it holds neither."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        generation = body.get("add_generation_prompt", not body.get("continue_final_message"))
        return chat_ids(messages, generation is True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    return prompt_ids(prompt, body.get("add_special_tokens", True) is True)


def tokenize(body: dict[str, Any], max_model_len: int) -> tuple[int, dict[str, Any]]:
    """vLLM's `/tokenize` answer to `body`: (status, JSON)."""
    ids = request_ids(body, chat="messages" in body)
    if ids is None:
        return 400, {"error": {"message": "give `messages` (a list) or `prompt` (a string)"}}
    return 200, {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


class Publisher:
    """vLLM's ZMQ publisher of KV events, connected to `endpoint`."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.joined = False
        self.waited = False
        self.held: deque[bytes] = deque(maxlen=HELD_BATCHES)
        # Closed as the process ends: a context left open can hold its exit.
        atexit.register(self.close)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    @classmethod
    def of(cls, config: str) -> Publisher | None:
        """From `--kv-events-config` (vLLM's JSON); None where it asks for no events."""
        if not config:
            return None
        parsed = json.loads(config)
        if not parsed.get("enable_kv_cache_events") or not parsed.get("endpoint"):
            return None
        return cls(str(parsed["endpoint"]), str(parsed.get("topic", "")))

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        self.held.append(msgspec.msgpack.encode([time.time(), events, 0]))
        if not self.joined:
            # A subscription message (first byte 1) says the launcher listens. Waited for a
            # moment at the first publish (at most): the launcher's socket may be bound (and
            # ours connected) a little after the first prompt, and what is held goes out only
            # with a later publish; an engine nobody follows must not wait at every one.
            deadline = time.monotonic() + (0.0 if self.seq or self.waited else JOIN_WAIT_S)
            self.waited = True
            while not self.joined:
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self.sock.poll(left_ms):
                    break
                self.joined |= self.sock.recv()[:1] == b"\x01"
            if not self.joined:
                return
        while self.held:
            payload = self.held.popleft()
            self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload], self._zmq.NOBLOCK)
            self.seq += 1


class KVCache:
    """The sim's prompt cache: an LRU of `capacity` blocks, each change published."""

    def __init__(self, capacity: int, publisher: Publisher | None = None) -> None:
        self.capacity = max(1, capacity)
        self.publisher = publisher
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def store(self, ids: list[int], lora: str = "") -> None:
        """A prompt answered (under LoRA adapter `lora`, "" for none): its whole blocks cached,
        the new ones stored (one event), the least recently used beyond `capacity` removed
        (another). As vLLM's, an adapter's blocks are keyed apart from the base's, and its
        event names it (`lora_name`, and first in each block's extra keys)."""
        parent: bytes | None = None
        root = b"lora\0" + lora.encode() if lora else b""
        new: list[bytes] = []
        new_parent: bytes | None = None
        new_tokens: list[int] = []
        for start in range(0, len(ids) // BLOCK_TOKENS * BLOCK_TOKENS, BLOCK_TOKENS):
            tokens = ids[start : start + BLOCK_TOKENS]
            h = hashlib.sha256((parent or root) + json.dumps(tokens).encode()).digest()
            if not new and h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                if not new:
                    new_parent = parent
                new.append(h)
                new_tokens += tokens
                self.blocks.pop(h, None)
                self.blocks[h] = None
            parent = h
        events: list[dict[str, Any]] = []
        if new:
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": new,
                    "parent_block_hash": new_parent,
                    "token_ids": new_tokens,
                    "block_size": BLOCK_TOKENS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": lora or None,
                    "extra_keys": [[lora]] * len(new) if lora else None,
                }
            )
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        if self.publisher is not None:
            self.publisher.publish(events)

    def clear(self) -> None:
        self.blocks.clear()
        if self.publisher is not None:
            self.publisher.publish([{"type": "AllBlocksCleared"}])


def add_args(p: argparse.ArgumentParser) -> None:
    """The sim's flags for its cache: vLLM's own (`--kv-events-config`, and
    `--enable-prefix-caching`, always on here), its size, and a slow tokenizer for tests."""
    p.add_argument("--kv-events-config", default="", help="vLLM's KV events JSON (endpoint, topic)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="accepted (always on)")
    p.add_argument("--kv-blocks", type=int, default=256, help="blocks of the prompt cache")
    p.add_argument("--tokenize-delay", type=float, default=0.0, help="seconds /tokenize takes")


class Routes:
    """`POST /tokenize` and `POST /reset_prefix_cache`, and the cache the answers fill."""

    def __init__(self, config: str, blocks: int, delay: float, max_model_len: int) -> None:
        self.cache = KVCache(blocks, Publisher.of(config))
        self.delay = delay
        self.max_model_len = max_model_len

    def answered(self, body: dict[str, Any], chat: bool, loaded: Container[str] = ()) -> None:
        """A request answered: its prompt cached, under the adapter its `model` names where
        that is one of the adapters `loaded`."""
        ids = request_ids(body, chat)
        model = body.get("model")
        if ids is not None:
            self.cache.store(ids, model if isinstance(model, str) and model in loaded else "")

    async def tokenize(self, req: Request) -> Response:
        if self.delay:
            await anyio.sleep(self.delay)
        body = await json_object(req)
        if isinstance(body, str):
            return json_response({"error": {"message": body}}, 400)
        status, answer = tokenize(body, self.max_model_len)
        return json_response(answer, status)

    async def reset(self, _: Request) -> Response:
        self.cache.clear()
        return json_response({})
