"""A durable JetStream consumer over the bus, as the tests drive one: a bad message goes
to the DLQ and is terminated; a handler that raises gets its message redelivered, and
after `max_deliver` tries dead-lettered. No service consumes this way (they watch
buckets), so it lives with the tests."""

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
from nats.js import api
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from llmgw_core.bus import Bus, DecodeFailure
from llmgw_core.bus.tracing import messaging, tracer

log = logging.getLogger("llmgw.bus")

T = TypeVar("T", bound=msgspec.Struct)


async def consume(
    bus: Bus,
    subject: str,
    kind: type[T],
    handler: Callable[[T, Msg], Awaitable[None]],
    *,
    durable: str,
    stream: str | None = None,
    max_deliver: int = 5,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Handle each message on a JetStream subject (durable pull consumer) until cancelled.

    A message that does not decode goes to the DLQ and is terminated; one
    whose handler raises is redelivered with a delay, and after
    `max_deliver` tries goes to the DLQ too.
    """
    bus.conn.check(subject)
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_deliver=max_deliver, ack_wait=30)
    sub = await bus.js.pull_subscribe(
        subject, durable=durable, stream=stream or bus.names.events_stream, config=cfg
    )
    task_status.started()
    try:
        while True:
            try:
                msgs = await sub.fetch(batch=64, timeout=1)
            except nats.errors.TimeoutError:
                continue
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                bus.raise_if_final(exc)
                await anyio.sleep(0.2)
                continue
            for msg in msgs:
                await _handle(bus, msg, kind, handler, max_deliver)
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()


async def _handle(
    bus: Bus,
    msg: Msg,
    kind: type[T],
    handler: Callable[[T, Msg], Awaitable[None]],
    max_deliver: int,
) -> None:
    try:
        value = bus.dlq.decode(kind, msg.subject, msg.data)
    except DecodeFailure as exc:
        await bus.dead_letter(msg.subject, msg.data, exc.error)
        await msg.term()
        return
    ctx = propagate.extract(dict(msg.headers or {}))
    token = otel_context.attach(ctx)
    try:
        with tracer.start_as_current_span(
            f"handle {msg.subject}",
            kind=trace.SpanKind.CONSUMER,
            attributes=messaging(msg.subject, "process", msg.data),
        ):
            await handler(value, msg)
    except anyio.get_cancelled_exc_class():
        raise
    except Exception as exc:
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        if delivered >= max_deliver:
            await bus.dead_letter(msg.subject, msg.data, f"handler failed {delivered} times: {exc}")
            await msg.term()
        else:
            log.warning(
                "%s: handler for %s failed (try %d of %d): %s",
                bus.service,
                msg.subject,
                delivered,
                max_deliver,
                exc,
            )
            await msg.nak(delay=min(30.0, 0.5 * 2**delivered))
        return
    finally:
        otel_context.detach(token)
    await msg.ack()
