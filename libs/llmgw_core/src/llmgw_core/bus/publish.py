"""Publishing: events to JetStream (deduplicated by `Nats-Msg-Id`, retried with the same
id), plain NATS messages, and heartbeats on a fixed schedule. Every message carries the
current trace context."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable

import anyio
import msgspec
import nats.errors
from opentelemetry import trace

from ..claims import Claimant
from ..errors import BusError, ConnectionLost
from ..events import Heartbeat, encode
from ..retry import CALL_RETRY
from ..topology import stream_of
from .connection import Connection, transient
from .space import Space
from .tracing import inject_trace, messaging, tracer, tracing

log = logging.getLogger("llmgw.bus")


class Publisher:
    def __init__(self, conn: Connection, space: Space) -> None:
        self.conn = conn
        self.space = space
        # Message ids: a random prefix per client and a counter, as unique as a uuid4 per
        # message within the server's duplicate window, at a fraction of the cost.
        self._msg_ids = uuid.uuid4().hex
        self._msg_seq = itertools.count()

    def headers(self, msg_id: str | None) -> dict[str, str]:
        headers = {"Nats-Msg-Id": msg_id or f"{self._msg_ids}{next(self._msg_seq):x}"}
        inject_trace(headers)
        return headers

    async def publish(self, subject: str, msg: msgspec.Struct, *, msg_id: str | None = None) -> int:
        """Publish an event to JetStream; returns its sequence (a duplicate gets the first's)."""
        self.conn.check(subject)
        data = encode(msg)
        if not tracing():
            # Nothing would record a span of this publish: skip making one (it costs more
            # than the rest of llmgw's side), but still pass on the current trace.
            return await self._publish(subject, data, self.headers(msg_id))
        with tracer.start_as_current_span(
            f"publish {subject}",
            kind=trace.SpanKind.PRODUCER,
            attributes=messaging(subject, "publish", data),
        ):
            return await self._publish(subject, data, self.headers(msg_id))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        # One message id for every try: a retried publish that did land is stored once.
        stream = stream_of(self.conn.names, subject)
        attempt = 1
        while True:
            try:
                ack = await self.conn.js.publish(subject, data, headers=headers)
            except (nats.errors.Error, OSError) as exc:
                self.conn.raise_if_final(exc)
                what = f"publish to {subject}"
                last = attempt == 3 or not transient(exc)
                full = await self.space.refusal(stream, what, exc, unanswered=attempt == 3)
                if full is not None:
                    raise full from exc
                if last:
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                self.space.note_write(stream)
                return ack.seq
            await anyio.sleep(CALL_RETRY.wait(attempt))
            attempt += 1

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Plain NATS publish, for liveness: nothing is stored."""
        self.conn.check(subject)
        try:
            await self.conn.nc.publish(subject, encode(msg), headers=self.headers(None))
        except (nats.errors.Error, OSError) as exc:
            self.conn.raise_if_final(exc)
            raise BusError(f"publish to {subject} failed: {exc or type(exc).__name__}") from exc

    async def heartbeat(
        self, node: str, service: str, interval: float, beat: Callable[[], Heartbeat] | None = None
    ) -> None:
        """Publish `<prefix>.heartbeat.<node>.<service>` every `interval` until cancelled. Raises
        only ConnectionLost: beating on a connection that NATS closed for good cannot succeed.

        Each beat is `beat()`, by default one that names this process (`claims.Claimant`)."""
        if beat is None:
            claimant = Claimant.here()

            def beat() -> Heartbeat:
                return claimant.beat(node, service)

        subject = self.conn.names.heartbeat(node, service)
        # Beats keep to a fixed schedule: the time a beat takes to send, or a late wake,
        # shortens the next wait instead of adding to every gap after it. A schedule
        # missed by more than a whole interval (a suspended process) restarts from now
        # rather than sending the missed beats in a burst.
        due = time.monotonic()
        while True:
            try:
                await self.publish_core(subject, beat())
            except ConnectionLost:
                raise
            except Exception as exc:  # liveness must never take a service down
                log.warning("%s: heartbeat failed: %s", service, exc)
            due += interval
            wait = due - time.monotonic()
            if wait < -interval:
                due, wait = time.monotonic(), 0.0
            await anyio.sleep(max(0.0, wait))
