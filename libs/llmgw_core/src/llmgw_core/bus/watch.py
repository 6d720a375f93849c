"""Reading as things happen: KV watches that survive reconnects, plain NATS subscriptions
(heartbeats), and each subject's last event then every new one."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from ..access import PermissionDenied
from ..errors import BusError
from ..events import decoder
from ..retry import Retry
from ..subjects import ALL, Names
from .connection import Connection
from .deadletter import DeadLetters, decode_error
from .kv import KNOWN, KV, KVChange, deletes
from .loss import Losses

log = logging.getLogger("llmgw.bus")

T = TypeVar("T", bound=msgspec.Struct)

# A watch lets its caller's other tasks turn after this many messages taken in one run.
WATCH_TURN_EVERY = 64


class Watches:
    def __init__(self, conn: Connection, kv: KV, dlq: DeadLetters, losses: Losses | None = None) -> None:
        self.conn = conn
        self.kv = kv
        self.dlq = dlq
        self.losses = losses or Losses(conn.service)

    async def last_per_subject(self, subject: str, kind: type[T]) -> AsyncIterator[tuple[str, T]]:
        """The last event still in the events stream on each subject matching `subject`, then
        every new one, as `(subject, value)`, for as long as the caller iterates (placement's
        `DeploymentStatus` per deployment, for a reader that starts after it was published).
        A consumer lost to a reconnect or a server restart is opened again: what came
        meanwhile comes out as each subject's last. Values that do not decode go to the DLQ."""
        self.conn.check(subject)
        dec = decoder(kind)

        async def open_consumer(on_msg: Callable[[Msg], Awaitable[None]]) -> Subscription:
            return await self.conn.js.subscribe(
                subject,
                stream=self.conn.names.events_stream,
                cb=on_msg,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                inactive_threshold=300,
            )

        async with contextlib.aclosing(self._ordered(f"reading {subject}", open_consumer)) as messages:
            async for msg in messages:
                if msg is None:
                    continue
                try:
                    value = dec.decode(msg.data)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    await self.dlq.dead_letter(msg.subject, msg.data, decode_error(exc))
                    continue
                yield msg.subject, value

    async def _ordered(
        self, what: str, open_consumer: Callable[[Callable[[Msg], Awaitable[None]]], Awaitable[Subscription]]
    ) -> AsyncGenerator[Msg | None, None]:
        """Every message of the consumer `open_consumer` makes, opened again after a reconnect
        (what it delivers first then is the caller's to sort out: None comes out at each opening,
        before its messages); a consumer that cannot be opened is retried with backoff, its
        outage said once (`what`: `watching <bucket>`).

        Messages that arrived together come out together, with no turn of the event loop
        between them: the consumer's callback only puts each in an inbox."""
        retry = Retry(log, f"{self.conn.service}: {what}", base_s=0.5, cap_s=5.0, known=KNOWN)
        while True:
            epoch = self.conn.reconnects
            inbox: deque[Msg] = deque()
            arrived = [anyio.Event()]

            async def on_msg(
                msg: Msg, inbox: deque[Msg] = inbox, arrived: list[anyio.Event] = arrived
            ) -> None:
                inbox.append(msg)
                arrived[0].set()

            try:
                sub = await open_consumer(on_msg)
            except PermissionDenied as exc:  # a configuration error: retrying cannot help
                raise BusError(f"{self.conn.service}: {what} is not allowed: {exc}") from exc
            except KNOWN as exc:
                self.conn.raise_if_final(exc)
                retry.failed(exc)
                await retry.wait()
                continue
            retry.succeeded()
            try:
                yield None
                while True:
                    if not inbox:
                        arrived[0] = anyio.Event()
                        with anyio.move_on_after(1.0):
                            await arrived[0].wait()
                        if not inbox:
                            if self.conn.reconnects != epoch:
                                break  # open it again: what came meanwhile comes out then
                            continue
                    yield inbox.popleft()
            finally:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(nats.errors.Error, OSError):
                        await sub.unsubscribe()

    async def watch(
        self, bucket: str, kind: type[T], keys: str = ALL, *, undecodable: bool = False
    ) -> AsyncIterator[KVChange[T]]:
        """Every key's current value first, then each change, for as long as the caller iterates.

        After a reconnect (a restarted server, a network cut) the watch is
        opened again and every key whose revision moved past what was already
        yielded comes out, deletes included, so nothing written while away is
        missed. A value that does not decode goes to the DLQ and is skipped;
        with `undecodable` it comes out too, as a change with no value and its
        `error`, so that the caller can keep the key's last good value.

        Messages that arrived together come out together, with no turn of the
        event loop between them: the ordered consumer's callback only puts each
        in an inbox, and a change is yielded straight from it. nats-py's own
        `KeyValue.watch` (like `next_msg`) costs a task and a timed wait per
        message, one turn of the loop or more each; with fifty engines starting
        on two cores a turn takes a tenth of a second and more, and fifty shard
        specs that reached a launcher at once came out of its watch over 9 s.
        A caller that wants the same should not wait on the loop per change either.
        After every WATCH_TURN_EVERY messages the loop turns once, so that a long run
        (thousands of shard statuses) does not hold the caller's other tasks back.
        """
        self.conn.check(Names.kv_subject(bucket, keys))
        prefix = Names.kv_subject(bucket, "")
        seen: dict[str, int] = {}
        taken = 0
        # When the bucket's stream was created, as each opening found it: a new one is a bucket
        # made anew (the store emptied or replaced), whose revisions start again at 1.
        created: list[object] = [None, None]

        async def open_consumer(on_msg: Callable[[Msg], Awaitable[None]]) -> Subscription:
            await self.kv.kv(bucket)  # the bucket exists, and this identity may read it
            created[1] = (await self.conn.js.stream_info(f"KV_{bucket}")).created
            return await self.kv.last_per_key(bucket, keys, on_msg)

        async with contextlib.aclosing(self._ordered(f"watching {bucket} {keys}", open_consumer)) as messages:
            async for msg in messages:
                if msg is None:
                    replaced = created[0] is not None and created[1] != created[0]
                    created[0] = created[1]
                    if replaced:
                        # Every key yielded from the old stream is gone with it: a gateway kept
                        # accepting a deleted key and routing to vanished replicas, and a new
                        # key's revision 1 was taken for one already seen. What the new stream
                        # holds (restored, or written since) comes out after.
                        self.losses.noticed([f"KV_{bucket}"], back=True)
                        for key in sorted(seen):
                            yield KVChange(key, None, 0)
                        seen.clear()
                    continue
                taken += 1
                if taken % WATCH_TURN_EVERY == 0:
                    # A long run of messages still lets the caller's other tasks turn.
                    await anyio.lowlevel.checkpoint()
                key = msg.subject[len(prefix) :]
                rev = msg.metadata.sequence.stream
                if rev <= seen.get(key, 0):
                    continue  # already yielded (a consumer opened again after a reconnect)
                seen[key] = rev
                deleted = deletes(msg.headers)
                if deleted is None:
                    continue  # a marker of a kind this client does not know
                if deleted:
                    yield KVChange(key, None, rev)
                    continue
                value = await self.kv.decoded(bucket, key, msg.data or b"", kind)
                if not isinstance(value, str):
                    yield KVChange(key, value, rev)
                elif undecodable:
                    yield KVChange(key, None, rev, error=value)
