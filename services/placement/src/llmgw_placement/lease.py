"""One active placement per cluster: a lease in a KV bucket, taken and renewed by compare-and-set.

No clocks are compared between machines: a standby takes over when the
lease's revision has not moved for `timeout` seconds by its own clock.
"""

from __future__ import annotations

import logging
import time

import anyio
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from llmgw_core.bus import Bus

log = logging.getLogger("llmgw.placement.lease")

LEASE_KEY = "placement"


class LeaseLost(Exception):
    pass


class Lease:
    def __init__(self, bus: Bus, holder: str, *, interval: float, timeout: float) -> None:
        self.bus = bus
        self.holder = holder
        self.interval = interval
        self.timeout = timeout
        self.revision = 0
        self._lock = anyio.Lock()

    async def _kv(self) -> KeyValue:
        return await self.bus.kv(self.bus.names.leases_bucket)

    async def acquire(self) -> None:
        """Return once this process holds the lease."""
        seen_rev = -1
        seen_at = time.monotonic()
        while True:
            kv = await self._kv()
            try:
                self.revision = int(await kv.create(LEASE_KEY, self.holder.encode()))
                log.info("%s: took the placement lease (revision %d)", self.holder, self.revision)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError):
                await anyio.sleep(self.interval)
                continue
            try:
                entry = await kv.get(LEASE_KEY)
                rev = int(entry.revision or 0)
                deleted = entry.operation in ("DEL", "PURGE")
            except nats.js.errors.NotFoundError:
                continue
            except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError):
                await anyio.sleep(self.interval)
                continue
            if rev != seen_rev:
                seen_rev, seen_at = rev, time.monotonic()
            stale = time.monotonic() - seen_at >= self.timeout
            if deleted or stale:
                try:
                    self.revision = int(await kv.update(LEASE_KEY, self.holder.encode(), last=rev))
                    log.info("%s: took over the placement lease from a silent holder", self.holder)
                    return
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
            await anyio.sleep(self.interval / 2)

    async def renew(self) -> None:
        """Compare-and-set the lease forward; LeaseLost if another process has taken it.

        Placement calls this before every write that places or removes a
        replica (fencing): a holder that was paused past the timeout finds out
        here, before it writes, that a standby took over.
        """
        async with self._lock:
            kv = await self._kv()
            try:
                self.revision = int(await kv.update(LEASE_KEY, self.holder.encode(), last=self.revision))
            except nats.js.errors.KeyWrongLastSequenceError as exc:
                raise LeaseLost(f"{self.holder}: the placement lease was taken by another process") from exc

    async def hold(self) -> None:
        """Renew every interval until cancelled; raises LeaseLost if another process took it."""
        while True:
            await anyio.sleep(self.interval)
            try:
                await self.renew()
            except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError) as exc:
                log.warning("%s: lease renewal failed: %s", self.holder, exc)

    async def release(self) -> None:
        kv = await self._kv()
        try:
            await kv.delete(LEASE_KEY, last=self.revision)
        except (nats.errors.Error, nats.js.errors.KeyWrongLastSequenceError):
            return
