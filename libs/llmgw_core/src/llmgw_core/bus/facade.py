"""`Bus`: what a service holds to use the bus, one object over the parts that do the work.

    Connection    connect, reconnects, lost for good      (connection.py)
    Space         writes refused for space                 (space.py)
    DeadLetters   bad messages to the DLQ                  (deadletter.py)
    Streams       streams and buckets with their limits    (streams.py, ../topology.py)
    Losses        streams gone under a running cluster     (loss.py)
    Publisher     events, plain messages, heartbeats       (publish.py)
    KV            one key's reads and writes, snapshots    (kv.py)
    Batches       many writes in one commit                (batch.py)
    Watches       watches, subscriptions                   (watch.py)
    Replay        a stream's history, then what comes      (replay.py)
    Plain         requests, answers, plain subscriptions   (plain.py)

Each method here says what it is for and hands the call to its part.

`Bus` is the only door to NATS: no module outside this package touches nats-py's client
or JetStream context (tests/test_bus_door.py walks the tree for it). `nc` and `js` stay
attributes for tests that play a raw or hostile client.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from ..errors import StoreFull
from ..events import Heartbeat
from ..store import Limits, StoreWatch, stream_limits
from ..subjects import ALL, Names
from .batch import Batches, Writes
from .connection import Connection
from .deadletter import DeadLetters
from .kv import KV, KVChange
from .loss import Losses
from .options import BusOptions
from .plain import Plain
from .publish import Publisher
from .replay import REPLAY_IDLE_S, Replay, Replayed
from .space import Space
from .streams import Streams
from .watch import Watches

T = TypeVar("T", bound=msgspec.Struct)
# A stream's records may be a union of message kinds (`llmgw ctl events`).
V = TypeVar("V")


class Bus:
    """NATS JetStream with llmgw's rules built in (see the package's docstring)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.nc: Client = conn.nc
        self.js: JetStreamContext = conn.js
        self.options: BusOptions = conn.options
        self.names: Names = conn.names
        self.service: str = conn.service
        self.lost: anyio.Event = conn.lost
        # Each stream's limits, as `ensure` sets them.
        self.limits: dict[str, Limits] = stream_limits(conn.options, conn.names)
        self.space = Space(conn)
        self.dlq = DeadLetters(conn, self.space)
        self.kvs = KV(conn, self.space, self.dlq, self.limits)
        self.batches = Batches(conn, self.space)
        # Streams and buckets that vanished under this client (a store emptied or replaced).
        self.losses = Losses(conn.service)
        self.streams = Streams(conn, self.space, self.kvs, self.batches, self.limits, self.losses)
        self.publisher = Publisher(conn, self.space)
        self.watches = Watches(conn, self.kvs, self.dlq, self.losses)
        self.replays = Replay(conn, self.dlq)
        self.plain = Plain(conn, self.dlq)

    # --- the connection ------------------------------------------------------

    @classmethod
    async def connect(cls, options: BusOptions | None = None, *, service: str) -> Bus:
        """Connect as `service` (BusOptions() reads LLMGW_NATS_*); BusError says what refused whom."""
        return cls(await Connection.open(options or BusOptions(), service))

    @property
    def connected(self) -> bool:
        """Whether this client can hear the bus now (see `connected_since`)."""
        return self.conn.connected

    @property
    def connected_since(self) -> float:
        """Since when (time.monotonic()): a judge of liveness grants a fresh timeout from then."""
        return self.conn.connected_since

    @property
    def disconnected_since(self) -> float:
        """Since when (time.monotonic()) this client cannot hear the bus, while it cannot."""
        return self.conn.disconnected_since

    @property
    def closed(self) -> bool:
        """Whether NATS closed this client's connection (for good, or being closed)."""
        return bool(self.conn.nc.is_closed)

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (0 before it said)."""
        return int(self.conn.nc.max_payload or 0)

    @property
    def denied_total(self) -> int:
        """Publishes and subscriptions the server refused, since this client connected."""
        return int(getattr(self.conn.nc, "denied_total", 0))

    @property
    def reconnects(self) -> int:
        return self.conn.reconnects

    @property
    def closing(self) -> bool:
        return self.conn.closing

    @property
    def lost_cause(self) -> str:
        """Why the connection is `lost` for good, once it is."""
        return self.conn.lost_cause

    def raise_if_final(self, exc: BaseException) -> None:
        """Raise what no retry can help (ConnectionLost, SubjectTooLong); return otherwise."""
        self.conn.raise_if_final(exc)

    async def close(self) -> None:
        """Drain and close the connection."""
        await self.conn.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.close()

    # --- writes refused for space ----------------------------------------------

    @property
    def store(self) -> StoreWatch:
        """Whether writes are refused for space now, and since when."""
        return self.space.store

    def note_write(self, stream: str) -> None:
        """A write to `stream` landed: an episode of writes refused for space may be over."""
        self.space.note_write(stream)

    async def refusal(
        self, stream: str, what: str, exc: BaseException, *, unanswered: bool = False
    ) -> StoreFull | None:
        """The StoreFull that a failed write to `stream` is, if NATS refused it for space."""
        return await self.space.refusal(stream, what, exc, unanswered=unanswered)

    # --- streams and buckets -------------------------------------------------

    async def ensure(self) -> None:
        """Create or update llmgw's streams and buckets with this configuration's limits; safe to repeat."""
        await self.streams.ensure()

    async def rebuild(self) -> list[str]:
        """Make again, with their limits, the streams and buckets that are gone (the store was
        emptied or replaced); the ones that were gone. Placement's, before it writes."""
        return await self.streams.rebuild()

    async def kv(self, bucket: str) -> KeyValue:
        """nats-py's handle of a bucket, created if missing."""
        return await self.kvs.kv(bucket)

    # --- publishing ----------------------------------------------------------

    async def publish(self, subject: str, msg: msgspec.Struct, *, msg_id: str | None = None) -> int:
        """Publish an event to JetStream; returns its sequence (a duplicate gets the first's)."""
        return await self.publisher.publish(subject, msg, msg_id=msg_id)

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Plain NATS publish, for liveness: nothing is stored."""
        await self.publisher.publish_core(subject, msg)

    async def heartbeat(
        self, node: str, service: str, interval: float, beat: Callable[[], Heartbeat] | None = None
    ) -> None:
        """Beat on `<prefix>.heartbeat.<node>.<service>` every `interval` until cancelled."""
        await self.publisher.heartbeat(node, service, interval, beat)

    # --- one key ---------------------------------------------------------------

    async def put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        """Write a key (retried: a put is idempotent)."""
        return await self.kvs.put(bucket, key, value)

    async def create(self, bucket: str, key: str, value: msgspec.Struct) -> int | None:
        """Write a key only if it has no value; None if it has one."""
        return await self.kvs.create(bucket, key, value)

    async def update(self, bucket: str, key: str, value: msgspec.Struct, *, last: int) -> int | None:
        """Compare-and-set: write only if the key is still at revision `last`; None if it moved."""
        return await self.kvs.update(bucket, key, value, last=last)

    async def get(self, bucket: str, key: str, kind: type[T]) -> tuple[T, int] | None:
        """A key's value and revision; None if it has none."""
        return await self.kvs.get(bucket, key, kind)

    async def revisions(self, bucket: str, key: str) -> list[tuple[int, bytes | None]]:
        """Every revision of `key` the bucket still holds, newest first (None for a delete)."""
        return await self.kvs.revisions(bucket, key)

    async def delete(self, bucket: str, key: str) -> None:
        """Delete a key (nothing to do if it has no value)."""
        await self.kvs.delete(bucket, key)

    # --- many writes at once ---------------------------------------------------

    async def commit(self, writes: Writes) -> None:
        """Write every queued put, delete and event, as atomic batches where the server takes them."""
        await self.batches.commit(writes)

    # --- snapshots -------------------------------------------------------------

    async def keys(self, bucket: str) -> set[str]:
        """Every key that holds a value now."""
        return await self.kvs.keys(bucket)

    async def stored(self, bucket: str) -> dict[str, tuple[int, bytes, float]]:
        """Each key's last value undecoded, with its revision and when it was stored (Unix s)."""
        return await self.kvs.stored(bucket)

    async def entries(self, bucket: str, kind: type[T], keys: str = ALL) -> dict[str, KVChange[T]]:
        """A snapshot of every key's current value (bad values dead-lettered and skipped)."""
        return await self.kvs.entries(bucket, kind, keys)

    async def changes(
        self, bucket: str, kind: type[T], keys: str = ALL
    ) -> tuple[dict[str, KVChange[T]], int]:
        """A fresh read of each key's last change, deletes and undecodable values included, and
        the highest revision it saw: for checking what a watch has yielded (`KV.changes`)."""
        return await self.kvs.changes(bucket, kind, keys)

    async def stream_info(self, stream: str) -> api.StreamInfo:
        """A stream's configuration and state (how many messages it holds, from when)."""
        return await self.replays.info(stream)

    async def last(self, stream: str, subject: str, kind: type[T]) -> T | None:
        """The last message on `subject` that `stream` holds; None if it holds none, or if that
        one does not decode (it goes to the DLQ)."""
        return await self.replays.last(stream, subject, kind)

    async def history(self, subject: str, kind: type[T], *, idle_s: float = 1.0) -> list[T]:
        """Every event on `subject` still in the events stream, oldest first (`replay`, listed)."""
        return await self.replays.history(subject, kind, idle_s=idle_s)

    def replay(
        self,
        subject: str,
        kind: type[V],
        *,
        stream: str = "",
        since: float | None = None,
        follow: bool = False,
        idle_s: float = REPLAY_IDLE_S,
    ) -> AsyncGenerator[Replayed[V] | None, None]:
        """Every record on `subject` its stream still holds (from `since` on), oldest first;
        with `follow`, then None (caught up) and each new one. Bad records go to the DLQ."""
        return self.replays.replay(subject, kind, stream=stream, since=since, follow=follow, idle_s=idle_s)

    # --- bad messages ------------------------------------------------------------

    @property
    def decode_errors(self) -> Counter[str]:
        """Bad messages per subject, since this client connected."""
        return self.dlq.decode_errors

    async def dead_letter(self, subject: str, data: bytes, error: str) -> None:
        """Count a message that could not be handled and copy it to the service's DLQ."""
        await self.dlq.dead_letter(subject, data, error)

    # --- as things happen ------------------------------------------------------------

    async def subscribe_core(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, str], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle plain NATS messages (heartbeats) until cancelled; bad ones go to the DLQ."""
        await self.plain.subscribe_core(subject, kind, handler, task_status=task_status)

    async def listen(
        self,
        subject: str,
        handler: Callable[[str, bytes], Awaitable[None]],
        *,
        queue: str = "",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hand each plain NATS message's subject and bytes to `handler` until cancelled, for a
        handler with a parser of its own; BusError before started if the server refuses."""
        await self.plain.listen(subject, handler, queue=queue, task_status=task_status)

    async def answer(
        self,
        subject: str,
        handler: Callable[[bytes], Awaitable[bytes]],
        *,
        queue: str = "",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer each request on `subject` with `handler(data)` until cancelled; BusError
        before started if the server refuses."""
        await self.plain.answer(subject, handler, queue=queue, task_status=task_status)

    async def request(
        self, subject: str, value: msgspec.Struct | None, kind: type[T], *, timeout: float
    ) -> T:
        """Ask on `subject` and decode the answer; NoAnswer when nobody answers in time,
        DecodeFailure (dead-lettered) when the answer is not a `kind`."""
        return await self.plain.request(subject, value, kind, timeout=timeout)

    def last_per_subject(self, subject: str, kind: type[T]) -> AsyncIterator[tuple[str, T]]:
        """The last event on each subject matching `subject`, then each new one."""
        return self.watches.last_per_subject(subject, kind)

    def watch(
        self, bucket: str, kind: type[T], keys: str = ALL, *, undecodable: bool = False
    ) -> AsyncIterator[KVChange[T]]:
        """Every key's current value, then each change; survives reconnects without missing one."""
        return self.watches.watch(bucket, kind, keys, undecodable=undecodable)
