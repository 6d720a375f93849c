"""A request for a LoRA adapter that no ready replica holds, held while one loads it
(docs/adapters.md): vLLM (and the simulator) load adapters at run time.

The gateway picks one replica that may load it (the least outstanding of those its status says
may), asks that replica's launcher to load it (`AdapterLoad`, request/reply on
`<prefix>.launcher.<node>.adapters`) and holds the request until the replica's status lists the
adapter, then sends it there. Requests for one adapter that arrive while it loads wait on the
same load. The hold is bounded (the gateway's hold timeout); past it, or where the load fails,
the request is answered 503 with the launcher's (or the engine's) words.
"""

from __future__ import annotations

import logging
import time

import anyio

from llmgw_core.adapters import AdapterLoad, AdapterLoaded, load_subject
from llmgw_core.bus import Bus
from llmgw_core.errors import BusError

from .routing import Table

log = logging.getLogger("llmgw.gateway")

# How often a held request looks whether the replica's status lists the adapter yet.
_POLL_S = 0.02


class LoadFailed(Exception):
    """The adapter could not be loaded; the message says why, for the client's 503."""


class AdapterLoads:
    """Loads asked of launchers, one per (replica, adapter) at a time."""

    def __init__(self, bus: Bus | None, table: Table, timeout_s: float = 120.0) -> None:
        self.bus = bus
        self.table = table
        self.timeout_s = timeout_s
        self._pending: dict[tuple[str, str], anyio.Event] = {}
        self._failed: dict[tuple[str, str], str] = {}
        # Loads asked, for the metrics and the benchmark.
        self.asked = 0

    def choose(self, cold: dict[str, tuple[str, str]]) -> str:
        """The replica to load on: the least outstanding of `cold`, then by key. Pure."""
        outstanding = self.table.outstanding
        return min(sorted(cold), key=lambda k: outstanding[k])

    async def ensure(self, deployment: str, adapter: str, cold: dict[str, tuple[str, str]]) -> str:
        """The replica of `deployment` that holds `adapter` once loaded (its key); LoadFailed,
        in words, where no replica can be made to hold it in time."""
        deadline = time.monotonic() + self.timeout_s
        holding = self._holding(deployment, adapter)
        if holding is not None:
            return holding
        replica = self.choose(cold)
        key = (replica, adapter)
        event = self._pending.get(key)
        if event is None:
            event = anyio.Event()
            self._pending[key] = event
            self._failed.pop(key, None)
            try:
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    await self._load(deployment, adapter, replica, cold[replica], deadline)
            except LoadFailed as exc:
                self._failed[key] = str(exc)
            finally:
                del self._pending[key]
                event.set()
        else:
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                await event.wait()
        holding = self._holding(deployment, adapter)
        if holding is not None:
            return holding
        failed = self._failed.get(key)
        if failed is not None:
            raise LoadFailed(failed)
        raise LoadFailed(
            f"adapter {adapter} was not loaded on replica {replica} within {self.timeout_s:g}s "
            "(the gateway's hold_timeout_s); retry shortly"
        )

    def _holding(self, deployment: str, adapter: str) -> str | None:
        held = self.table.adapters.holders(adapter)
        if held is None or held[0] != deployment:
            return None
        ready = [k for k, _ in self.table.ready(deployment) if k in held[1]]
        return min(ready, key=lambda k: self.table.outstanding[k]) if ready else None

    async def _load(
        self, deployment: str, adapter: str, replica: str, where: tuple[str, str], deadline: float
    ) -> None:
        if self.bus is None:
            raise LoadFailed(f"adapter {adapter} is not loaded, and this gateway has no bus to ask for it")
        node, shard = where
        request = AdapterLoad(shard=shard, adapter=adapter, recent=self.table.adapters.recent(replica))
        self.asked += 1
        try:
            reply = await self.bus.request(
                load_subject(self.bus.names.prefix, node),
                request,
                AdapterLoaded,
                timeout=max(0.1, deadline - time.monotonic()),
            )
        except BusError as exc:
            raise LoadFailed(
                f"adapter {adapter}: node {node}'s launcher did not answer the load: {exc}"
            ) from None
        if reply.error:
            raise LoadFailed(f"adapter {adapter} cannot be served on node {node}: {reply.error}")
        log.info(
            "adapter %s loaded on %s (%s)%s",
            adapter,
            replica,
            node,
            f", {reply.unloaded} unloaded" if reply.unloaded else "",
        )
        # The reply comes before the status that lists it: wait for that, which routing reads.
        while self._holding(deployment, adapter) is None and time.monotonic() < deadline:
            await anyio.sleep(_POLL_S)
