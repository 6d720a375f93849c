"""Shard statuses on their way to the bus: whatever gathered goes in one commit.

A runner hands its status over and carries on; it never waits on NATS. One
sender takes everything queued since its last send: each shard's newest
status goes into the status bucket, and then each shard's transitions are
published as events, in order, all as one commit per stream (an atomic batch,
`Bus.commit`). So a shard that went `starting → loading → ready` while a send
was in flight costs one bucket write, not three, and fifty shards that change
at once cost two commits, not a hundred round trips. An event is published
only after the bucket holds its state or a newer one, so whoever reads the
bucket on seeing the event sees no older state.

A send that fails is logged and dropped: the bucket is level-triggered, the
next status of that shard writes it again.

Each status keeps the trace context it was queued in, so its event carries
the shard's trace (`traceparent`) as if the runner had published it itself.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc
from opentelemetry import context as otel_context
from opentelemetry import propagate

from llmgw_core.bus import Bus, Writes
from llmgw_core.events import ShardStatus

log = logging.getLogger("llmgw.launcher")

# A shard's batch that takes longer than this (the bus is gone) is abandoned;
# the bucket catches up with the shard's next status.
SEND_TIMEOUT_S = 15.0

# A status, the trace context it was queued in, and whether it is published as an event too.
Queued = tuple[ShardStatus, otel_context.Context, bool]


class StatusOutbox:
    def __init__(self, bus: Bus, node: str) -> None:
        self.bus = bus
        self.node = node
        self._pending: dict[str, list[Queued]] = {}
        self._sending = False
        self._idle = anyio.Event()
        self._idle.set()
        self._tg: anyio.abc.TaskGroup | None = None
        self.batches = 0
        self.sent = 0

    def push(self, status: ShardStatus, *, event: bool = True) -> None:
        """Queue a status; never blocks. With `event=False` it only goes to the bucket (a new
        load of a ready engine: the bucket holds it, the events carry only transitions)."""
        self._pending.setdefault(status.shard, []).append((status, otel_context.get_current(), event))
        if self._tg is not None:
            self._start(self._tg)

    def _start(self, tg: anyio.abc.TaskGroup) -> None:
        if self._sending:
            return  # the sender takes this status with its next batch
        self._sending = True
        if self._idle.is_set():
            self._idle = anyio.Event()
        tg.start_soon(self._drain, name="shard statuses")

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send statuses as they come until cancelled; what is queued then is still sent."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._pending:
                    self._start(tg)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        """Return once everything queued so far has been sent (or given up)."""
        async with anyio.create_task_group() as tg:
            if self._pending:
                self._start(tg)
            await self._idle.wait()

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, {}
                # Shielded: a batch taken off the queue is sent, or given up at the timeout.
                with anyio.CancelScope(shield=True), anyio.move_on_after(SEND_TIMEOUT_S) as scope:
                    await self._send(batch)
                count = sum(len(b) for b in batch.values())
                if scope.cancelled_caught:
                    log.warning("gave up sending %d shard statuses after %gs", count, SEND_TIMEOUT_S)
                self.batches += 1
                self.sent += count
        finally:
            self._sending = False
            self._idle.set()

    async def _send(self, batch: dict[str, list[Queued]]) -> None:
        names = self.bus.names
        bucket, events = Writes(), Writes()
        for shard, queued in batch.items():
            newest = queued[-1][0]
            key = names.shard_key(self.node, shard)
            if newest.state == "stopped":
                bucket.delete(names.shard_status_bucket, key)
            else:
                bucket.put(names.shard_status_bucket, key, newest)
            subject = names.shard_event(self.node, shard)
            for status, ctx, as_event in queued:
                if not as_event:
                    continue
                carrier: dict[str, str] = {}
                propagate.inject(carrier, context=ctx)
                events.publish(subject, status, traceparent=carrier.get("traceparent", ""))
        try:
            await self.bus.commit(bucket)
        except Exception as exc:  # a bus fault costs this write, never the launcher
            log.warning("could not write %d shard statuses to the status bucket: %s", len(bucket), exc)
        try:
            await self.bus.commit(events)
        except Exception as exc:  # a bus fault costs these events, never the launcher
            log.warning("could not publish %d shard events: %s", len(events), exc)
