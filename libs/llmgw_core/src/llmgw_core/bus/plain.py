"""Plain NATS messages, nothing stored: requests and their answers, and subscriptions whose
handler reads the bytes itself (a parser of its own, with its own named error).

    BusError
    └── NoAnswer     a request nobody answered: `responders` says whether anyone listens

A handler's fault costs its message, never the subscription; a reply that does not decode
goes to the DLQ like any other bad message.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..errors import BusError
from ..events import decoder, encode
from .connection import Connection
from .deadletter import DeadLetters, DecodeFailure, decode, decode_error

log = logging.getLogger("llmgw.bus")

T = TypeVar("T", bound=msgspec.Struct)


class NoAnswer(BusError):
    """A request nobody answered in time; `responders` is False when nobody listens on its subject."""

    def __init__(self, message: str, *, responders: bool) -> None:
        super().__init__(message)
        self.responders = responders


class Plain:
    def __init__(self, conn: Connection, dlq: DeadLetters) -> None:
        self.conn = conn
        self.dlq = dlq

    async def request(
        self, subject: str, value: msgspec.Struct | None, kind: type[T], *, timeout: float
    ) -> T:
        """Ask on `subject` (an empty body for None) and decode the first answer as a `kind`.
        NoAnswer when nobody answers within `timeout`; DecodeFailure (dead-lettered) when the
        answer is not a `kind`; BusError for any other fault."""
        self.conn.check(subject)
        try:
            reply = await self.conn.nc.request(
                subject, b"" if value is None else encode(value), timeout=timeout
            )
        except nats.errors.NoRespondersError as exc:
            raise NoAnswer(f"nobody answers on {subject}", responders=False) from exc
        except nats.errors.TimeoutError as exc:
            raise NoAnswer(f"no answer on {subject} within {timeout:g} s", responders=True) from exc
        except (nats.errors.Error, OSError) as exc:
            self.conn.raise_if_final(exc)
            raise BusError(f"request on {subject} failed: {exc or type(exc).__name__}") from exc
        try:
            return decode(kind, subject, reply.data)
        except DecodeFailure as exc:
            await self.dlq.dead_letter(subject, reply.data, exc.error)
            raise

    async def listen(
        self,
        subject: str,
        handler: Callable[[str, bytes], Awaitable[None]],
        *,
        queue: str = "",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hand each plain message on `subject` to `handler(subject, data)` until cancelled.
        BusError (before started) when the server will not take the subscription."""

        async def on_msg(msg: Msg) -> None:
            try:
                await handler(msg.subject, msg.data)
            except Exception:  # a handler's fault costs that message, never the subscription
                log.exception("%s: handler for %s failed", self.conn.service, msg.subject)

        await self._hold(subject, on_msg, queue, task_status)

    async def subscribe_core(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, str], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle plain NATS messages (heartbeats) until cancelled; bad ones go to the DLQ.

        The handler runs in the subscription's own callback, one message at a
        time, with no queue of llmgw's in between: a heartbeat handler only
        records a time, and a queue that a burst overflows would turn a busy
        judge into a cluster of "lost" nodes.
        """
        dec = decoder(kind)

        async def on_msg(msg: Msg) -> None:
            try:
                value = dec.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await self.dlq.dead_letter(msg.subject, msg.data, decode_error(exc))
                return
            try:
                await handler(value, msg.subject)
            except Exception as exc:  # a handler's fault costs that message, never the subscription
                log.exception("%s: handler for %s failed: %s", self.conn.service, msg.subject, exc)

        await self._hold(subject, on_msg, "", task_status)

    async def answer(
        self,
        subject: str,
        handler: Callable[[bytes], Awaitable[bytes]],
        *,
        queue: str = "",
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer each request on `subject` with `handler(data)` until cancelled; a handler that
        raises leaves that request unanswered (logged). BusError (before started) when the
        server will not take the subscription."""

        async def on_msg(msg: Msg) -> None:
            try:
                reply = await handler(msg.data)
            except Exception:  # a handler's fault costs that request, never the subscription
                log.exception("%s: cannot answer a request on %s", self.conn.service, msg.subject)
                return
            try:
                await msg.respond(reply)
            except (nats.errors.Error, OSError) as exc:
                log.warning("%s: cannot answer on %s: %s", self.conn.service, msg.subject, exc)

        await self._hold(subject, on_msg, queue, task_status)

    async def _hold(
        self,
        subject: str,
        on_msg: Callable[[Msg], Awaitable[None]],
        queue: str,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        self.conn.check(subject)
        sub: Subscription | None = None
        try:
            try:
                sub = await self.conn.nc.subscribe(subject, queue=queue, cb=on_msg)
                # Started means the server holds the subscription: what another connection
                # sends after that is heard (before the round trip it could be missed).
                await self.conn.nc.flush()
            except (nats.errors.Error, OSError) as exc:
                self.conn.raise_if_final(exc)
                raise BusError(f"cannot subscribe to {subject}: {exc or type(exc).__name__}") from exc
            task_status.started()
            await anyio.sleep_forever()
        finally:
            if sub is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()
