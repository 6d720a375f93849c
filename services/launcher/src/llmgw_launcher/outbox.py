"""Shard statuses on their way to the bus, sent in batches.

A runner hands its status over and carries on; it never waits on NATS. The
outbox sends what has gathered as one batch in two steps: first every
shard's newest status into the status bucket (one write or delete per
shard, all at once), then every transition as an event (each shard's in
order, the shards at once). So a shard that went `starting → loading →
ready` while the previous batch was in flight costs one bucket write, not
three round trips, and an event is published only after the bucket holds
its state or a newer one: whoever reads the bucket on seeing the event sees
no older state.

A write that fails is logged and dropped: the bucket is level-triggered, the
next status of that shard writes it again.

Each status keeps the trace context it was queued in, so its event carries
the shard's trace (`traceparent`) as if the runner had published it itself.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import anyio
import anyio.abc
from opentelemetry import context as otel_context

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus

log = logging.getLogger("llmgw.launcher")

# A batch that takes longer than this (the bus is gone) is abandoned; the
# bucket catches up with the next status of each shard.
SEND_TIMEOUT_S = 15.0


class StatusOutbox:
    def __init__(self, bus: Bus, node: str) -> None:
        self.bus = bus
        self.node = node
        self._pending: list[tuple[ShardStatus, otel_context.Context]] = []
        self._wake = anyio.Event()
        self._lock = anyio.Lock()
        self.batches = 0
        self.sent = 0

    def push(self, status: ShardStatus) -> None:
        """Queue a status; never blocks."""
        self._pending.append((status, otel_context.get_current()))
        self._wake.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Send batches until cancelled; what is queued then is still sent (bounded by SEND_TIMEOUT_S)."""
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        """Send everything queued so far."""
        async with self._lock:
            while self._pending:
                batch, self._pending = self._pending, []
                # Shielded: a batch taken off the queue is sent, or given up at the timeout.
                with anyio.CancelScope(shield=True), anyio.move_on_after(SEND_TIMEOUT_S) as scope:
                    await self._send(batch)
                if scope.cancelled_caught:
                    log.warning(
                        "%s: gave up sending %d shard statuses after %gs",
                        self.node,
                        len(batch),
                        SEND_TIMEOUT_S,
                    )
                self.batches += 1
                self.sent += len(batch)

    async def _send(self, batch: list[tuple[ShardStatus, otel_context.Context]]) -> None:
        by_shard: dict[str, list[tuple[ShardStatus, otel_context.Context]]] = defaultdict(list)
        for status, ctx in batch:
            by_shard[status.shard].append((status, ctx))
        async with anyio.create_task_group() as tg:
            for shard, statuses in by_shard.items():
                tg.start_soon(self._write_bucket, shard, statuses[-1][0])
        async with anyio.create_task_group() as tg:
            for shard, statuses in by_shard.items():
                tg.start_soon(self._publish_events, shard, statuses)

    async def _write_bucket(self, shard: str, status: ShardStatus) -> None:
        names = self.bus.names
        key = names.shard_key(self.node, shard)
        try:
            if status.state == "stopped":
                await self.bus.delete(names.shard_status_bucket, key)
            else:
                await self.bus.put(names.shard_status_bucket, key, status)
        except Exception as exc:  # a bus fault costs this write, never the launcher
            log.warning("shard %s: could not write %s to the status bucket: %s", key, status.state, exc)

    async def _publish_events(
        self, shard: str, statuses: list[tuple[ShardStatus, otel_context.Context]]
    ) -> None:
        subject = self.bus.names.shard_event(self.node, shard)
        for status, ctx in statuses:
            token = otel_context.attach(ctx)
            try:
                await self.bus.publish(subject, status)
            except Exception as exc:  # a bus fault costs this event, never the launcher
                log.warning("shard %s: could not publish %s: %s", subject, status.state, exc)
            finally:
                otel_context.detach(token)
