"""One active placement per cluster: a lease in a KV bucket, taken and renewed by compare-and-set.
Here in the bus, the only door to NATS: placement holds it, `llmgw up` reads it (`read_lease`).

No clocks are compared between machines: a standby takes over when the
lease's revision has not moved for `timeout` seconds by its own clock.

Only another holder's write ends a lease. A renewal that timed out may still
have landed (NATS buffers a publish across a reconnect), leaving this holder
one revision behind its own write: the next compare-and-set fails, the lease
is read back, and if it still names this holder the revision is adopted. A
bus fault (timeout, no responders while a stream elects a leader, a
reconnect) costs one renewal, retried; it never ends the process.
"""

from __future__ import annotations

import logging
import time

import anyio
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from llmgw_core.errors import BusError

from .connection import transient
from .facade import Bus

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
        # When this holder last proved it held the lease (time.monotonic()).
        self.proved_at = 0.0
        # The last renewal NATS refused for space (see `renew`): it proves as much as a renewal.
        self.refused_for_space_at = 0.0
        # Who held the lease when this process last read it ("" while none did).
        self.seen_holder = ""
        self._lock = anyio.Lock()
        self._failing_since: float | None = None

    async def _kv(self) -> KeyValue:
        return await self.bus.kv(self.bus.names.leases_bucket)

    def _outage(self, what: str, exc: BaseException) -> None:
        """Log a bus fault once per outage, not once per call."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "%s: %s failed, retrying until NATS answers: %s", self.holder, what, exc or type(exc).__name__
            )

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.warning(
                "%s: NATS answers again after %.1f s", self.holder, time.monotonic() - self._failing_since
            )
            self._failing_since = None

    async def acquire(self) -> None:
        """Return once this process holds the lease."""
        seen_rev = -1
        seen_at = time.monotonic()
        while True:
            try:
                rev = await self._try_acquire(seen_rev, seen_at)
                self._recovered()
                if rev is None:
                    return
                if rev != seen_rev:
                    seen_rev, seen_at = rev, time.monotonic()
            except nats.js.errors.NotFoundError:
                continue
            except (nats.errors.Error, OSError, BusError) as exc:
                if isinstance(exc, nats.errors.Error | OSError) and not transient(exc):
                    log.warning("%s: reading the lease failed: %s", self.holder, exc)
                self._outage("taking the lease", exc)
                # A silence of our own is not the holder's: start its timeout again.
                seen_rev, seen_at = -1, time.monotonic()
            await anyio.sleep(self.interval / 2)

    async def _try_acquire(self, seen_rev: int, seen_at: float) -> int | None:
        """None once this process holds the lease; else the revision the holder is at."""
        kv = await self._kv()
        try:
            self.revision = int(await kv.create(LEASE_KEY, self.holder.encode()))
            self.proved_at = time.monotonic()
            log.info("%s: took the placement lease (revision %d)", self.holder, self.revision)
            return None
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        entry = await kv.get(LEASE_KEY)
        rev = int(entry.revision or 0)
        deleted = entry.operation in ("DEL", "PURGE")
        self.seen_holder = "" if deleted else (entry.value or b"").decode(errors="replace")
        if not deleted and entry.value == self.holder.encode():
            # Our own lease, from before a reconnect: keep it.
            self.revision = rev
            self.proved_at = time.monotonic()
            return None
        stale = rev == seen_rev and time.monotonic() - seen_at >= self.timeout
        if deleted or stale:
            try:
                self.revision = int(await kv.update(LEASE_KEY, self.holder.encode(), last=rev))
            except nats.js.errors.KeyWrongLastSequenceError:
                return rev
            self.proved_at = time.monotonic()
            log.info("%s: took over the placement lease from a silent holder", self.holder)
            return None
        return rev

    async def renew(self) -> None:
        """Compare-and-set the lease forward; LeaseLost if another process has taken it,
        BusError if NATS could not be asked (the caller retries later).

        Placement calls this before every write that places or removes a
        replica (fencing): a holder that was paused past the timeout finds out
        here, before it writes, that a standby took over.
        """
        async with self._lock:
            stream = f"KV_{self.bus.names.leases_bucket}"
            try:
                await self._renew()
            except (nats.errors.Error, OSError) as exc:
                # A refusal for space is said as one; renewals that time out for a whole lease
                # timeout while the server answers are a stream that stopped storing.
                failing = (
                    self._failing_since is not None and time.monotonic() - self._failing_since > self.timeout
                )
                what = "renewing the placement lease"
                full = await self.bus.refusal(stream, what, exc)
                if full is not None:
                    # NATS answered, and refuses this write for space: it refuses every other
                    # placement's take-over the same way, so this one still leads (and every
                    # placing write still renews first, so it cannot write past a successor).
                    # A renewal that got no answer at all proves nothing, whatever it is said as.
                    self.refused_for_space_at = time.monotonic()
                elif failing:
                    full = await self.bus.refusal(stream, what, exc, unanswered=True)
                self._outage("renewing the lease", full or exc)
                raise full or BusError(f"lease renewal failed: {exc or type(exc).__name__}") from exc
            except BusError as exc:
                self._outage("renewing the lease", exc)
                raise
            self.bus.note_write(stream)
            self._recovered()

    async def _renew(self) -> None:
        kv = await self._kv()
        try:
            self.revision = int(await kv.update(LEASE_KEY, self.holder.encode(), last=self.revision))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            try:
                entry = await kv.get(LEASE_KEY)
            except nats.js.errors.NotFoundError:
                entry = None
            if entry is None or entry.operation in ("DEL", "PURGE") or entry.value != self.holder.encode():
                raise LeaseLost(f"{self.holder}: the placement lease was taken by another process") from exc
            # A renewal of ours landed after its caller gave up on it: adopt it and move on.
            try:
                self.revision = int(
                    await kv.update(LEASE_KEY, self.holder.encode(), last=int(entry.revision or 0))
                )
            except nats.js.errors.KeyWrongLastSequenceError as again:
                # Written again meanwhile, by another process (a standby taking over): lost.
                # (Raised on, it ended the process: the bus's refusal read an err_code nats-py's
                # error does not carry.) Standing by, it takes the lease back if it is its own.
                moved = f"{self.holder}: the placement lease moved while this holder adopted it"
                raise LeaseLost(moved) from again
        self.proved_at = time.monotonic()

    def failing_for(self) -> float:
        """How long every call to NATS about the lease has failed (0 while they answer): a
        standby that cannot read the lease could not take it over either."""
        return 0.0 if self._failing_since is None else time.monotonic() - self._failing_since

    def proven(self) -> bool:
        """Whether this holder proved its lease recently enough that no standby can have taken it."""
        return time.monotonic() - max(self.proved_at, self.refused_for_space_at) < self.timeout

    async def hold(self) -> None:
        """Renew every interval until cancelled; raises LeaseLost only if another process took it."""
        while True:
            await anyio.sleep(self.interval)
            try:
                await self.renew()
            except BusError:
                continue

    async def release(self) -> None:
        try:
            kv = await self._kv()
            await kv.delete(LEASE_KEY, last=self.revision)
        except (nats.errors.Error, OSError, BusError):
            return


async def read_lease(bus: Bus) -> tuple[int, str]:
    """The placement lease: its revision and holder ((0, "") while there is none, or while NATS
    cannot be asked)."""
    try:
        kv = await bus.kv(bus.names.leases_bucket)
        entry = await kv.get(LEASE_KEY)
    except (nats.js.errors.KeyNotFoundError, nats.errors.Error, OSError, BusError):
        return 0, ""
    if entry.operation in ("DEL", "PURGE") or not entry.value:
        return int(entry.revision or 0), ""
    return int(entry.revision or 0), entry.value.decode(errors="replace")
