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

A send whose bucket write fails (NATS down, or refusing writes for space) is
said once per outage (and once when it ends) and written again after llmgw's
backoff (`llmgw_core.retry`: jittered, growing to a cap):
each shard's newest status, unless a newer one is queued by then. A shard
that changes nothing while NATS cannot store would otherwise keep its last
state in the bucket for good (`loading` for an engine long ready). Its events
go with that later write; the transitions in between are not told.

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
from llmgw_core.errors import StoreFull
from llmgw_core.events import ShardStatus
from llmgw_core.retry import Retry

log = logging.getLogger("llmgw.launcher")

# A shard's batch that takes longer than this (the bus is gone) is abandoned;
# the bucket catches up with the shard's next status.
SEND_TIMEOUT_S = 15.0
# The pause before a status the bucket did not take is written again, growing to the cap.
RETRY_FIRST_S = 0.5
RETRY_CAP_S = 10.0

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
        # Each shard's newest status that the bucket did not take, written again after a pause.
        self._retry: dict[str, Queued] = {}
        self._retry_due = False
        # The shards of the batch being sent: each has a status newer than any waiting retry.
        self._in_flight: frozenset[str] = frozenset()
        self._retrying = Retry(
            log,
            f"{node}: writing shard statuses to the status bucket",
            base_s=RETRY_FIRST_S,
            cap_s=RETRY_CAP_S,
            clock=anyio.current_time,
        )

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
                self._in_flight = frozenset(batch)
                # Shielded: a batch taken off the queue is sent, or given up at the timeout.
                failure: BaseException | str | None = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(SEND_TIMEOUT_S) as scope:
                    failure = await self._send(batch)
                count = sum(len(b) for b in batch.values())
                if scope.cancelled_caught:
                    failure = f"gave up after {SEND_TIMEOUT_S:g}s"
                if failure is None:
                    self._written(batch)
                else:
                    self._failed(batch, count, failure)
                self.batches += 1
                self.sent += count
        finally:
            self._in_flight = frozenset()
            self._sending = False
            self._idle.set()

    def _written(self, batch: dict[str, list[Queued]]) -> None:
        # A shard whose newer status just landed is not written again with the older one that
        # failed before it: the retry would put the bucket back to `starting` for good.
        for shard in batch:
            self._retry.pop(shard, None)
        self._retrying.succeeded()

    def _failed(self, batch: dict[str, list[Queued]], count: int, failure: BaseException | str) -> None:
        """The bucket did not take `batch`: each shard's newest status is written again later."""
        # A StoreFull was said by the bus, once, as the episode it is; this says what it costs.
        said = failure if isinstance(failure, str) else str(failure) or type(failure).__name__
        self._retrying.failed(
            f"{said} ({count} statuses; each shard's newest is written again until one lands)"
        )
        for shard, queued in batch.items():
            self._retry[shard] = queued[-1]
        if self._tg is not None and not self._retry_due:
            self._retry_due = True
            self._tg.start_soon(self._retry_later, name="shard statuses again")

    async def _retry_later(self) -> None:
        await self._retrying.wait()
        self._retry_due = False
        retry, self._retry = self._retry, {}
        for shard, queued in retry.items():
            # A newer status queued or on its way meanwhile wins: written after it lands, this
            # one would put the bucket back for good. If that newer one fails, it is retried.
            if shard not in self._in_flight:
                self._pending.setdefault(shard, [queued])
        if self._pending and self._tg is not None:
            self._start(self._tg)

    async def _send(self, batch: dict[str, list[Queued]]) -> BaseException | None:
        """Write the batch's newest statuses, then publish its events; the bucket's failure, if
        it did not take them (the events are then not published: they would tell of states the
        bucket does not hold)."""
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
            return exc
        try:
            await self.bus.commit(events)
        except StoreFull:
            pass  # said by the bus, once per episode
        except Exception as exc:  # a bus fault costs these events, never the launcher
            log.warning("could not publish %d shard events: %s", len(events), exc)
        return None
