"""`Bus`: what a service holds to use the bus, one object over the parts that do the work.

    Connection    connect, reconnects, lost for good      (connection.py)
    Space         writes refused for space                 (space.py)
    DeadLetters   bad messages to the DLQ                  (deadletter.py)
    Streams       streams and buckets with their limits    (streams.py, ../topology.py)
    Publisher     events, plain messages, heartbeats       (publish.py)
    KV            one key's reads and writes, snapshots    (kv.py)
    Batches       many writes in one commit                (batch.py)
    Watches       watches, subscriptions, event history    (watch.py)

Each method here says what it is for and hands the call to its part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from ..errors import StoreFull
from ..events import Heartbeat
from ..store import Limits, StoreWatch, stream_limits
from ..subjects import ALL, Names
from .batch import Batches, Writes
from .connection import Connection
from .deadletter import DeadLetters
from .kv import KV, KVChange
from .options import BusOptions
from .publish import Publisher
from .space import Space
from .streams import Streams
from .watch import Watches

T = TypeVar("T", bound=msgspec.Struct)


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
        self.streams = Streams(conn, self.space, self.kvs, self.batches, self.limits)
        self.publisher = Publisher(conn, self.space)
        self.watches = Watches(conn, self.kvs, self.dlq)

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

    async def entries(self, bucket: str, kind: type[T], keys: str = ALL) -> dict[str, KVChange[T]]:
        """A snapshot of every key's current value (bad values dead-lettered and skipped)."""
        return await self.kvs.entries(bucket, kind, keys)

    async def history(self, subject: str, kind: type[T], *, idle_s: float = 1.0) -> list[T]:
        """Every event on `subject` still in the events stream, oldest first."""
        return await self.watches.history(subject, kind, idle_s=idle_s)

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
        await self.watches.subscribe_core(subject, kind, handler, task_status=task_status)

    def last_per_subject(self, subject: str, kind: type[T]) -> AsyncIterator[tuple[str, T]]:
        """The last event on each subject matching `subject`, then each new one."""
        return self.watches.last_per_subject(subject, kind)

    def watch(
        self, bucket: str, kind: type[T], keys: str = ALL, *, undecodable: bool = False
    ) -> AsyncIterator[KVChange[T]]:
        """Every key's current value, then each change; survives reconnects without missing one."""
        return self.watches.watch(bucket, kind, keys, undecodable=undecodable)
