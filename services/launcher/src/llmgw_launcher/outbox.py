"""Shard statuses on their way to the bus: every shard its own pipeline, none waits on another.

A runner hands its status over and carries on; it never waits on NATS. Each
shard with statuses to send has one sender: it writes the shard's newest
status into the status bucket, then publishes each of the shard's
transitions as an event, in order, and starts again with whatever gathered
meanwhile. So a shard that went `starting → loading → ready` while its
previous write was in flight costs one bucket write, not three round trips;
the shards' writes are in flight together on the one connection (a burst is
pipelined, not sent one round trip at a time); and an event is published only
after the bucket holds its state or a newer one, so whoever reads the bucket
on seeing the event sees no older state.

A write that fails is logged and dropped: the bucket is level-triggered, the
next status of that shard writes it again.

Each status keeps the trace context it was queued in, so its event carries
the shard's trace (`traceparent`) as if the runner had published it itself.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc
from opentelemetry import context as otel_context

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus

log = logging.getLogger("llmgw.launcher")

# A shard's batch that takes longer than this (the bus is gone) is abandoned;
# the bucket catches up with the shard's next status.
SEND_TIMEOUT_S = 15.0

Queued = tuple[ShardStatus, otel_context.Context]


class StatusOutbox:
    def __init__(self, bus: Bus, node: str) -> None:
        self.bus = bus
        self.node = node
        self._pending: dict[str, list[Queued]] = {}
        self._sending: set[str] = set()
        self._idle = anyio.Event()
        self._idle.set()
        self._tg: anyio.abc.TaskGroup | None = None
        self.batches = 0
        self.sent = 0

    def push(self, status: ShardStatus) -> None:
        """Queue a status; never blocks."""
        self._pending.setdefault(status.shard, []).append((status, otel_context.get_current()))
        if self._tg is not None:
            self._start(self._tg, status.shard)

    def _start(self, tg: anyio.abc.TaskGroup, shard: str) -> None:
        if shard in self._sending:
            return  # its sender takes this status with its next batch
        self._sending.add(shard)
        if self._idle.is_set():
            self._idle = anyio.Event()
        tg.start_soon(self._drain, shard, name=f"status of {shard}")

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send statuses as they come until cancelled; what is queued then is still sent."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for shard in list(self._pending):
                    self._start(tg, shard)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        """Return once everything queued so far has been sent (or given up)."""
        async with anyio.create_task_group() as tg:
            for shard in list(self._pending):
                self._start(tg, shard)
            await self._idle.wait()

    async def _drain(self, shard: str) -> None:
        try:
            while batch := self._pending.pop(shard, None):
                # Shielded: a batch taken off the queue is sent, or given up at the timeout.
                with anyio.CancelScope(shield=True), anyio.move_on_after(SEND_TIMEOUT_S) as scope:
                    await self._send(shard, batch)
                if scope.cancelled_caught:
                    log.warning(
                        "shard %s: gave up sending %d statuses after %gs", shard, len(batch), SEND_TIMEOUT_S
                    )
                self.batches += 1
                self.sent += len(batch)
        finally:
            self._sending.discard(shard)
            if not self._sending:
                self._idle.set()

    async def _send(self, shard: str, batch: list[Queued]) -> None:
        names = self.bus.names
        newest = batch[-1][0]
        key = names.shard_key(self.node, shard)
        try:
            if newest.state == "stopped":
                await self.bus.delete(names.shard_status_bucket, key)
            else:
                await self.bus.put(names.shard_status_bucket, key, newest)
        except Exception as exc:  # a bus fault costs this write, never the launcher
            log.warning("shard %s: could not write %s to the status bucket: %s", key, newest.state, exc)
        subject = names.shard_event(self.node, shard)
        for status, ctx in batch:
            token = otel_context.attach(ctx)
            try:
                await self.bus.publish(subject, status)
            except Exception as exc:  # a bus fault costs this event, never the launcher
                log.warning("shard %s: could not publish %s: %s", key, status.state, exc)
            finally:
                otel_context.detach(token)
