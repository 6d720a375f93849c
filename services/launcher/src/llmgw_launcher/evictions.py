"""Models evicted from this node's store to make room, told to the cluster as node events.

`Weights` evicts while it stages (the log says it there); the launcher tells each
eviction on `<prefix>.node.<node>.weights` from its own task group, so a slow or
failing publish never holds up the staging that evicted, and a failure costs
that one event, said in the log.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import WeightsEvicted, now

from .weights import Eviction

log = logging.getLogger("llmgw.launcher")


class Evictions:
    def __init__(self, bus: Bus, node: str) -> None:
        self.bus = bus
        self.node = node
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Tell evictions until cancelled (those told before this runs are only logged)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None

    def tell(self, eviction: Eviction) -> None:
        """A model evicted to make room, as a node event (the log said it already); never blocks."""
        event = WeightsEvicted(
            node=self.node,
            key=eviction.key,
            path=str(eviction.path),
            freed_bytes=eviction.freed,
            last_used_at=eviction.used_at,
            reason=eviction.words,
            at=now(),
        )

        async def send() -> None:
            try:
                await self.bus.publish(self.bus.names.node_weights(self.node), event)
            except BusError as exc:
                log.warning("cannot publish the eviction of %s: %s", eviction.key, exc)

        if self._tg is not None:
            self._tg.start_soon(send)
