"""The launcher's relay of its replicas' KV events into the gateways' routing state.

For each shard it runs whose engine publishes KV events (`llmgw_core.engines.vllm`,
`kv_events_endpoint`), the relay subscribes to that socket, keeps what the replica holds
(`kv_events.EngineBlocks`) and, every `interval_s`, writes each replica that changed to the
routing bucket under its key (`<deployment>.<replica>`) as a `RoutingHeld` of source
`engine`: the gateways take it in place of what they routed there.

Level-triggered: each pass reads the shards the launcher runs now, starts a subscriber for
each new endpoint and cancels those of shards gone. A message that fails to decode is
dropped and counted (`refused`); a write the bus refuses is tried at the next pass; nothing
here stops the launcher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from llmgw_core.bus import Bus
from llmgw_core.engines.vllm import KV_TOPIC, kv_events_endpoint
from llmgw_core.errors import BusError
from llmgw_core.events import ShardSpec
from llmgw_core.prefixes import RoutingHeld, pack

from .kv_events import MAX_MESSAGE_BYTES, EngineBlocks, KVEventError, decode

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger("llmgw.launcher")

# Messages queued in ZMQ for a slow relay before the newest are dropped (a gap, counted).
RECEIVE_HWM = 10_000
# The most frames read of one message: vLLM sends three.
MAX_FRAMES = 3


@dataclass
class Followed:
    """One replica's subscription: its key in the routing bucket, its endpoint, what it holds."""

    key: str
    endpoint: str
    blocks: EngineBlocks
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    dirty: bool = False
    received: int = 0
    refused: int = 0
    last_refusal: str = ""


def routing_key(spec: ShardSpec) -> str:
    return f"{spec.deployment}.{spec.replica}"


def wanted(specs: dict[str, ShardSpec]) -> dict[str, tuple[str, str]]:
    """Shard key -> (routing key, endpoint) for each shard whose engine publishes KV events."""
    out = {}
    for key, spec in specs.items():
        # The sim engine publishes as vLLM does, on the same flags (`llmgw_core.engines.sim`).
        publishes = spec.profile.engine in ("vllm", "sim")
        endpoint = kv_events_endpoint(spec) if publishes and spec.deployment else ""
        if endpoint:
            out[key] = (routing_key(spec), endpoint)
    return out


async def receive(sock: zmq.asyncio.Socket) -> list[bytes]:
    """One message's frames; beyond MAX_FRAMES the rest are read and thrown away, so a
    message of a million frames costs no memory (each frame is bounded by MAXMSGSIZE). A
    message of more than MAX_FRAMES comes back with one frame more, for `decode` to refuse."""
    import zmq

    frames: list[bytes] = []
    while True:
        frame = await sock.recv()
        if len(frames) <= MAX_FRAMES:
            frames.append(frame)
        if not sock.getsockopt(zmq.RCVMORE):
            return frames


class KVRelay:
    """Subscribes to the KV events of the shards `shards()` names, and writes what each
    replica holds to the routing bucket as `writer` (`launcher-<node>`)."""

    def __init__(
        self,
        bus: Bus,
        writer: str,
        shards: Callable[[], dict[str, ShardSpec]],
        *,
        interval_s: float = 0.5,
    ) -> None:
        self.bus = bus
        self.writer = writer
        self.shards = shards
        self.interval_s = interval_s
        self.followed: dict[str, Followed] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._failing = False
        self._no_zmq = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                while True:
                    try:
                        self.follow(tg)
                        await self.write()
                    except Exception:  # a pass's fault costs the pass, never the launcher
                        log.exception("relaying the engines' KV events failed; trying again")
                    await anyio.sleep(self.interval_s)
        finally:
            if self._ctx is not None:
                self._ctx.destroy(linger=0)

    def follow(self, tg: anyio.abc.TaskGroup) -> None:
        """Start a subscriber for each shard that publishes KV events; cancel those gone."""
        want = wanted(self.shards())
        if want and not self._zmq():
            return
        for shard, followed in list(self.followed.items()):
            if want.get(shard) != (followed.key, followed.endpoint):
                followed.scope.cancel()
                del self.followed[shard]
        for shard, (key, endpoint) in sorted(want.items()):
            if shard not in self.followed:
                deployment = key.partition(".")[0]
                followed = Followed(key=key, endpoint=endpoint, blocks=EngineBlocks(deployment))
                self.followed[shard] = followed
                tg.start_soon(self._subscribe, followed, name=f"kv events {shard}")

    def _zmq(self) -> bool:
        """Whether ZMQ is here (pyzmq: vLLM needs it, the launcher only for this); said once."""
        if self._ctx is not None:
            return True
        try:
            import zmq.asyncio
        except ImportError as exc:
            if not self._no_zmq:
                log.warning(
                    "a profile asks for KV events but pyzmq is not installed beside the launcher "
                    "(%s): its replicas are routed by what the gateways sent them; install pyzmq",
                    exc,
                )
            self._no_zmq = True
            return False
        self._ctx = zmq.asyncio.Context()
        return True

    async def _subscribe(self, followed: Followed) -> None:
        """Follow one replica's socket until cancelled; a fault ends only this subscription,
        which the next pass starts again."""
        try:
            await self._follow_socket(followed)
        except Exception:
            log.exception("KV events of %s from %s: the subscription failed", followed.key, followed.endpoint)
            for shard, found in list(self.followed.items()):
                if found is followed:
                    del self.followed[shard]

    async def _follow_socket(self, followed: Followed) -> None:
        import zmq

        assert self._ctx is not None
        with followed.scope:
            sock = self._ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
                # The launcher listens and vLLM's publisher connects: vLLM binds only a
                # wildcard endpoint (`tcp://*:port`, every interface), and connects to any
                # other. ZMQ reconnects by itself, so an engine that restarts is followed on.
                sock.bind(followed.endpoint)
                log.info("following the KV events of %s on %s", followed.key, followed.endpoint)
                while True:
                    self.take(followed, await receive(sock))
            finally:
                sock.close(linger=0)

    def take(self, followed: Followed, frames: list[bytes]) -> None:
        """One message of a replica's events, applied; a refused one dropped and counted."""
        followed.received += 1
        try:
            message = decode(frames)
        except KVEventError as exc:
            followed.refused += 1
            if followed.refused == 1 or followed.refused % 1000 == 0:
                log.warning(
                    "KV events of %s from %s: message refused (%d so far): %s",
                    followed.key,
                    followed.endpoint,
                    followed.refused,
                    exc,
                )
            followed.last_refusal = str(exc)
            return
        if followed.blocks.apply(message):
            followed.dirty = True

    async def write(self) -> None:
        """Each replica whose blocks changed since the last write, one put each."""
        bucket = self.bus.names.routing_bucket
        error: BusError | None = None
        for followed in sorted(self.followed.values(), key=lambda f: f.key):
            if not followed.dirty:
                continue
            followed.dirty = False
            blocks = followed.blocks
            value = RoutingHeld(
                gateway=self.writer,
                blocks=pack(blocks.hashes()),
                at=time.time(),
                source="engine",
                block_tokens=blocks.block_size,
            )
            try:
                await self.bus.put(bucket, followed.key, value)
            except BusError as exc:
                followed.dirty = True
                error = exc
        if error is not None and not self._failing:
            log.warning("cannot write the routing bucket %s (retrying each pass): %s", bucket, error)
        self._failing = error is not None
