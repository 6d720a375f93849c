"""A request for a LoRA adapter that no ready replica holds, held while one loads it
(docs/adapters.md): vLLM (and the simulator) load adapters at run time.

The gateway picks one replica that may load it (the least outstanding of those its status says
may), asks that replica's launcher to load it (`AdapterLoad`, request/reply on
`<prefix>.launcher.<node>.adapters`) and holds the request until the replica's status lists the
adapter, then sends it there. Requests for one adapter that arrive while it loads wait on the
same load. Where every adapter the replica holds has requests running or waiting, its launcher
loads nothing and says so (`AdapterLoaded.retryable`): the gateway asks the other replicas that
may load it, and all of them again after a short wait, within the hold. The hold is bounded (the
gateway's hold timeout); past it, or where the load fails, the request is answered 503 with the
launcher's (or the engine's) words, with a Retry-After where the replicas were busy.
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
# A replica whose adapters all have requests running or waiting is asked again after this,
# doubling up to the cap: a chat answer takes seconds, and every ask reads the engine's metrics.
_BUSY_WAIT_S = 0.1
_BUSY_WAIT_CAP_S = 1.0
# The Retry-After of a request whose hold ended while every replica was busy.
BUSY_RETRY_AFTER_S = 2
# A request sent this recently may not be in its engine's count of requests yet (in transit,
# being tokenized): its adapter is named in flight with a load, not to be unloaded for room.
IN_FLIGHT_S = 2.0
# How many busy replicas' words a refusal quotes.
_BUSY_SAID = 3


class LoadFailed(Exception):
    """The adapter could not be loaded; the message says why, for the client's 503.
    `retry_after`: where the replicas were busy (seconds worth waiting), else None."""

    def __init__(self, words: str, retry_after: int | None = None) -> None:
        super().__init__(words)
        self.retry_after = retry_after


class AdapterLoads:
    """Loads asked of launchers, one per (replica, adapter) at a time."""

    def __init__(
        self, bus: Bus | None, table: Table, timeout_s: float = 120.0, in_flight_s: float = IN_FLIGHT_S
    ) -> None:
        self.bus = bus
        self.table = table
        self.timeout_s = timeout_s
        self.in_flight_s = in_flight_s
        self._pending: dict[tuple[str, str], anyio.Event] = {}
        self._failed: dict[tuple[str, str], LoadFailed] = {}
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
                    await self._load(deployment, adapter, replica, cold, deadline)
            except LoadFailed as exc:
                self._failed[key] = exc
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
            raise LoadFailed(str(failed), failed.retry_after)
        raise LoadFailed(
            f"adapter {adapter} was not loaded on replica {replica} within {self.timeout_s:g}s "
            "(the gateway's hold_timeout_s); retry shortly"
        )

    def in_flight(self, replica: str) -> tuple[str, ...]:
        """`replica`'s adapters this gateway may have requests in flight for that its engine does
        not count yet: those it sent one to in the last `in_flight_s`, while it has any there
        (none in flight: a short request sent a moment ago has ended, and keeps nothing loaded)."""
        if self.table.outstanding[replica] <= 0:
            return ()
        return self.table.adapters.sent_within(replica, self.in_flight_s)

    def _holding(self, deployment: str, adapter: str) -> str | None:
        held = self.table.adapters.holders(adapter)
        if held is None or held[0] != deployment:
            return None
        ready = [k for k, _ in self.table.ready(deployment) if k in held[1]]
        return min(ready, key=lambda k: self.table.outstanding[k]) if ready else None

    async def _load(
        self, deployment: str, adapter: str, replica: str, cold: dict[str, tuple[str, str]], deadline: float
    ) -> None:
        """Ask `replica`'s launcher to load `adapter`, then each other of `cold`, while each says
        every adapter it holds is in use; all round again after a wait, until one loads it or the
        hold would end (LoadFailed, with a Retry-After)."""
        outstanding = self.table.outstanding
        order = [replica, *sorted((r for r in cold if r != replica), key=lambda k: (outstanding[k], k))]
        wait = _BUSY_WAIT_S
        while True:
            busy: list[str] = []
            for candidate in order:
                said = await self._ask(adapter, candidate, cold[candidate], deadline)
                if said is None:
                    # The reply comes before the status that lists it: wait for that, which
                    # routing reads.
                    while self._holding(deployment, adapter) is None and time.monotonic() < deadline:
                        await anyio.sleep(_POLL_S)
                    return
                busy.append(said)
            if time.monotonic() + wait >= deadline:
                more = f"; and {len(busy) - _BUSY_SAID} more replicas" if len(busy) > _BUSY_SAID else ""
                raise LoadFailed(
                    f"{'; '.join(busy[:_BUSY_SAID])}{more}; retry in {BUSY_RETRY_AFTER_S}s",
                    BUSY_RETRY_AFTER_S,
                )
            await anyio.sleep(wait)
            wait = min(2 * wait, _BUSY_WAIT_CAP_S)
            if self._holding(deployment, adapter) is not None:  # loaded meanwhile, elsewhere
                return

    async def _ask(self, adapter: str, replica: str, where: tuple[str, str], deadline: float) -> str | None:
        """One load asked of `replica`'s launcher: None where it loaded; the launcher's words
        where every adapter the replica holds is in use (worth asking again); else LoadFailed."""
        if self.bus is None:
            raise LoadFailed(f"adapter {adapter} is not loaded, and this gateway has no bus to ask for it")
        node, shard = where
        index = self.table.adapters
        request = AdapterLoad(
            shard=shard,
            adapter=adapter,
            recent=index.recent(replica),
            in_flight=self.in_flight(replica),
        )
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
        if reply.error and reply.retryable:
            log.info("adapter %s not loaded on %s (%s) yet: %s", adapter, replica, node, reply.error)
            return f"adapter {adapter} cannot be loaded on node {node} now: {reply.error}"
        if reply.error:
            raise LoadFailed(f"adapter {adapter} cannot be served on node {node}: {reply.error}")
        log.info(
            "adapter %s loaded on %s (%s)%s",
            adapter,
            replica,
            node,
            f", {reply.unloaded} unloaded" if reply.unloaded else "",
        )
        return None
