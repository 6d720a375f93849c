"""A stream's history: the one reader of what a stream still holds on a subject, oldest
first, optionally from a time on, and then (`follow`) each new message as it comes.

Every record that does not decode goes to the DLQ (counted, logged with its subject) and
the reader goes on: one bad record never costs the others.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from ..access import PermissionDenied
from ..errors import BusError
from ..retry import Retry
from ..topology import stream_of
from .connection import Connection
from .deadletter import DeadLetters, DecodeFailure, decode
from .kv import KNOWN

log = logging.getLogger("llmgw.bus")

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)

# Without `follow`, the history ends when a message says none is pending, or when none has
# come for this long (a subject with no message at all says nothing).
REPLAY_IDLE_S = 0.5
# While following: how often the reader looks whether a reconnect cost it its consumer.
FOLLOW_CHECK_S = 1.0


@dataclass(frozen=True)
class Replayed(Generic[T]):
    """One record of a stream's history: its subject, when the stream stored it, its value."""

    subject: str
    time: float
    value: T


class Replay:
    def __init__(self, conn: Connection, dlq: DeadLetters) -> None:
        self.conn = conn
        self.dlq = dlq

    async def replay(
        self,
        subject: str,
        kind: type[T],
        *,
        stream: str = "",
        since: float | None = None,
        follow: bool = False,
        idle_s: float = REPLAY_IDLE_S,
    ) -> AsyncGenerator[Replayed[T] | None, None]:
        """Every record on `subject` (wildcards allowed) that `stream` (by default the one its
        subject is stored in) still holds, oldest first; from `since` (a Unix time) on when
        given. Without `follow` it ends once caught up. With `follow` it yields None once
        caught up, then each new record for as long as the caller iterates; a consumer lost
        to a reconnect is opened again after the last record taken, so none comes twice.

        BusError when the stream cannot be read at first (a refusal, an outage: the caller
        decides whether to try again); once read, a consumer lost while following is opened
        again, with backoff, its outage said once."""
        self.conn.check(subject)
        stream = stream or stream_of(self.conn.names, subject)
        retry = Retry(log, f"{self.conn.service}: reading {subject}", base_s=0.5, cap_s=5.0, known=KNOWN)
        taken = 0  # the stream sequence of the last record taken
        caught_up = False
        opened = False
        while True:
            epoch = self.conn.reconnects
            inbox: deque[Msg] = deque()
            arrived = [anyio.Event()]

            async def on_msg(
                msg: Msg, inbox: deque[Msg] = inbox, arrived: list[anyio.Event] = arrived
            ) -> None:
                inbox.append(msg)
                arrived[0].set()

            policy, config = _start(taken, since)
            try:
                sub = await self.conn.js.subscribe(
                    subject,
                    stream=stream,
                    cb=on_msg,
                    ordered_consumer=True,
                    deliver_policy=policy,
                    config=config,
                )
            except PermissionDenied as exc:  # a configuration error: retrying cannot help
                raise BusError(f"{self.conn.service}: reading {subject} is not allowed: {exc}") from exc
            except KNOWN as exc:
                self.conn.raise_if_final(exc)
                if not opened:
                    raise BusError(f"cannot read {subject}: {exc or type(exc).__name__}") from exc
                retry.failed(exc)
                await retry.wait()
                continue
            retry.succeeded()
            opened = True
            try:
                while True:
                    if not inbox:
                        arrived[0] = anyio.Event()
                        with anyio.move_on_after(FOLLOW_CHECK_S if caught_up else idle_s):
                            await arrived[0].wait()
                    if not inbox:
                        if not caught_up:  # nothing more has come: that was all
                            caught_up = True
                            if not follow:
                                return
                            yield None
                        elif self.conn.reconnects != epoch:
                            break  # open it again, after the last record taken
                        continue
                    msg = inbox.popleft()
                    meta = msg.metadata
                    if meta.sequence.stream <= taken:
                        continue
                    taken = meta.sequence.stream
                    try:
                        value = decode(kind, msg.subject, msg.data)  # type: ignore[type-var]
                    except DecodeFailure as exc:
                        await self.dlq.dead_letter(msg.subject, msg.data, exc.error)
                    else:
                        yield Replayed(msg.subject, meta.timestamp.timestamp(), value)
                    if not caught_up and meta.num_pending == 0:
                        caught_up = True
                        if not follow:
                            return
                        yield None
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def info(self, stream: str) -> api.StreamInfo:
        """`stream`'s configuration and state; BusError when it cannot be read."""
        try:
            return await self.conn.js.stream_info(stream)
        except (nats.errors.Error, OSError) as exc:
            self.conn.raise_if_final(exc)
            raise BusError(f"cannot read the stream {stream}: {exc or type(exc).__name__}") from exc

    async def last(self, stream: str, subject: str, kind: type[S]) -> S | None:
        """The last message on `subject` that `stream` holds; None when it holds none, or when
        that one does not decode (it goes to the DLQ). BusError when it cannot be read."""
        self.conn.check(subject)
        try:
            msg = await self.conn.js.get_msg(stream, subject=subject, direct=False)
        except nats.js.errors.NotFoundError:
            return None
        except (nats.errors.Error, OSError) as exc:
            self.conn.raise_if_final(exc)
            raise BusError(f"cannot read {subject}: {exc or type(exc).__name__}") from exc
        data = msg.data or b""
        try:
            return decode(kind, subject, data)
        except DecodeFailure as exc:
            await self.dlq.dead_letter(subject, data, exc.error)
            return None

    async def history(self, subject: str, kind: type[T], *, stream: str = "", idle_s: float) -> list[T]:
        """`replay` without `follow`, as a list of the values."""
        found: list[T] = []
        replayed = self.replay(subject, kind, stream=stream, idle_s=idle_s)
        async with contextlib.aclosing(replayed):
            async for record in replayed:
                if record is not None:
                    found.append(record.value)
        return found


def _start(taken: int, since: float | None) -> tuple[api.DeliverPolicy | None, api.ConsumerConfig | None]:
    """Where a consumer starts: after the last record taken, else at `since`, else at the start."""
    if taken:
        return api.DeliverPolicy.BY_START_SEQUENCE, api.ConsumerConfig(opt_start_seq=taken + 1)
    if since is not None:
        start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
        return api.DeliverPolicy.BY_START_TIME, api.ConsumerConfig(opt_start_time=start)
    return None, None
